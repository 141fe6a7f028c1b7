"""From logged records to tensors: training examples, the target's distribution and the
draft's logits at each rejected position of a MissRecord."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specops.core.draft_vocab import DraftVocab
from specops.streams.records import DIST_TOPK, MissRecord
from specops.trainer.losses import TargetDist


def target_dist(rec: MissRecord) -> TargetDist:
    """The logged target distribution of ``rec`` as tensors (float32)."""
    logprobs = torch.from_numpy(rec.logprobs.astype("float32"))  # [m, k] or [m, V]
    if rec.dist_kind == DIST_TOPK:
        assert rec.topk_ids is not None and rec.residual is not None
        return TargetDist.topk(torch.from_numpy(rec.topk_ids).long(), logprobs, torch.from_numpy(rec.residual.copy()))
    return TargetDist.full(logprobs)


@dataclass
class Example:
    """One training sequence: the draft predicts ``context[positions[i]]`` from ``context[:positions[i]]``."""

    context: torch.Tensor
    """[L] token ids the draft reads (long)."""
    positions: torch.Tensor
    """[m] indices into the sequence of the predicted tokens, each in [1, L]."""
    target: TargetDist
    """The target's distribution at each of the m positions."""
    request_id: str

    @property
    def num_positions(self) -> int:
        return int(self.positions.numel())


def teacher_example(rec: MissRecord) -> Example:
    """The logged rejected positions of ``rec`` and the logged target distributions there."""
    positions = torch.from_numpy(rec.positions).long()
    last = int(positions.max()) if positions.numel() else 0
    return Example(torch.from_numpy(rec.token_ids[:last]).long(), positions, target_dist(rec), rec.request_id)


def draft_logits(model: torch.nn.Module, ex: Example, vocab: DraftVocab | None = None) -> torch.Tensor:
    """[m, V] the draft's logits predicting each position of ``ex`` (one causal forward).

    With a draft vocabulary ``vocab`` ([S] token ids), only those head rows run: [m, S],
    columns in the order of ``vocab.token_ids`` (pair with ``TargetDist.restrict``).
    """
    device = next(model.parameters()).device
    if ex.num_positions == 0:
        width = vocab.size if vocab is not None else int(model.config.vocab_size)
        return torch.zeros((0, width), device=device)
    # the LM head runs only at the m predicting positions, not at every one of the L
    keep = (ex.positions - 1).to(device)  # [m]
    ids = ex.context.unsqueeze(0).to(device)
    if vocab is None:
        return model(input_ids=ids, logits_to_keep=keep).logits[0]  # [m, V]
    hidden = model.base_model(input_ids=ids).last_hidden_state[0, keep]  # [m, H]
    head = model.get_output_embeddings()
    rows = head.weight[vocab.token_ids.to(device)] if head.weight.requires_grad else vocab.rows(head)
    logits = F.linear(hidden, rows)  # [m, S]
    if head.bias is not None:
        logits = logits + head.bias[vocab.token_ids.to(device)]
    return logits


def draft_logits_at(model: torch.nn.Module, rec: MissRecord) -> torch.Tensor:
    """[m, V] the draft's logits predicting each rejected position of ``rec``.

    One causal forward over ``token_ids[:last position]``: the logits at index ``i - 1``
    are the draft's prediction for the token at index ``i``.
    """
    return draft_logits(model, teacher_example(rec))


TEACHER_TOPK = 64
"""Target log-probs kept per position when the trainer recomputes them (as serving logs them)."""


def every_position_example(rec: MissRecord, target: TargetDist) -> Example:
    """Every output position of ``rec`` (not only the rejected ones) against ``target``, the
    target's distribution at each of them ([n_out] rows, in order)."""
    first, n = rec.num_prompt_tokens, len(rec.token_ids)
    positions = torch.arange(first, n, dtype=torch.long)
    if target.logprobs.shape[0] != positions.numel():
        raise ValueError(
            f"request {rec.request_id}: {target.logprobs.shape[0]} target rows for {positions.numel()} output positions"
        )
    return Example(torch.from_numpy(rec.token_ids[: n - 1]).long(), positions, target, rec.request_id)


def logs_every_position(rec: MissRecord) -> bool:
    """The record carries the target's distribution at every output position (serving logged them all)."""
    n_out = len(rec.token_ids) - rec.num_prompt_tokens
    return n_out > 0 and len(rec.positions) == n_out and int(rec.positions[0]) == rec.num_prompt_tokens


TEACHER_BATCH_TOKENS = 4096
"""Padded tokens per batched teacher forward (:meth:`TargetTeacher.prefetch`)."""
HEAD_ROWS = 256
"""Rows put through the target's LM head at a time in a batched forward ([rows, V] float32)."""


