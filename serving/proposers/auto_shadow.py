"""Evidence from the copies ``auto`` did not take.

A copy (LLMA's, from references, retrieved passages, past sessions or the context) is made
every step whatever ``auto`` then runs, and it is deterministic: the tokens it would have
drafted are known. The target's output is the same whichever method drafts (lossless), so the
tokens the request then emits say how many of the copy's tokens verification would have
accepted:

- greedy: the verifier accepts a drafted token when it equals the target's argmax, i.e. the
  token that is emitted there; the count is exact;
- sampling: a deterministic draft is verified by drawing ``y ~ p`` and accepting while
  ``y`` equals the drafted token (``specops.serving.engine.verifier``); the emitted token *is*
  such a draw, so the count has the distribution the real step's would have had.

So every step where a copy was on offer and another option ran (target-only, the draft model,
a datastore), the copy is followed over the next steps' emitted tokens until it mismatches
(a rejection) or runs out (all accepted), and each matching token is counted at once, under
the key of the match length it would have been drafted at (``copy_keys``). The copy's keys
(source and match length) then learn from the steps ``auto`` declined,
not only from those it took: an estimate that starts low is no longer frozen by never being
tried, which is where issue 60's run left ``auto`` copying less than a fixed LLMA arm
(``docs/auto.md``). ``AutoPolicy.copy_shadows`` turns it off (the benchmark's ablation).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PENDING = 8
"""Copies followed at once per request; an older one is dropped (what it matched so far counted)."""


@dataclass
class _Shadow:
    keys: list[str]
    """Each token's acceptance key (the match length it would be drafted at: ``copy_keys``)."""
    tokens: list[int]
    matched: int = 0
    opened: bool = True
    """Not yet counted: its first update decays the key's counts, as a real step does."""


@dataclass(frozen=True)
class Evidence:
    """One followed copy's news from one step for one key: its tokens that matched, and whether
    the mismatch fell on it."""

    key: str
    accepted: int
    rejected: float
    opened: bool


class CopyShadows:
    """The copies one request declined, followed over the tokens it emits."""

    def __init__(self) -> None:
        self.pending: list[_Shadow] = []
        self.opened = 0
        self.accepted = 0
        self.rejected = 0

    def open(self, keys: list[str], tokens: list[int]) -> None:
        """A copy was on offer this step and another option ran: follow its ``tokens`` (token
        ``i`` counted under ``keys[i]``)."""
        if tokens:
            self.pending.append(_Shadow(list(keys), list(tokens)))
            self.opened += 1
            del self.pending[:-MAX_PENDING]

    def clear(self) -> None:
        """A rollback withdrew tokens (or the request restarted): the copies followed no longer apply."""
        self.pending.clear()

    def advance(self, emitted: list[int]) -> list[Evidence]:
        """The step's ``emitted`` tokens, in order, against every followed copy."""
        out: list[Evidence] = []
        keep: list[_Shadow] = []
        for s in self.pending:
            accepted, rejected, first = 0, 0.0, s.matched
            for tok in emitted:
                if s.matched == len(s.tokens):
                    break
                if s.tokens[s.matched] != tok:
                    rejected = 1.0
                    break
                s.matched += 1
                accepted += 1
            news: dict[str, list[float]] = {}
            for key in s.keys[first : first + accepted]:
                news.setdefault(key, [0.0, 0.0])[0] += 1.0
            if rejected:
                news.setdefault(s.keys[s.matched], [0.0, 0.0])[1] += 1.0
            out += [Evidence(key, int(a), r, s.opened) for key, (a, r) in news.items()]
            s.opened = False
            if not rejected and s.matched < len(s.tokens):
                keep.append(s)
            self.accepted += accepted
            self.rejected += int(rejected)
        self.pending = keep
        return out

    def summary(self) -> dict:
        """The response's ``speculation.auto.shadows``: copies followed, tokens they matched, mismatches."""
        return {"followed": self.opened, "accepted": self.accepted, "rejected": self.rejected}
