"""The proposer seam: every drafting method implements ``Proposer``."""

from __future__ import annotations

from abc import ABC, abstractmethod

from specops.serving.engine.types import DecodeState, Proposals, Verdict


class Proposer(ABC):
    """Suggests up to ``k`` next tokens for a request; one instance serves one request at a time.

    Lifecycle per request: ``start(state)``, then alternately ``propose`` and
    ``observe`` (after the verifier has committed the verdict's tokens to ``state``),
    with ``rollback`` whenever the session withdraws tentative tokens, then ``finish()``.
    """

    name: str = "proposer"
    """The method it drafts for (the request's stats carry it)."""
    needs_hidden: bool = False
    """It keys on the target's last hidden state: the verifier returns it after every step."""
    num_forwards: int = 0
    """Model forward passes this proposer ran for the current request (0 for model-free ones)."""

    def start(self, state: DecodeState) -> None:
        """Per-request set-up (for example, prefill a draft model's cache)."""

    @abstractmethod
    def propose(self, state: DecodeState, k: int) -> Proposals:
        """Up to ``k`` tokens to follow ``state.token_ids``: ``[n_drafts, <=k]``."""

    def observe(self, state: DecodeState, verdict: Verdict) -> None:
        """Feedback after each verification step; ``state`` already holds the emitted tokens."""

    def observe_final(self, state: DecodeState, verdict: Verdict) -> None:
        """The verdict of the step that finished the request (``observe`` is not called for it:
        there is no next proposal to prepare). For accounting only; the default does nothing."""

    def rollback(self, state: DecodeState, position: int) -> None:
        """``state`` was cut back to ``position`` committed tokens (a withdrawn speculation):
        drop whatever this proposer holds about later positions. Stateless proposers need nothing."""

    def counters(self) -> dict[str, int]:
        """This proposer's own counters for the current request (reported with its stats)."""
        return {}

    def finish(self) -> None:
        """Release per-request resources."""
