"""The verifier: one target forward pass checks a proposal and emits accepted + bonus tokens.

Terms (accepted, rejected, bonus, committed) are defined in ``serving.engine.types``.

Target cache: a step feeds every committed token the cache lacks (the whole prompt
on the first step, which is the prefill; afterwards only the previous bonus token)
followed by ``d_1 .. d_k``, in one forward pass. Logits row ``i`` of the last ``k+1``
is the target's distribution for the position of ``d_{i+1}`` (row ``k`` is the position
after the last draft). After the verdict the cache is rolled back to the committed
prefix plus the accepted drafts, so it again holds every committed token but the last
(the bonus, fed first in the next step).

Acceptance rules (OSD §3; Leviathan et al. 2023; DReSD §3.6):

- **greedy**: accept the longest prefix with ``d_{i+1} == argmax p_i``; bonus is
  ``argmax p_a``.
- **sampling with draft_probs** (speculative rejection sampling, OSD Eq. 1): accept
  ``d_{i+1}`` with probability ``min(1, p_i(d)/q_i(d))``; at the first rejection draw the
  bonus from ``norm(max(0, p_i - q_i))``; if all are accepted draw it from ``p_k``.
- **sampling without draft_probs** (deterministic drafts): draw ``y ~ p_i``; accept while
  ``y == d_{i+1}``; the first mismatching draw is the bonus. This is the rule above with
  a one-hot ``q``.

``p`` is the target's warped distribution (temperature, top-p), the same one
target-only sampling draws from, so every rule preserves the target's distribution.
"""

from __future__ import annotations

import torch

from serving.engine.kv import CachedLM
from serving.engine.sampling import draw, uniform, warp
from serving.engine.types import DecodeState, Proposals, RejectedPosition, Verdict


def decide(
    probs: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    *,
    greedy: bool,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Apply the acceptance rule of the module docstring to one draft.

    ``probs`` [k+1, vocab] target's warped distributions; ``drafts`` k tokens;
    ``draft_probs`` [k, vocab] or None. Returns ``(accepted, bonus)``.
    """
    k = len(drafts)
    assert probs.ndim == 2 and probs.shape[0] == k + 1, (probs.shape, k)
    accepted: list[int] = []
    for i, d in enumerate(drafts):
        if greedy:
            y = int(probs[i].argmax())
            if y != d:
                return accepted, y
        elif draft_probs is not None:
            p_d, q_d = float(probs[i, d]), float(draft_probs[i, d])
            if not (q_d > 0 and uniform(generator) * q_d < p_d):  # accept iff u < p/q
                residual = (probs[i] - draft_probs[i]).clamp_min(0.0)
                total = float(residual.sum())
                return accepted, draw(residual / total, generator) if total > 0 else draw(probs[i], generator)
        else:
            y = draw(probs[i], generator)
            if y != d:
                return accepted, y
        accepted.append(d)
    # Every draft accepted: the bonus comes from the row after them.
    bonus = int(probs[k].argmax()) if greedy else draw(probs[k], generator)
    return accepted, bonus


class Verifier:
    """Checks proposals against the target model, keeping the target's KV cache."""

    def __init__(self, target: CachedLM, *, collect_rejections: bool = False, want_hidden: bool = False) -> None:
        self.target = target
        self.collect_rejections = collect_rejections
        self.want_hidden = want_hidden

    def verify(self, state: DecodeState, proposals: Proposals) -> Verdict:
        if proposals.num_drafts != 1:
            raise NotImplementedError("multi-draft (batch-expansion) verification is not implemented yet")
        assert self.target.num_cached < len(state.token_ids), (self.target.num_cached, len(state.token_ids))
        drafts = proposals.tokens[0].tolist()
        k = len(drafts)
        base = len(state.token_ids)  # absolute position of d_1

        feed = [*state.token_ids[self.target.num_cached:], *drafts]
        logits, hidden = self.target.forward(feed, logits_to_keep=k + 1, want_hidden=self.want_hidden)  # [k+1, vocab]
        probs = warp(logits, state.params)  # [k+1, vocab]
        q = proposals.draft_probs[0] if proposals.draft_probs is not None else None  # [k, vocab]
        accepted, bonus = decide(probs, drafts, q, greedy=state.params.greedy, generator=state.generator)

        a = len(accepted)
        rejected = None
        if a < k and self.collect_rejections:
            rejected = RejectedPosition(
                index=base + a, drafted_token=drafts[a], emitted_token=bonus, target_logits=logits[a].clone()
            )
        # Keep the committed prefix and the accepted drafts; the bonus is fed next step.
        self.target.rollback(base + a)
        return Verdict(
            accepted=accepted,
            bonus=bonus,
            num_drafted=k,
            rejected=rejected,
            target_hidden=hidden[a].clone() if hidden is not None else None,
        )
