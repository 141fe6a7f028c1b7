"""Cross-request batching of target forwards: concurrent requests share one target pass.

Every request decodes on its own worker thread. With batching on, its target model is a
:class:`BatchedCachedLM`: ``forward`` hands the step to the replica's
:class:`TargetBatcher` and waits. The batcher's thread takes the first waiting step,
gathers the others that arrive within ``window_s`` (up to ``max_batch``), and runs them as
one forward pass.

**Where the KV cache lives: a slot pool.** The batcher owns, per layer, one preallocated
key and one value buffer ``[slots, kv_heads, capacity, head_dim]`` (:class:`SlotPool`).
Each request holds a *slot*, one row, from its first forward until it closes; its cache is
that row's first ``num_cached`` positions. A step

1. writes its new keys/values **in place** at its own row and offset (nothing is appended
   by concatenation, so nothing is reallocated per step);
2. attends over the rows of the step's requests: when their slots are consecutive, as
   they are when the same requests keep stepping together, a *view* of the pool (no copy
   at all); otherwise one gather of those rows;
3. masks each row to its own length (a 4D boolean mask: a request's new tokens see its own
   cache and, causally, each other).

Rolling a request back lowers its length; a closed request's slot is reused. The pool
grows (doubling) in rows when more requests hold slots than it has, and in capacity when a
request's context outgrows it; growth copies the pool once, and is logged.

Before, every batched step copied each request's whole cache into a freshly allocated
padded one and appended the new keys back by concatenation: work that grew with context
length on every step (``benchmarks/batching.py`` measures both).

A step alone in its window attends over its own row with the same boolean mask the
unbatched model builds, so a replica under light load computes what an unbatched one does.
In a batch the logits of a request can differ in the last float bits (different matrix
shapes round differently), which can flip an exact tie in argmax: outputs are the
target's, computed in a batch, as in any batching server.

A token tree (``CachedLM.forward_tree``) runs alone on the batcher thread over its slot,
with the tree's mask.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch
from prometheus_client import Counter, Histogram
from transformers import PreTrainedModel

from specops.core import threads
from specops.serving.engine import lean, ragged
from specops.serving.engine import tree as tree_mod
from specops.serving.engine.kv import CachedLM
from specops.serving.engine.slots import SlotCache, SlotPool
from specops.serving.engine.tree import TokenTree
from specops.serving.engine.types import TargetPass

log = logging.getLogger(__name__)

BATCH_SIZE = Histogram(
    "specops_target_batch_size", "Requests per target forward pass", buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32)
)
PASS_TOKENS = Counter("specops_target_pass_tokens_total", "Tokens computed by target forward passes (padding included)")
PASS_SECONDS = Counter(
    "specops_target_pass_seconds_total",
    "Seconds the batcher thread spent, by what: forward (target passes), gather (waiting for the "
    "steps of requests just back from a pass), idle (no step waiting)",
    ["what"],
)


@dataclass
class _Step:
    lm: BatchedCachedLM
    input_ids: list[int]
    logits_to_keep: int
    want_hidden: bool
    tree: TokenTree | None = None
    """A token tree after ``input_ids`` (``forward_tree``): runs alone, with the tree's mask."""
    done: threading.Event = field(default_factory=threading.Event)
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    error: BaseException | None = None
    target_pass: TargetPass | None = None
    """The pass as it ran (rows, width, the others' tokens): reported back into the verdict."""


