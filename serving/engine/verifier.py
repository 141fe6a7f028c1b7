"""The verifier: one target forward pass checks a proposal and emits accepted + bonus tokens.

Terms (accepted, rejected, bonus, committed) are defined in ``specops.serving.engine.types``.

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

``p`` is the target's warped distribution (temperature, min-p, top-k, top-p:
``specops.serving.engine.sampling.warp``), the same one target-only sampling draws from, so every
rule preserves the target's distribution. ``q`` is the draft's distribution under the same
warp, the one its tokens were drawn from; a token the target's filters dropped has ``p = 0``
and is always rejected, and one the draft's dropped (``q = 0``) comes only from the residual.

**Several drafts: a token tree** (``specops.serving.engine.tree``). Rows are merged into a trie and
one target pass scores every node (tree attention mask, each node at its own position).
The walk starts at the root (the last committed token) with the target's ``p`` there:

- **greedy**: descend to the child whose token is ``argmax p``; when there is none, that
  argmax is the bonus. The result is the longest path the target agrees with.
- **deterministic drafts, sampling**: draw ``y ~ p``; if ``y`` is a child, descend to it;
  otherwise ``y`` is the bonus. Every emitted token is a draw from the target's ``p`` at its
  position, so the output is distributed exactly as target-only sampling.
- **drafts sampled from a draft model** (recursive rejection sampling, SpecInfer's
  multi-step speculative sampling): a node's samples ``x_1 .. x_m`` are i.i.d. draws from
  the draft's ``q`` there. Try them in order: accept ``x_i`` with probability
  ``min(1, p(x_i)/q(x_i))``; after a rejection replace ``p`` by ``norm(max(0, p - q))``
  and try the next; if all are rejected the bonus is drawn from the last ``p``. Each trial
  is the single-draft rule applied to the current residual, which emits a token distributed
  as that residual's ``p``; by induction over the trials the token emitted at the node
  (accepted or bonus) is distributed as the original ``p``. A token rejected once has
  ``p(x) < q(x)``, so its residual mass is 0 and a duplicate sample of it is rejected too.

Not used, because it is biased: letting each row draw its own tokens and keeping the
longest match (the DReSD/REST public code). Ten identical drafts of a token with
``p = 0.1`` are then accepted with probability ``1 - 0.9**10 = 0.65``. The tests keep that
rule as a negative control for the chi-square test.
"""

from __future__ import annotations

import torch

from specops.serving.engine import processors
from specops.serving.engine import tree as tree_mod
from specops.serving.engine.grammar import Constraint
from specops.serving.engine.kv import CachedLM
from specops.serving.engine.sampling import draw, token_logprobs, uniform, warp
from specops.serving.engine.tree import TokenTree
from specops.serving.engine.types import DecodeState, Proposals, RejectedPosition, Verdict


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


