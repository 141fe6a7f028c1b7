"""kNN-LM decoding, plain and speculative (Khandelwal et al., 2020; RaLMSpec §5.3).

**kNN-LM.** At each position the target's hidden state ``h`` (what its LM head multiplies)
queries the datastore (:mod:`specops.serving.ralm.knnlm.store`) for its ``k`` nearest entries by
squared L2 distance ``d_i``; ``p_kNN(v) = Σ_{i: value_i = v} softmax(-d / T)_i`` (``T`` =
``knn_temperature``, 1 in the paper) and the next token comes from

    p = λ · p_kNN + (1 - λ) · p_LM,    λ = 0.25 (the paper's best on WikiText-103).

``k`` defaults to 32. With raw distances the softmax puts its mass on the nearest entry: on
the bootstrapped SmolLM2-135M (hidden states of squared norm ~2,100) the nearest squared
distance is ~500 and the second ~33 further (medians over a 200k-entry datastore), a weight
ratio of e^-33. So ``k`` buys nothing in ``p`` at ``T = 1`` and costs search and cache
time; the paper's ``k = 1024`` is accepted (``MAX_K``) and measured. A larger
``knn_temperature`` spreads the mass over the neighbours. Greedy decoding takes
``argmax p``; sampling draws one seeded uniform ``u_t`` per output position ``t`` and takes
the inverse-CDF token of ``p`` (softmax of the logits at the request's temperature, optional
min-p, top-k and top-p on ``p``), so two runs that see the same ``p`` at ``t`` emit the same token, whichever
path computed it. λ = 0 is the target alone (greedy: ``argmax`` of the logits).

**Baseline** (``mode="baseline"``): a real datastore search at every token, one token per
target forward (KV cached).

**Speculative** (``mode="speculative"``, RaLMSpec §5.3). A per-request local cache of entries
is seeded by a real search for the first token. Every real search puts the ``k`` neighbours
and the ``next_entries`` (10) entries after each, in the same document, into the cache
(spatial locality: the text that followed a neighbour tends to be what follows now). A
speculation step searches the cache with the same distance code as the datastore (so a cache
holding the true neighbours yields exactly the true ``p``), emits the token of the
interpolated ``p`` and goes on. After ``s`` steps (OS³, ``specops.serving.ralm.os3``, synchronous,
γ capped at 0.9: ``KNN_OS3``; or a fixed ``s``) one batched real search over the ``s``
hidden states verifies them: a step is verified when the true ``p`` gives the same token (the
relaxation of §5.3: the token must match, not all ``k`` neighbours). At the first mismatch
``m`` the target's KV cache rolls back to ``m`` (``CachedLM.rollback``), the true token is
emitted there and decoding continues. Where OS³ judges that no stride beats a search per
token (``KNN_OS3``'s off rule) a round decodes one token as the baseline does.
The output is therefore the baseline's, token for token: every emitted token is the one the
true ``p`` gives, ``h`` at a position does not depend on the path that reached it (one token
per cached forward either way) and both searchers answer a query the same in any batch.

The cache holds at most ``cache_size`` (16,384) entries, oldest out first (a re-added entry
counts as new): with float32 keys of 576 dims that is 36 MiB per request.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from specops.core.errors import InvalidRequestError, PromptTooLongError
from specops.core.limits import context_size
from specops.serving.engine.kv import CachedLM
from specops.serving.engine.sampling import filter_min_p_top_k, tempered_softmax
from specops.serving.engine.types import SamplingParams
from specops.serving.ralm.knnlm.search import KEY_BLOCK, Neighbours, search_keys
from specops.serving.ralm.knnlm.store import MAX_K, KnnDatastore
from specops.serving.ralm.os3 import OS3Config, StrideScheduler

log = logging.getLogger(__name__)

MODES = ("speculative", "baseline")
KNN_OS3 = OS3Config(gamma_max=0.9, rework=False)
"""OS³ for kNN-LM: the paper's estimator with the cap on γ at 0.9, not 0.6, and the off rule.
Verification by token (§5.3) makes a speculation hold far more often than a whole retrieved
passage does (hit rates 0.93-0.95 at k = 16 in ``benchmarks/out/ralm.json``'s ``knnlm``), and
by the paper's objective the 0.6 cap's stride loses to the 0.9 cap's wherever a search costs
more than a few tenths of a step (``tests/serving/ralm/test_os3_caps.py``). The cap still keeps
the estimate off 1 (the paper's reason for it).

**Off rule** (as for iterative RaLM, :mod:`specops.serving.ralm.os3`): a round whose best stride
would not beat a search per token by the margin is unspeculated: one forward, one real search,
the true token, the cache's guess scored beside it ("shadow") so γ stays current. A mismatch
here costs no rework (the true token is emitted where the loop rolls back), so the rule ranks
by the objective alone (``rework=False``). When no γ could make speculation pay with the ``a``
and ``b`` measured (:meth:`StrideScheduler.could_pay`; a search of well under a step, as with
IVFPQ on CPU) the shadow is skipped too: no cache search and no cache upkeep, the baseline's
own work, until the measured costs change. The first token's search seeds the cache either way."""


@dataclass(frozen=True)
class KnnConfig:
    """One request's kNN-LM decoding."""

    mode: str = "speculative"
    """``speculative`` (RaLMSpec: cache, batched verification) or ``baseline`` (a search per token)."""
    k: int = 32
    """Neighbours per search (1..1024)."""
    lam: float = 0.25
    """λ, the weight of p_kNN in the interpolation (0 = the target alone; the API's ``lambda``)."""
    knn_temperature: float = 1.0
    """T in softmax(-d / T) over the neighbours' squared distances."""
    speculation_stride: int = 0
    """Speculation steps per verification: 0 = OS³ chooses live (``KNN_OS3``); n > 0 = always n."""
    next_entries: int = 10
    """Entries after each neighbour (same document) added to the cache (the paper's n)."""
    cache_size: int = 16_384
    """Most entries in a request's cache (oldest out)."""

    def __post_init__(self) -> None:
        def bad(name: str, what: str, value) -> InvalidRequestError:
            return InvalidRequestError(f"knnlm.{name} must be {what}, got {value!r}", f"knnlm.{name}")

        if self.mode not in MODES:
            raise bad("mode", f"one of {', '.join(MODES)}", self.mode)
        if not isinstance(self.k, int) or not 1 <= self.k <= MAX_K:
            raise bad("k", f"an integer in 1..{MAX_K}", self.k)
        if not 0.0 <= float(self.lam) <= 1.0:
            raise bad("lambda", "in [0, 1]", self.lam)
        if not float(self.knn_temperature) > 0.0:
            raise bad("knn_temperature", "> 0", self.knn_temperature)
        if not isinstance(self.speculation_stride, int) or not 0 <= self.speculation_stride <= 32:
            raise bad("speculation_stride", "an integer in 0..32 (0 = OS³)", self.speculation_stride)
        if not isinstance(self.next_entries, int) or not 0 <= self.next_entries <= 64:
            raise bad("next_entries", "an integer in 0..64", self.next_entries)
        if not isinstance(self.cache_size, int) or not 1 <= self.cache_size <= 1 << 20:
            raise bad("cache_size", "an integer in 1..1048576", self.cache_size)


@dataclass
class KnnStats:
    """What one request's kNN-LM decoding did (the response's ``knnlm`` block)."""

    mode: str
    searcher: str
    k: int
    tokens: int = 0
    kb_searches: int = 0
    """Real datastore searches (a batched verification is one)."""
    kb_queries: int = 0
    """Queries sent to the datastore (the baseline: one per token)."""
    verification_batches: int = 0
    speculations: int = 0
    """Tokens decoded from the cache's neighbours."""
    verified: int = 0
    """Speculations a verification confirmed."""
    mismatches: int = 0
    rolled_back_tokens: int = 0
    unspeculated: int = 0
    """Tokens decoded with a real search each because OS³ turned speculation off."""
    shadowed: int = 0
    """Of those, tokens whose cache guess was scored against the search (keeps γ current)."""
    strides: list[int] = field(default_factory=list)
    """Speculation steps of every verification, in order."""
    cache_size: int = 0
    """Entries in the cache at the end."""
    gamma: float = 0.0
    """OS³'s last estimate of the speculation accuracy."""
    lm_s: float = 0.0
    kb_search_s: float = 0.0
    cache_search_s: float = 0.0
    cache_update_s: float = 0.0
    total_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Speculations verified / speculations verified or refuted (the last round's unverified
        tail, cut by the token limit, is not counted)."""
        judged = self.verified + self.mismatches
        return self.verified / judged if judged else 0.0

    @property
    def ms_per_token(self) -> float:
        return 1000.0 * self.total_s / max(1, self.tokens)

    def to_dict(self) -> dict:
        out = asdict(self)
        for key in ("lm_s", "kb_search_s", "cache_search_s", "cache_update_s", "total_s"):
            out[key] = round(out[key], 6)
        out["gamma"] = round(self.gamma, 4)
        out["hit_rate"] = round(self.hit_rate, 4)
        return out


@dataclass
class KnnResult:
    token_ids: list[int]
    """Generated tokens (prompt excluded)."""
    stats: KnnStats
    finish_reason: str
    """``stop`` (an end-of-sequence token) or ``length``."""
    text: str | None = None


class LocalKnnCache:
    """A request's speculation cache: datastore entries, searched like the datastore.

    Keys sit in fixed slots of a ``[slots, hidden]`` float32 block; free slots are taken
    lowest first and only the used prefix (in KEY_BLOCKs) is searched, by the datastore's own
    :func:`~specops.serving.ralm.knnlm.search.search_keys` (ties to the lower entry id). Each slot has
    a stamp: an entry added again is stamped anew, and a full cache evicts the lowest stamps
    (the oldest). Bookkeeping is vectorised: a verification of ``s`` queries at ``k = 1024``
    offers ``11·s·k`` entries at once."""

    def __init__(self, store: KnnDatastore, capacity: int, next_entries: int) -> None:
        self.store, self.capacity, self.next_entries = store, capacity, next_entries
        slots = -(-capacity // KEY_BLOCK) * KEY_BLOCK
        self.keys = torch.zeros((slots, store.hidden_size), dtype=torch.float32)
        self.norms = torch.full((slots,), float("inf"))
        self.ids = store.num_entries + torch.arange(slots)  # empty slots: distinct ids, infinite distance
        self.lists = torch.full((slots,), -1, dtype=torch.long)
        self._entry = np.full(capacity, -1, dtype=np.int64)  # entry id per usable slot, -1: free
        self._stamp = np.full(capacity, -1, dtype=np.int64)
        self._clock = 0
        self._hi = 0  # slots 0.._hi-1 have been used

    def __len__(self) -> int:
        return int((self._entry >= 0).sum())

    def add(self, neighbour_ids: torch.Tensor) -> None:
        """Add the entries ``neighbour_ids`` [n, k] (-1s ignored) and the ``next_entries`` after
        each; the first query's nearest neighbours get the newest stamps (evicted last)."""
        cand = self.store.next_entries(neighbour_ids.reshape(-1), self.next_entries).numpy()
        if not len(cand):
            return
        _, first = np.unique(cand, return_index=True)
        ordered = cand[np.sort(first)][: self.capacity]  # priority order, distinct
        stamps = self._clock + len(ordered) - np.arange(len(ordered))
        self._clock += len(ordered) + 1
        used = np.flatnonzero(self._entry >= 0)
        by_entry = used[np.argsort(self._entry[used])]
        cached = np.zeros(len(ordered), dtype=bool)
        if len(by_entry):
            pos = np.minimum(np.searchsorted(self._entry[by_entry], ordered), len(by_entry) - 1)
            cached = self._entry[by_entry[pos]] == ordered
            self._stamp[by_entry[pos[cached]]] = stamps[cached]  # refreshed in place
        new, new_stamps = ordered[~cached], stamps[~cached]
        if not len(new):
            return
        free = np.flatnonzero(self._entry < 0)
        if len(free) < len(new):  # evict the oldest
            evict = used[np.argsort(self._stamp[used], kind="stable")[: len(new) - len(free)]]
            free = np.sort(np.concatenate([free, evict]))
        slots = free[: len(new)]
        self._entry[slots], self._stamp[slots] = new, new_stamps
        ids, index = torch.from_numpy(new), torch.from_numpy(slots)
        rows = self.store.searcher.rows(ids)
        self.keys[index] = rows.keys.cpu()
        self.norms[index] = rows.norms.cpu()
        self.ids[index] = ids
        if rows.lists is not None:
            self.lists[index] = rows.lists
        self._hi = max(self._hi, int(slots.max()) + 1)

    def search(self, hidden: torch.Tensor, k: int) -> Neighbours:
        """The ``k`` nearest cached entries to ``hidden`` [n, hidden]."""
        rows = max(KEY_BLOCK, -(-self._hi // KEY_BLOCK) * KEY_BLOCK)
        mask = self.store.searcher.probe_mask(hidden, self.lists[:rows])
        return search_keys(hidden, self.keys[:rows], self.norms[:rows], self.ids[:rows], k, mask)


# ---------------------------------------------------------------- the distribution
def knn_probs(nb: Neighbours, values: torch.Tensor, vocab: int, temperature: float) -> torch.Tensor | None:
    """p_kNN [vocab] of one query's neighbours (row 0 of ``nb``); None when it has none."""
    ids, d = nb.ids[0], nb.dists[0]
    ok = ids >= 0
    if not bool(ok.any()):
        return None
    w = torch.softmax(-d[ok].float() / temperature, dim=0)
    return torch.zeros(vocab, dtype=torch.float32).scatter_add_(0, values[ids[ok]], w)


def next_token(logits: torch.Tensor, p_knn: torch.Tensor | None, lam: float, params: SamplingParams, u: float) -> int:
    """The token of ``p = λ·p_kNN + (1-λ)·softmax(logits / temperature)``: its argmax (greedy)
    or its inverse-CDF token at ``u`` in [0, 1), after min-p, top-k and top-p (``specops.serving.engine.sampling``'s order)."""
    assert logits.ndim == 1, logits.shape
    if params.greedy and (lam == 0.0 or p_knn is None):
        return int(logits.argmax())
    p = tempered_softmax(logits, params.temperature if not params.greedy else 1.0)  # finite for any T > 0
    if p_knn is not None and lam > 0.0:
        p = lam * p_knn + (1.0 - lam) * p
    if params.greedy:
        return int(p.argmax())
    p = filter_min_p_top_k(p[None], params.min_p, params.top_k)[0]
    order = torch.arange(p.shape[0])
    if params.top_p < 1.0:
        p, order = p.sort(descending=True, stable=True)
        keep = int((p.cumsum(0) < params.top_p).sum()) + 1
        p, order = p[:keep], order[:keep]
    cdf = p.double().cumsum(0)
    i = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
    return int(order[min(i, p.shape[0] - 1)])


class _Stopped(Exception):
    """``on_final`` returned True: a stop sequence was seen in the final output."""


@dataclass
class _Speculation:
    pos: int
    """Output position of the speculated token."""
    hidden: torch.Tensor
    logits: torch.Tensor
    token: int


class KnnLM:
    """kNN-LM over a target (a transformers causal LM) and a :class:`KnnDatastore`."""

    def __init__(
        self,
        target,
        store: KnnDatastore,
        cfg: KnnConfig | None = None,
        *,
        eos_token_ids: tuple[int, ...] | list[int] = (),
        tokenizer=None,
        os3: OS3Config | None = None,
    ) -> None:
        if int(target.config.hidden_size) != store.hidden_size:
            raise InvalidRequestError(
                f"the kNN-LM datastore's keys have {store.hidden_size} dims, the target's hidden "
                f"states {target.config.hidden_size}"
            )
        self.target, self.store, self.cfg = target, store, cfg or KnnConfig()
        self.eos = frozenset(int(e) for e in eos_token_ids)
        self.tokenizer, self.os3 = tokenizer, os3 or KNN_OS3
        self.vocab = int(target.config.vocab_size)

    # ------------------------------------------------------------------ pieces
    def _forward(self, lm: CachedLM, ids: list[int], st: KnnStats) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        logits, hidden = lm.forward(ids, logits_to_keep=1, want_hidden=True)
        st.lm_s += time.perf_counter() - t0
        return logits[0], hidden  # [vocab], [1, hidden]

    def _kb(self, hidden: torch.Tensor, st: KnnStats) -> Neighbours:
        t0 = time.perf_counter()
        nb = self.store.search(hidden, self.cfg.k)
        st.kb_search_s += time.perf_counter() - t0
        st.kb_searches += 1
        st.kb_queries += hidden.shape[0]
        return nb

    def _token(self, logits: torch.Tensor, nb: Neighbours, pos: int, params: SamplingParams, seed: int) -> int:
        p_knn = knn_probs(nb, self.store.values, self.vocab, self.cfg.knn_temperature) if self.cfg.lam > 0 else None
        u = 0.0 if params.greedy else float(np.random.default_rng([seed, pos]).random())
        return next_token(logits, p_knn, self.cfg.lam, params, u)

    def _eos(self, params: SamplingParams) -> frozenset[int]:
        """Tokens that end the request: none with ``ignore_eos`` (it runs to its token limit)."""
        return frozenset() if params.ignore_eos else self.eos

    def _done(self, out: list[int], limit: int, params: SamplingParams) -> bool:
        return len(out) >= limit or (bool(out) and out[-1] in self._eos(params))

    # ------------------------------------------------------------------ the loops
    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        on_final: Callable[[list[int]], bool | None] | None = None,
    ) -> KnnResult:
        """Decode one request. ``on_final(tokens)`` receives output as it becomes final (every
        token for the baseline, every verified run for the speculative mode); returning True ends
        the request there (finish reason ``stop``: a stop sequence was seen), and an exception it
        raises (the client went away) propagates."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise InvalidRequestError("kNN-LM decoding needs a prompt of at least one token", "prompt")
        ctx = context_size(self.target.config)
        if len(prompt) >= ctx:
            raise PromptTooLongError(f"prompt of {len(prompt)} tokens leaves no room in the context of {ctx}")
        limit = min(params.max_new_tokens, ctx - len(prompt))
        seed = params.seed if params.seed is not None else secrets.randbits(32)
        st = KnnStats(mode=self.cfg.mode, searcher=self.store.searcher.kind, k=self.cfg.k)
        t0 = time.perf_counter()
        lm, out, stopped = CachedLM(self.target), [], False

        def final(tokens: list[int]) -> None:
            if on_final is not None and on_final(tokens) is True:
                raise _Stopped

        try:
            if self.cfg.mode == "baseline":
                self._baseline(lm, prompt, out, limit, params, seed, st, final)
            else:
                self._speculative(lm, prompt, out, limit, params, seed, st, final)
        except _Stopped:
            stopped = True  # everything in ``out`` was final when on_final said stop
        finally:
            lm.close()
        st.tokens = len(out)
        st.total_s = time.perf_counter() - t0
        reason = "stop" if stopped or (out and out[-1] in self._eos(params)) else "length"
        log.debug(
            "knnlm %s %s k=%d: %d tokens, %d searches, %d mismatches, strides %s, %.1f ms/token",
            st.mode,
            st.searcher,
            st.k,
            st.tokens,
            st.kb_searches,
            st.mismatches,
            st.strides,
            st.ms_per_token,
        )
        text = self.tokenizer.decode(out) if self.tokenizer is not None else None
        return KnnResult(out, st, reason, text)

    def _baseline(self, lm, prompt, out, limit, params, seed, st, final) -> None:
        logits, hidden = self._forward(lm, prompt, st)
        while True:
            out.append(self._token(logits, self._kb(hidden, st), len(out), params, seed))
            final(out[-1:])
            if self._done(out, limit, params):
                return
            logits, hidden = self._forward(lm, out[-1:], st)

    def _speculative(self, lm, prompt, out, limit, params, seed, st, final) -> None:
        cfg = self.cfg
        sched = StrideScheduler(self.os3, asynchronous=False, fixed=cfg.speculation_stride)
        cache = LocalKnnCache(self.store, cfg.cache_size, cfg.next_entries)
        try:
            self._speculate(lm, prompt, out, limit, params, seed, st, final, sched, cache)
        finally:
            st.cache_size = len(cache)
            st.gamma = sched.gamma

    def _speculate(self, lm, prompt, out, limit, params, seed, st, final, sched, cache) -> None:
        cfg = self.cfg
        # 1. the first token: a real search, which seeds the cache
        logits, hidden = self._forward(lm, prompt, st)
        nb = self._kb(hidden, st)
        self._update(cache, nb.ids, st)
        out.append(self._token(logits, nb, 0, params, seed))
        final(out[:])
        while not self._done(out, limit, params):
            # 2. speculate s tokens from the cache
            s = sched.stride(limit - len(out))
            if s == 0:
                self._unspeculated(lm, out, params, seed, st, final, sched, cache)
                continue
            pending: list[_Speculation] = []
            while len(pending) < s and not self._done(out, limit, params):
                t0 = time.perf_counter()
                logits, hidden = self._forward(lm, out[-1:], st)
                t1 = time.perf_counter()
                nb = cache.search(hidden, cfg.k)
                st.cache_search_s += time.perf_counter() - t1
                pending.append(
                    _Speculation(len(out), hidden[0], logits, self._token(logits, nb, len(out), params, seed))
                )
                out.append(pending[-1].token)
                sched.observe_speculation(time.perf_counter() - t0)
            st.speculations += len(pending)
            st.strides.append(len(pending))
            # 3. verify them with one batched search
            t0 = time.perf_counter()
            truth = self._kb(torch.stack([p.hidden for p in pending]), st)
            dt = time.perf_counter() - t0
            st.verification_batches += 1
            m, true_token = None, None
            for j, p in enumerate(pending):
                true_token = self._token(p.logits, truth.row(j), p.pos, params, seed)
                if true_token != p.token:
                    m = j
                    break
            matched = len(pending) if m is None else m
            sched.observe_verification(len(pending), matched, dt)
            st.verified += matched
            self._update(cache, truth.ids[: matched + 1], st)  # the rows after a mismatch came from a wrong branch
            final_from = pending[0].pos
            if m is not None:  # 4. roll back to the first mismatch, emit the true token there
                pos = pending[m].pos
                st.mismatches += 1
                st.rolled_back_tokens += len(out) - pos
                del out[pos:]
                lm.rollback(len(prompt) + pos)
                out.append(true_token)
            final(out[final_from:])

    def _unspeculated(self, lm, out, params, seed, st, final, sched, cache) -> None:
        """One token as the baseline makes it (a forward, a real search), with the cache's
        guess scored beside it while speculation could still pay."""
        t0 = time.perf_counter()
        logits, hidden = self._forward(lm, out[-1:], st)
        shadow = sched.could_pay()
        guess = None
        if shadow:
            t1 = time.perf_counter()
            guess = self._token(logits, cache.search(hidden, self.cfg.k), len(out), params, seed)
            st.cache_search_s += time.perf_counter() - t1
        step_s = time.perf_counter() - t0  # a: what a speculation step would cost
        t2 = time.perf_counter()
        nb = self._kb(hidden, st)
        search_s = time.perf_counter() - t2
        true_token = self._token(logits, nb, len(out), params, seed)
        sched.observe_generation(step_s)
        st.unspeculated += 1
        if shadow:
            sched.observe_verification(1, int(guess == true_token), search_s)
            self._update(cache, nb.ids, st)
            st.shadowed += 1
        else:
            sched.observe_retrieval(1, search_s)
        out.append(true_token)
        final(out[-1:])

    def _update(self, cache: LocalKnnCache, ids: torch.Tensor, st: KnnStats) -> None:
        t0 = time.perf_counter()
        cache.add(ids)
        st.cache_update_s += time.perf_counter() - t0


def knnlm_generate(
    target,
    store: KnnDatastore,
    prompt_ids: list[int],
    params: SamplingParams | None = None,
    *,
    cfg: KnnConfig | None = None,
    eos_token_ids: tuple[int, ...] | list[int] = (),
    tokenizer=None,
    on_final: Callable[[list[int]], bool | None] | None = None,
) -> KnnResult:
    """One request: ``KnnLM(target, store, cfg, ...).generate(prompt_ids, params)``."""
    lm = KnnLM(target, store, cfg, eos_token_ids=eos_token_ids, tokenizer=tokenizer)
    return lm.generate(prompt_ids, params, on_final=on_final)