class TargetBatcher:
    """Owns the target's forward passes, and its KV cache pool, for every request of a replica."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_batch: int = 8,
        window_s: float = 0.002,
        capacity: int = 256,
        straggle: float = 0.5,
    ) -> None:
        assert max_batch >= 1 and window_s >= 0
        self.model = model
        self.max_batch = max_batch
        self.window_s = window_s
        self.capacity = capacity
        self.pool = SlotPool(model, slots=max_batch, capacity=capacity)
        self.packed = ragged.install(model)
        """Passes without trees run packed (``engine.ragged``): rows end to end, nothing padded."""
        self._pools: dict[int, tuple[SlotPool, bool]] = {id(model): (self.pool, self.packed)}
        """Per model whose passes run here (the target, and drafts: :meth:`lm`): its KV pool, packed or not."""
        self._pools_lock = threading.Lock()
        self._lean: dict[int, lean.LeanDecoder | None] = {}
        """Per model (by id): its lean packed pass (``engine.lean``), or None where it keeps Hugging Face's."""
        if self.packed:
            self._lean[id(model)] = lean.install(model)
        self._later: collections.deque[_Step] = collections.deque()
        """Steps taken off the queue for a later pass (another model's, or a tree): run first, in order."""
        self.num_batches = 0
        self.num_steps = 0
        self.num_gathers = 0
        """Batched steps whose slots were not consecutive (one copy of their rows)."""
        self.active = 0
        """Requests decoding now: the batcher waits for more steps only if others could come."""
        self._active_lock = threading.Lock()
        self._live: set[BatchedCachedLM] = set()
        """Requests holding a slot (``_gather`` waits for those just back from a pass)."""
        self.straggle = straggle
        """How long, as a share of a pass, the batcher waits for a request just back from one."""
        self._pass_s = 0.0
        """Moving average of a target pass's seconds."""
        self._draft_pass_s: dict[int, float] = {}
        """The same per draft model (by id)."""
        self._queue: queue.Queue[_Step | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="target-batcher", daemon=True)
        self._thread.start()

    def lm(self, model: PreTrainedModel | None = None) -> CachedLM:
        """A fresh per-request cache over ``model`` (default: the target) whose forwards run on this
        batcher's thread, batched with the other requests' passes of the same model.

        A draft model gets a pool of its own: its passes never share one with the target's, but
        they are batched across requests and, on a CPU, run on the one thread that owns the OpenMP
        team (``specops.core.threads``). A draft that cannot pack (its attention is not SDPA) gets a plain
        ``CachedLM``, decoded on the request's own thread."""
        if model is None or model is self.model:
            return BatchedCachedLM(self.model, self)
        _, packed = self.pool_for(model)
        return BatchedCachedLM(model, self) if packed else CachedLM(model)

    def pool_for(self, model: PreTrainedModel) -> tuple[SlotPool, bool]:
        """``model``'s KV pool here and whether its passes pack (made on first use; dropped with the model)."""
        key = id(model)
        with self._pools_lock:
            got = self._pools.get(key)
            if got is None:
                packed = ragged.install(model)
                got = self._pools[key] = (SlotPool(model, slots=self.max_batch, capacity=self.capacity), packed)
                weakref.finalize(model, self._drop_pool, key)
            return got

    def _drop_pool(self, key: int) -> None:
        with self._pools_lock:
            self._pools.pop(key, None)
            self._lean.pop(key, None)

    def _lean_for(self, model: PreTrainedModel) -> lean.LeanDecoder | None:
        """``model``'s lean pass, built on first use and again after its weights changed (a hot swap
        that copies weights in place); None where it does not apply."""
        key = id(model)
        got = self._lean.get(key, False)
        if got is False or (got is not None and got.stale()):
            got = lean.install(model)
            with self._pools_lock:
                self._lean[key] = got
        return got

    def begin(self) -> None:
        """A request starts decoding (its steps may now join batches)."""
        with self._active_lock:
            self.active += 1

    def end(self) -> None:
        with self._active_lock:
            self.active -= 1

    def submit(self, step: _Step) -> None:
        self._queue.put(step)
        step.done.wait()
        if step.error is not None:
            raise step.error

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop after the steps already queued (none is left waiting)."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    close = stop

    def _run(self) -> None:
        threads.compute_thread()  # this thread runs the target: it gets the process's compute threads
        while True:
            t_idle = time.perf_counter()
            first = self._later.popleft() if self._later else self._queue.get()
            if first is None:
                return
            t_gather = time.perf_counter()
            batch = self._gather(first)
            t0 = time.perf_counter()
            PASS_SECONDS.labels("idle").inc(t_gather - t_idle)
            PASS_SECONDS.labels("gather").inc(t0 - t_gather)
            try:
                self._forward(batch)
            except BaseException as exc:  # every waiting request gets the error, none hangs
                log.exception("batched target forward failed for %d requests", len(batch))
                for s in batch:
                    s.error = exc
            seconds = time.perf_counter() - t0
            if first.lm.model is self.model:
                PASS_SECONDS.labels("forward").inc(seconds)
                self._pass_s += 0.2 * (seconds - self._pass_s)
            else:
                PASS_SECONDS.labels("draft_forward").inc(seconds)
                key = id(first.lm.model)
                self._draft_pass_s[key] = self._draft_pass_s.get(key, seconds) + 0.2 * (
                    seconds - self._draft_pass_s.get(key, seconds)
                )
            self.num_batches += 1
            self.num_steps += len(batch)
            BATCH_SIZE.observe(len(batch))
            now = time.monotonic()
            for s in batch:
                s.lm.returned_at = now
                s.done.set()

    def _gather(self, first: _Step) -> list[_Step]:
        """The steps to run with ``first``: continuous batching, request by request.

        A request whose step just came back is back within a millisecond or two with its next
        one (propose, commit, stream a token); one that misses a pass costs a whole pass of its
        own, and the two halves then keep missing each other. So the batcher waits for the
        requests it *expects*, those that returned from a pass within ``straggle`` of the pass
        time and have not submitted since, up to that long; and for anyone else decoding (a
        request prefilling, or busy between steps) only ``window_s``. A lone request never waits.
        A draft model's pass waits only for its expected requests, as long as ``straggle`` of a
        draft pass: the others may be verifying. Steps of another model than ``first``'s are put
        aside for the next pass.
        """
        batch = [first]
        if first.tree is not None:
            return batch
        model = first.lm.model
        while self._later and len(batch) < self.max_batch:  # steps put aside earlier, of this model
            if self._later[0].lm.model is not model or self._later[0].tree is not None:
                return batch
            batch.append(self._later.popleft())
        start = time.monotonic()
        if model is self.model:
            hold = max(self.window_s, self.straggle * self._pass_s)
        else:  # a draft pass waits only for drafts just back (the others decoding may be verifying)
            hold = self.straggle * self._draft_pass_s.get(id(model), 0.0)
        while len(batch) < self.max_batch:
            now = time.monotonic()
            if self._later:  # another model's steps wait for this thread, their requests with them: take what is queued
                limit = now
            else:
                expected = self._expected(batch, now, hold)
                if not expected and (model is not self.model or len(batch) >= min(self.max_batch, self.active)):
                    break
                limit = start + (hold if expected else self.window_s)
            try:
                nxt = self._queue.get(timeout=limit - now) if limit > now else self._queue.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                self._queue.put(None)  # stop after this batch
                break
            if nxt.tree is not None or nxt.lm.model is not model:
                self._later.append(nxt)  # a tree runs on its own, another model's step in its own pass: next
                if nxt.tree is not None:
                    break
                continue
            batch.append(nxt)
        return batch

    def _expected(self, batch: list[_Step], now: float, hold: float) -> int:
        """Requests that returned from a pass less than ``hold`` ago and have not stepped since."""
        with self._active_lock:
            live = list(self._live)
        inside, model = {id(s.lm) for s in batch}, batch[0].lm.model
        return sum(
            1
            for lm in live
            if lm.model is model and id(lm) not in inside and lm.returned_at is not None and now - lm.returned_at < hold
        )

    @torch.inference_mode()
    def _forward(self, batch: list[_Step]) -> None:
        with batch[0].lm.pool.lock:
            self._forward_locked(batch)

    def _forward_locked(self, batch: list[_Step]) -> None:
        lm = batch[0].lm
        # a draft's steps reach this thread only when it packs (lm()); the target's as self.packed says
        if batch[0].tree is None and (self.packed or lm.model is not self.model):
            return self._forward_packed(batch)
        b = len(batch)
        pool, device = lm.pool, lm.model.device
        past = [s.lm.num_cached for s in batch]
        new = [len(s.input_ids) + (s.tree.num_nodes if s.tree is not None else 0) for s in batch]
        n_max = max(new)
        span = max(p + n_max for p in past)
        pool.ensure(span)
        slots = [s.lm.slot for s in batch]
        # inputs right-padded to n_max; positions continue each request's own; padding is masked out
        ids = torch.zeros((b, n_max), dtype=torch.long, device=device)
        pos = torch.zeros((b, n_max), dtype=torch.long, device=device)
        allow = torch.zeros((b, 1, n_max, span), dtype=torch.bool, device=device)
        for i, s in enumerate(batch):
            p, n = past[i], new[i]
            if s.tree is None:
                ids[i, :n] = torch.tensor(s.input_ids, dtype=torch.long)
                pos[i] = torch.arange(p, p + n_max)
                allow[i, 0, :, :p] = True
                allow[i, 0, :n, p : p + n] = torch.ones((n, n), dtype=torch.bool, device=device).tril()
            else:  # alone in its batch: committed tokens causal, then the tree's nodes
                c = len(s.input_ids)
                ids[i, :n] = torch.tensor(s.input_ids + s.tree.tokens[1:], dtype=torch.long)
                pos[i] = tree_mod.positions(p + c, c, s.tree)
                allow[i, 0, :, : p + n] = tree_mod.attention_mask(p, c, s.tree, torch.float32)[0, 0].eq(0)
            allow[i, 0, n:, 0] = True  # padded queries attend somewhere (their outputs are discarded)
        cache = SlotCache(pool, slots, past, span)
        self.num_gathers += int(b > 1 and not cache.view)
        want_hidden = any(s.want_hidden for s in batch)
        # The head scores only the positions some row keeps (a prompt's prefill keeps its last
        # one): the union of the rows' kept columns, so a 1,000-token prefill in a batch does
        # not compute 1,000 rows of logits over the whole vocabulary.
        keeps = [min(s.logits_to_keep or new[i], new[i]) for i, s in enumerate(batch)]
        columns = sorted({j for i in range(b) for j in range(new[i] - keeps[i], new[i])})
        at = {j: c for c, j in enumerate(columns)}
        tail = columns == list(range(columns[0], n_max))  # one run to the end: keep it as a count
        t0 = time.perf_counter()
        out = self.model(
            input_ids=ids,
            position_ids=pos,
            attention_mask=allow,
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=want_hidden,
            logits_to_keep=n_max - columns[0] if tail else torch.tensor(columns),
        )
        ms = (time.perf_counter() - t0) * 1000.0
        PASS_TOKENS.inc(b * n_max)
        for i, s in enumerate(batch):
            keep = keeps[i]
            lo = at[new[i] - keep]  # its first kept column among those scored
            s.logits = out.logits[i, lo : lo + keep].float().cpu()  # [keep, vocab]
            if s.want_hidden:
                s.hidden = out.hidden_states[-1][i, new[i] - keep : new[i]].float().cpu()
            s.lm.num_cached += new[i]
            s.lm.num_forwards += 1
            widest = max((new[j] for j in range(b) if j != i), default=0)
            s.target_pass = TargetPass(b, n_max, new[i], sum(new) - new[i], widest, ms)

    def _forward_packed(self, batch: list[_Step]) -> None:
        """The steps' tokens end to end in one ``[1, T]`` pass (``engine.ragged``), in slot order: one-token
        steps in consecutive slots then attend in one call."""
        batch = sorted(batch, key=lambda s: s.lm.slot)
        model, vocab, pool = batch[0].lm.model, batch[0].lm.vocab, batch[0].lm.pool
        device = model.device
        past = [s.lm.num_cached for s in batch]
        new = [len(s.input_ids) for s in batch]
        pool.ensure(max(p + n for p, n in zip(past, new)))
        rows = ragged.Rows.build([s.lm.slot for s in batch], past, new, device)
        ids = torch.tensor([[t for s in batch for t in s.input_ids]], dtype=torch.long, device=device)
        keeps = [min(s.logits_to_keep or n, n) for s, n in zip(batch, new)]
        kept = torch.tensor(  # each row's last `keep` tokens in the packed sequence
            [c for o, n, keep in zip(rows.offsets, new, keeps) for c in range(o + n - keep, o + n)],
            dtype=torch.long,
            device=device,
        )
        want_hidden = any(s.want_hidden for s in batch)
        fused = self._lean_for(model)
        t0 = time.perf_counter()
        if fused is not None:  # the decoder written out, projections fused (engine.lean)
            last = fused.hidden_states(ids[0], rows, pool)[kept]  # [sum(keeps), hidden]
        else:
            args = dict(
                input_ids=ids,
                position_ids=rows.positions,
                attention_mask=torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device),  # 4D: transformers builds
                # no mask of its own; each request attends its own slot (engine.ragged)
                past_key_values=ragged.PackedCache(pool, rows),
                use_cache=True,
                specops_rows=rows,
            )
            if vocab is not None:  # a draft vocabulary: the base model, then only its rows of the head
                last = model.base_model(**args).last_hidden_state[0, kept]  # [sum(keeps), hidden]
            else:
                out = model(**args, output_hidden_states=want_hidden, logits_to_keep=kept)
                last = None
                logits = out.logits[0].float().cpu()  # [sum(keeps), vocab]
                hidden = out.hidden_states[-1][0, kept].float().cpu() if want_hidden else None
        if last is not None:  # the head over the kept rows (a draft vocabulary's rows of it)
            head = model.get_output_embeddings()
            logits = (vocab.logits(head, last) if vocab is not None else head(last)).float().cpu()
            hidden = last.float().cpu() if want_hidden else None
        ms = (time.perf_counter() - t0) * 1000.0
        if model is self.model:
            PASS_TOKENS.inc(ids.shape[1])
        total, at = sum(new), 0
        for i, s in enumerate(batch):
            keep = keeps[i]
            s.logits = logits[at : at + keep]
            if s.want_hidden:
                s.hidden = hidden[at : at + keep]
            at += keep
            s.lm.num_cached += new[i]
            s.lm.num_forwards += 1
            widest = max((new[j] for j in range(len(batch)) if j != i), default=0)
            s.target_pass = TargetPass(len(batch), max(new), new[i], total - new[i], widest, ms, packed=True)