def _topk_dist(logits: torch.Tensor, topk: int) -> TargetDist:
    """[n, V] logits -> the top-k of their log-softmax and the residual mass, on the CPU."""
    logp = torch.log_softmax(logits.float(), -1)
    vals, tids = logp.topk(min(topk, logp.shape[-1]), dim=-1)
    residual = (1.0 - vals.double().exp().sum(-1)).clamp(0.0, 1.0).float()
    return TargetDist.topk(tids.cpu(), vals.cpu(), residual.cpu())


def _cat_dists(parts: list[TargetDist]) -> TargetDist:
    assert all(p.topk_ids is not None and p.residual is not None for p in parts)
    return TargetDist.topk(
        torch.cat([p.topk_ids for p in parts]),  # type: ignore[misc]
        torch.cat([p.logprobs for p in parts]),
        torch.cat([p.residual for p in parts]),  # type: ignore[misc]
    )


class TargetTeacher:
    """The target's distribution at every output position of a logged request, by one teacher
    forward over its tokens (top-k + residual, as serving logs them), cached per request.

    Serving logs the target's distribution only where a draft token was rejected; training
    at every position (``OnlineConfig.positions = "all"``) needs it at the accepted positions
    too, and a request an external engine served (vLLM: ``MissRecord.scored`` is False) comes
    with no distribution at all. One forward of the target over the request's tokens gives it.
    :meth:`prefetch` computes many requests in a few batched forwards (what an update of
    external-engine records does); calling the teacher on one record forwards it alone. A
    request trained in several updates (a ``recent`` replay buffer) is forwarded once: results
    are kept for the ``cache_size`` most recent requests."""

    def __init__(
        self,
        target: torch.nn.Module,
        *,
        topk: int = TEACHER_TOPK,
        cache_size: int = 512,
        batch_tokens: int = TEACHER_BATCH_TOKENS,
    ) -> None:
        self.target = target
        self.topk = topk
        self.cache_size = cache_size
        self.batch_tokens = batch_tokens
        self._cache: dict[str, TargetDist] = {}
        self.forwards = 0
        """Requests whose distributions were computed (one at a time or in a batch)."""
        self.batches = 0
        """Batched forwards :meth:`prefetch` ran."""
        self.seconds = 0.0

    @staticmethod
    def _key(rec: MissRecord) -> str:
        return f"{rec.request_id}:{len(rec.token_ids)}"

    def _remember(self, key: str, dist: TargetDist) -> None:
        self._cache[key] = dist  # most recent last
        while len(self._cache) > self.cache_size:
            self._cache.pop(next(iter(self._cache)))

    @torch.no_grad()
    def __call__(self, rec: MissRecord) -> TargetDist:
        import time

        key = self._key(rec)
        hit = self._cache.pop(key, None)
        if hit is None:
            t0 = time.perf_counter()
            device = next(self.target.parameters()).device
            first, n = rec.num_prompt_tokens, len(rec.token_ids)
            ids = torch.from_numpy(rec.token_ids[: n - 1]).long().unsqueeze(0).to(device)
            keep = torch.arange(first - 1, n - 1, device=device)
            logits = self.target(input_ids=ids, logits_to_keep=keep).logits[0]  # [n_out, V]
            hit = _topk_dist(logits, self.topk)
            self.forwards += 1
            self.seconds += time.perf_counter() - t0
        self._remember(key, hit)
        return hit

    @torch.no_grad()
    def prefetch(self, records: list[MissRecord]) -> int:
        """Compute and cache the distributions of every record not cached yet, in batched target
        forwards: longest first, right-padded with an attention mask (a padded token comes after
        every real one, so it changes no real position's result), each batch at most
        ``batch_tokens`` padded tokens (a longer request runs alone). The LM head runs only at
        the output positions. Returns the requests computed."""
        import time

        todo: dict[str, MissRecord] = {}
        for rec in records:
            key = self._key(rec)
            if key not in self._cache and len(rec.token_ids) > rec.num_prompt_tokens:
                todo.setdefault(key, rec)
        order = sorted(todo.items(), key=lambda kv: -len(kv[1].token_ids))
        batches: list[list[tuple[str, MissRecord]]] = []
        for item in order:  # the first of a batch is its longest
            if batches and (len(batches[-1]) + 1) * (len(batches[-1][0][1].token_ids) - 1) <= self.batch_tokens:
                batches[-1].append(item)
            else:
                batches.append([item])
        device = next(self.target.parameters()).device
        for batch in batches:
            t0 = time.perf_counter()
            width = len(batch[0][1].token_ids) - 1
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            rows, cols = [], []
            for b, (_, rec) in enumerate(batch):
                n = len(rec.token_ids) - 1
                ids[b, :n] = torch.from_numpy(rec.token_ids[:n]).long()
                mask[b, :n] = 1
                rows.append(torch.full((n + 1 - rec.num_prompt_tokens,), b))
                cols.append(torch.arange(rec.num_prompt_tokens - 1, n))
            hidden = self.target.base_model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
            picked = hidden[torch.cat(rows).to(device), torch.cat(cols).to(device)]  # [sum n_out, H]
            head = self.target.get_output_embeddings()
            parts = [
                _topk_dist(self._head(head, picked[i : i + HEAD_ROWS]), self.topk)
                for i in range(0, len(picked), HEAD_ROWS)
            ]
            dist = _cat_dists(parts)
            start = 0
            for (key, _), r in zip(batch, rows):
                end = start + len(r)
                self._remember(key, _rows(dist, start, end))
                start = end
            self.forwards += len(batch)
            self.batches += 1
            self.seconds += time.perf_counter() - t0
        return len(todo)

    def _head(self, head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The target's logits from its last hidden states (the LM head, and the final logit
        soft-capping of the models that have one, as their forward applies it)."""
        logits = head(hidden)
        cap = getattr(self.target.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


def _rows(dist: TargetDist, start: int, end: int) -> TargetDist:
    assert dist.topk_ids is not None and dist.residual is not None
    return TargetDist.topk(
        dist.topk_ids[start:end].clone(), dist.logprobs[start:end].clone(), dist.residual[start:end].clone()
    )


@torch.no_grad()
def draft_predictions(model: torch.nn.Module, rec: MissRecord, vocab: DraftVocab | None = None) -> torch.Tensor:
    """[n_out] the draft's argmax predicting each output token of ``rec`` from the prefix before it
    (one causal forward), restricted to its draft vocabulary ``vocab`` when it has one, as serving
    proposes (``specops.trainer.acceptance.evaluate_records`` scores drafts the same way)."""
    from specops.core.draft_vocab import supports_subset_head

    first, n = rec.num_prompt_tokens, len(rec.token_ids)
    device = next(model.parameters()).device
    ids = torch.from_numpy(rec.token_ids[: n - 1]).long().unsqueeze(0).to(device)
    keep = torch.arange(first - 1, n - 1, device=device)
    was = model.training
    model.eval()
    try:
        if vocab is not None and supports_subset_head(model):
            hidden = model.base_model(input_ids=ids).last_hidden_state[0, keep]
            logits = vocab.logits(model.get_output_embeddings(), hidden)  # -inf outside the vocabulary
        else:
            logits = model(input_ids=ids, logits_to_keep=keep).logits[0].float()
            if vocab is not None:
                outside = torch.ones(logits.shape[-1], dtype=torch.bool, device=device)
                outside[vocab.token_ids.to(device)] = False
                logits = logits.masked_fill(outside, float("-inf"))
    finally:
        model.train(was)
    return logits.argmax(-1).cpu()


def would_be_rejected(
    model: torch.nn.Module, rec: MissRecord, vocab: DraftVocab | None = None, target: TargetDist | None = None
) -> torch.Tensor:
    """[m] absolute positions (into ``rec.token_ids``) where ``model`` would have been rejected.

    Under greedy decoding every output token is the target's argmax, and the draft proposes
    from the committed prefix, which is the output itself: the draft's argmax differs from
    the output token exactly where a draft token proposed there is rejected. (Where the
    draft was not asked, after a run of ``k`` accepted tokens or at the output's end, the
    engine logs nothing; these positions are still ones the draft gets wrong.) A sampled
    request's output tokens are draws, not the target's argmax: its positions are where the
    draft's argmax differs from the target's, ``target``'s most likely token."""
    pred = draft_predictions(model, rec, vocab)
    if rec.sampling.temperature == 0.0 or target is None:
        want = torch.from_numpy(rec.token_ids[rec.num_prompt_tokens :]).long()
    else:
        assert target.topk_ids is not None
        want = target.topk_ids[:, 0].long()
    return torch.nonzero(pred != want).flatten() + rec.num_prompt_tokens


def rejected_example(
    model: torch.nn.Module,
    rec: MissRecord,
    teacher: Callable[[MissRecord], TargetDist],
    vocab: DraftVocab | None = None,
) -> Example:
    """A record an external engine served (no logged positions) as the rejected-position recipe
    trains it: the positions where ``model`` (the cluster's current draft) would be rejected
    (:func:`would_be_rejected`) and the target's distribution there, from the ``teacher``."""
    dist = teacher(rec)
    positions = would_be_rejected(model, rec, vocab, dist)
    rows = positions - rec.num_prompt_tokens
    assert dist.topk_ids is not None and dist.residual is not None
    target = TargetDist.topk(dist.topk_ids[rows], dist.logprobs[rows], dist.residual[rows])
    last = int(positions.max()) if positions.numel() else 0
    return Example(torch.from_numpy(rec.token_ids[:last]).long(), positions, target, rec.request_id)
