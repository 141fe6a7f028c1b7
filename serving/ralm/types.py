"""A retrieval loop's request (``RalmConfig``, validated as the API's ``retrieval`` block), what
it did (``RalmStats``, the response's ``retrieval`` block) and its result (``RalmResult``); the
loop itself is ``specops.serving.ralm.loop``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from specops.core.errors import InvalidRequestError

MODES = ("ralmspec", "ralmseq", "oneshot")
MAX_ONESHOT_PASSAGES = 20
MAX_INTERVAL = 64
MAX_PREFETCH = 256


@dataclass(frozen=True)
class RalmConfig:
    """One request's retrieval loop."""

    mode: str = "ralmspec"
    """``ralmspec`` (speculative retrieval, verified in batches) or ``ralmseq`` (the baseline)."""
    interval: int = 4
    """Tokens generated per retrieval (Ram et al.'s retrieval stride; the API's ``stride``)."""
    query_tokens: int = 32
    """The query is the last this-many tokens of prompt + output."""
    max_passage_tokens: int = 256
    """A retrieved passage is cut to this many tokens before it is put before the prompt."""
    speculation_stride: int = 0
    """Speculation steps per verification: 0 = OS³ chooses it live; n > 0 = always n (the paper's 3)."""
    prefetch: int = 20
    """KB results per query added to the local cache at every verification (1 = top-1 update only)."""
    asynchronous: bool | None = None
    """Verify in a worker thread while the next speculation step runs (True), or not (False);
    None (the default): each round, asynchronous while the request decodes alone, synchronous
    while others decode beside it (they already overlap the KB wait, and a synchronous loop
    batches more; ``benchmarks/out/ralm.json``: 1.12-1.14x RaLMSeq sync at 4-8 clients, 1.03-1.05x async),
    and always synchronous where the retriever's ``search_holds_gil`` (embedded Milvus Lite)."""
    speculation_off: bool = True
    """OS³ may skip speculating in a round when RaLMSeq is faster with the measured costs
    (``specops.serving.ralm.os3``); False is the paper's OS³, which always speculates."""
    reverify: bool = True
    """A mismatch re-verifies the withdrawn interval's tokens under the true passage, as one draft
    (the prefix both passages give is kept in one target pass), instead of regenerating it
    token by token; False regenerates (the paper's rollback)."""
    cache_size: int = 4096
    """Most passages in a request's local cache (least recently added out first)."""
    passages: int = 5
    """``oneshot``: passages retrieved once for the prompt and put before it."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidRequestError(
                f"retrieval.mode must be one of {', '.join(MODES)}, got {self.mode!r}", "retrieval.mode"
            )
        if not isinstance(self.interval, int) or not 1 <= self.interval <= MAX_INTERVAL:
            raise InvalidRequestError(
                f"retrieval.stride must be an integer in 1..{MAX_INTERVAL}, got {self.interval!r}", "retrieval.stride"
            )
        if not isinstance(self.query_tokens, int) or not 1 <= self.query_tokens <= 512:
            raise InvalidRequestError(
                f"retrieval.query_tokens must be an integer in 1..512, got {self.query_tokens!r}",
                "retrieval.query_tokens",
            )
        if not isinstance(self.speculation_stride, int) or not 0 <= self.speculation_stride <= 32:
            raise InvalidRequestError(
                f"retrieval.speculation_stride must be an integer in 0..32 (0 = OS³), got {self.speculation_stride!r}",
                "retrieval.speculation_stride",
            )
        if not isinstance(self.prefetch, int) or not 1 <= self.prefetch <= MAX_PREFETCH:
            raise InvalidRequestError(
                f"retrieval.prefetch must be an integer in 1..{MAX_PREFETCH}, got {self.prefetch!r}",
                "retrieval.prefetch",
            )
        if not isinstance(self.passages, int) or not 1 <= self.passages <= MAX_ONESHOT_PASSAGES:
            raise InvalidRequestError(
                f"retrieval.passages must be an integer in 1..{MAX_ONESHOT_PASSAGES}, got {self.passages!r}",
                "retrieval.passages",
            )
        if self.max_passage_tokens < 1 or self.cache_size < 1:
            raise ValueError("max_passage_tokens and cache_size must be >= 1")


@dataclass
class RalmStats:
    """What one request's retrieval loop did (the response's ``retrieval`` block)."""

    mode: str
    retriever: str
    intervals: int = 0
    """Retrievals the output needed (one per interval of the final output)."""
    kb_queries: int = 0
    """Queries sent to the knowledge base (RaLMSeq: one per interval)."""
    kb_calls: int = 0
    """KB searches (a batched verification is one)."""
    verification_batches: int = 0
    async_rounds: int = 0
    """Verifications that ran during a speculation step (asynchronously)."""
    speculations: int = 0
    """Retrievals answered from the local cache."""
    mismatches: int = 0
    """Verifications that found a wrong speculated passage."""
    rolled_back_tokens: int = 0
    reverify_steps: int = 0
    """Mismatches whose withdrawn interval was verified again under the true passage (``reverify``)."""
    reverified_tokens: int = 0
    """Of the withdrawn tokens, the ones the true passage also gave (kept without regenerating)."""
    unspeculated: int = 0
    """RaLMSpec rounds OS³ did not speculate in (a KB retrieval, then generation: RaLMSeq's
    interval), because with the measured costs RaLMSeq was faster."""
    strides: list[int] = field(default_factory=list)
    """Speculation stride of every verification, in order."""
    guesses_checked: int = 0
    """Cache guesses compared with the KB's answer (speculated ones up to the first mismatch of
    each verification, and the shadow guesses of unspeculated rounds)."""
    guesses_correct: int = 0
    """Of those, the ones equal to the KB's answer: ``correct / checked`` is the measured γ
    (the paper's speculation accuracy), uncapped, unlike OS³'s windowed estimate ``gamma``."""
    cache_passages: int = 0
    gamma: float = 0.0
    """OS³'s last estimate of the speculation accuracy."""
    time_s: dict[str, float] = field(
        default_factory=lambda: {
            "total": 0.0,
            "generate": 0.0,
            "embed": 0.0,
            "cache": 0.0,
            "kb_search": 0.0,
            "kb_wait": 0.0,
            "async_overlap": 0.0,
            "async_overlap_simulated": 0.0,
        }
    )
    """``generate``: decoding; ``embed``: query encoding; ``kb_search``: time inside KB searches;
    ``kb_wait``: time the loop waited for them (less than ``kb_search`` when verification
    overlapped generation); ``async_overlap``: the measured difference; ``async_overlap_simulated``:
    the paper's figure, ``Σ min(verification, speculation step)`` over asynchronous rounds."""

    @property
    def retrieval_s(self) -> float:
        """Wall time the request spent retrieving (encoding, cache, waiting for the KB)."""
        t = self.time_s
        return t["embed"] + t["cache"] + t["kb_wait"]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["time_s"] = {k: round(v, 6) for k, v in self.time_s.items()}
        out["gamma"] = round(self.gamma, 4)
        return out


@dataclass
class RalmResult:
    token_ids: list[int]
    """Generated tokens (prompt excluded)."""
    passages: list[int]
    """The passage of every interval of the output, in order."""
    stats: RalmStats
    finish_reason: str
    num_target_forwards: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    text: str | None = None