class _RowView:
    """One layer of a request's slot, shaped like a ``DynamicCache`` layer (tests, tools)."""

    def __init__(self, lm: BatchedCachedLM, layer: int) -> None:
        self.lm, self.layer = lm, layer

    @property
    def keys(self) -> torch.Tensor:
        return self.lm.pool.keys[self.layer][self.lm.slot : self.lm.slot + 1, :, : self.lm.num_cached]

    @property
    def values(self) -> torch.Tensor:
        return self.lm.pool.values[self.layer][self.lm.slot : self.lm.slot + 1, :, : self.lm.num_cached]


class _SlotView:
    def __init__(self, lm: BatchedCachedLM) -> None:
        self.layers = [_RowView(lm, i) for i in range(lm.pool.num_layers)]
        self.lm = lm

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lm.num_cached


class BatchedCachedLM(CachedLM):
    """A request's target whose KV cache is a slot of the batcher's pool and whose forward
    passes are batched across requests."""

    def __init__(self, model: PreTrainedModel, batcher: TargetBatcher) -> None:
        super().__init__(model)
        self.batcher = batcher
        self.pool, _ = batcher.pool_for(model)
        self.slot = self.pool.acquire()
        self.cache = _SlotView(self)  # type: ignore[assignment]
        self._closed = False
        self.returned_at: float | None = None
        """When its latest pass came back; None while a step of it is queued."""
        with batcher._active_lock:
            batcher._live.add(self)

    def forward(
        self, input_ids: list[int], *, logits_to_keep: int = 0, want_hidden: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert len(input_ids) > 0, "forward needs at least one token"
        assert self.num_cached + len(input_ids) <= self.context_size, (self.num_cached, len(input_ids))
        step = _Step(self, list(input_ids), logits_to_keep, want_hidden)
        self.returned_at = None
        self.batcher.submit(step)
        self.last_pass = step.target_pass
        return step.logits, step.hidden

    def forward_tree(
        self, committed: list[int], tree: TokenTree, *, want_hidden: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert committed, "the last committed token is fed with the tree"
        assert self.num_cached + len(committed) + tree.max_depth <= self.context_size
        step = _Step(self, list(committed), tree.num_nodes + 1, want_hidden, tree=tree)
        self.returned_at = None
        self.batcher.submit(step)
        self.last_pass = step.target_pass
        return step.logits, step.hidden

    @torch.inference_mode()
    def keep_path(self, base: int, path: list[int]) -> None:
        pool = self.pool
        with pool.lock:
            for j, node in enumerate(path):
                assert node >= j + 1, (j, node)
                src, dst = base + node - 1, base + j
                if src != dst:
                    for layer in range(pool.num_layers):
                        pool.keys[layer][self.slot, :, dst] = pool.keys[layer][self.slot, :, src]
                        pool.values[layer][self.slot, :, dst] = pool.values[layer][self.slot, :, src]
        self.rollback(base + len(path))

    def rollback(self, length: int) -> None:
        assert 0 <= length <= self.num_cached, (length, self.num_cached)
        self.num_cached = length  # the positions past it are overwritten by the next step

    @torch.inference_mode()
    def prefix(self, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        assert 0 < length <= self.num_cached, (length, self.num_cached)
        pool = self.pool
        with pool.lock:  # no pass writes, and no reallocation moves the buffers, while it copies
            return [
                (pool.keys[i][self.slot, :, :length].clone(), pool.values[i][self.slot, :, :length].clone())
                for i in range(pool.num_layers)
            ]

    @torch.inference_mode()
    def load_prefix(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        assert self.num_cached == 0 and len(kv) == self.pool.num_layers, (self.num_cached, len(kv))
        length = int(kv[0][0].shape[1])
        pool = self.pool
        with pool.lock:
            pool.ensure(length)
            for i, (keys, values) in enumerate(kv):
                pool.keys[i][self.slot, :, :length] = keys
                pool.values[i][self.slot, :, :length] = values
        self.num_cached = length

    def reset(self) -> None:
        self.num_cached = 0
        self.num_forwards = 0

    def close(self) -> None:
        """Give the slot back (the request is done with its cache)."""
        if not self._closed:
            self._closed = True
            with self.batcher._active_lock:
                self.batcher._live.discard(self)
            self.pool.release(self.slot)

    def __del__(self) -> None:  # a request that never closed (an exception path) still frees its slot
        try:
            self.close()
        except Exception:
            pass