def decide_tree(
    tree: TokenTree,
    probs: torch.Tensor,
    node_q: torch.Tensor | None,
    *,
    greedy: bool,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Apply the tree rules of the module docstring.

    ``probs`` [1 + num_nodes, vocab]: the target's warped distribution after the root (row
    0) and after each node; ``node_q`` the same shape, the draft's distribution each node's
    children were sampled from, or None for deterministic drafts. Returns ``(path, bonus)``,
    ``path`` the accepted nodes root to leaf.
    """
    assert probs.ndim == 2 and probs.shape[0] == tree.num_nodes + 1, (probs.shape, tree.num_nodes)
    path: list[int] = []
    node = 0
    while True:
        p = probs[node]
        samples = tree.samples[node]
        if not samples:
            return path, int(p.argmax()) if greedy else draw(p, generator)
        if greedy or node_q is None:
            y = int(p.argmax()) if greedy else draw(p, generator)
            child = tree.children(node).get(y)
            if child is None:
                return path, y
        else:
            q = node_q[node]
            child = None
            for c in samples:
                x = tree.tokens[c]
                p_x, q_x = float(p[x]), float(q[x])
                if q_x > 0 and uniform(generator) * q_x < p_x:  # accept iff u < p/q
                    child = c
                    break
                residual = (p - q).clamp_min(0.0)
                total = float(residual.sum())
                if total > 0:
                    p = residual / total
            if child is None:
                return path, draw(p, generator)
        path.append(child)
        node = child


class Verifier:
    """Checks proposals against the target model, keeping the target's KV cache."""

    def __init__(
        self,
        target: CachedLM,
        *,
        collect_rejections: bool = False,
        want_hidden: bool = False,
        eos: frozenset[int] | tuple[int, ...] = (),
    ) -> None:
        self.target = target
        self.collect_rejections = collect_rejections
        self.want_hidden = want_hidden
        self.eos = frozenset(eos)
        """The model's EOS tokens (``min_tokens`` masks them: ``specops.serving.engine.processors``)."""

    def _adjusted(self, logits: torch.Tensor, state: DecodeState, extras: list[list[int]]) -> torch.Tensor:
        """The rows' logits after the request's bias and penalties (``specops.serving.engine.processors``)."""
        return processors.adjust(logits, state.params, state.token_ids, state.num_prompt_tokens, extras, self.eos)

    def verify(self, state: DecodeState, proposals: Proposals, grammar: Constraint | None = None) -> Verdict:
        """Verify ``proposals`` (already pruned by ``grammar``, when the request has one: its
        masks apply to every row, ``specops.serving.engine.grammar``)."""
        if not proposals.is_chain:
            return self.verify_tree(state, proposals, grammar)
        assert self.target.num_cached < len(state.token_ids), (self.target.num_cached, len(state.token_ids))
        drafts = proposals.rows()[0]
        k = len(drafts)
        base = len(state.token_ids)  # absolute position of d_1

        feed = [*state.token_ids[self.target.num_cached :], *drafts]
        raw, hidden = self.target.forward(feed, logits_to_keep=k + 1, want_hidden=self.want_hidden)  # [k+1, vocab]
        paths = [drafts[:i] for i in range(k + 1)]  # row i: after d_1 .. d_i
        if grammar is not None:
            raw = grammar.mask(raw, paths)
        logits = self._adjusted(raw, state, paths)
        probs = warp(logits, state.params)  # [k+1, vocab]
        q = proposals.draft_probs[0] if proposals.draft_probs is not None else None  # [k, vocab]
        accepted, bonus = decide(probs, drafts, q, greedy=state.params.greedy, generator=state.generator)

        a = len(accepted)
        rejected = None
        if a < k and self.collect_rejections:
            rejected = RejectedPosition(
                index=base + a, drafted_token=drafts[a], emitted_token=bonus, target_logits=logits[a].clone()
            )
        logprobs = None
        if state.params.logprobs is not None:  # the rows that emitted the accepted drafts and the bonus
            logprobs = token_logprobs(raw[: a + 1], [*accepted, bonus], state.params, probs[: a + 1])
        # Keep the committed prefix and the accepted drafts; the bonus is fed next step.
        self.target.rollback(base + a)
        return Verdict(
            accepted=accepted,
            bonus=bonus,
            num_drafted=k,
            rejected=rejected,
            target_hidden=hidden[a].clone() if hidden is not None else None,
            path=list(range(1, a + 1)),
            num_nodes=k,
            target_pass=getattr(self.target, "last_pass", None),
            logprobs=logprobs,
        )

    def verify_tree(self, state: DecodeState, proposals: Proposals, grammar: Constraint | None = None) -> Verdict:
        """Several candidate rows: one target pass over their trie, then the tree rules."""
        assert self.target.num_cached < len(state.token_ids), (self.target.num_cached, len(state.token_ids))
        rows = proposals.rows()
        tree = tree_mod.build(rows)
        base = len(state.token_ids)
        if tree.num_nodes == 0:
            return self.verify(state, Proposals.empty(), grammar)
        committed = state.token_ids[self.target.num_cached :]
        raw, hidden = self.target.forward_tree(committed, tree, want_hidden=self.want_hidden)  # [1 + n, vocab]
        logits = raw
        if processors.adjusts(state.params) or grammar is not None:  # row c: after the path from the root to node c
            paths: list[list[int]] = [[]]
            for c in range(1, tree.num_nodes + 1):
                paths.append([*paths[tree.parent[c]], tree.tokens[c]])
            if grammar is not None:
                raw = grammar.mask(raw, paths)
            logits = self._adjusted(raw, state, paths)
        probs = warp(logits, state.params)  # [1 + n, vocab]
        node_q = None
        if proposals.draft_probs is not None:
            # the distribution each node's children were drawn from: the draft's at (row, column + 1)
            node_q = torch.zeros_like(probs)
            for child in range(1, tree.num_nodes + 1):
                r, j = tree.source[child]
                node_q[tree.parent[child]] = proposals.draft_probs[r, j]
        path, bonus = decide_tree(tree, probs, node_q, greedy=state.params.greedy, generator=state.generator)
        accepted = tree.path_tokens(path)
        last = path[-1] if path else 0
        rejected = None
        if self.collect_rejections and tree.samples[last]:  # a drafted token was turned down after `last`
            drafted = tree.tokens[tree.samples[last][0]]
            rejected = RejectedPosition(
                index=base + len(path), drafted_token=drafted, emitted_token=bonus, target_logits=logits[last].clone()
            )
        logprobs = None
        if state.params.logprobs is not None:  # the root's row, then each accepted node's (its child's)
            rows = [0, *path]
            logprobs = token_logprobs(raw[rows], [*accepted, bonus], state.params, probs[rows])
        self.target.keep_path(base, path)
        return Verdict(
            accepted=accepted,
            bonus=bonus,
            num_drafted=tree.max_depth,
            rejected=rejected,
            target_hidden=hidden[last].clone() if hidden is not None else None,
            path=path,
            num_nodes=tree.num_nodes,
            target_pass=getattr(self.target, "last_pass", None),
            logprobs=logprobs,
        )
