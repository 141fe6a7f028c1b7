"""What a decoding mode and the node that runs it exchange, below both (``specops.serving.modes``,
``specops.serving.fleet.node``): the finished request (:class:`ServedResult`), a mode's result
(:class:`Decoded`), the names its records carry (:class:`RequestMeta`), and :class:`ModeHost`, the
members of the node a mode calls. The node implements ``ModeHost``; the modes import no node.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

from specops.core.models import ModelPair
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import ContextSpan, GenerationResult, RequestStats
from specops.serving.plan import DecodePlan
from specops.serving.proposers.catalogue import CATALOGUE

OnStep = Callable[[list[int]], "bool | None"] | None
"""A request's per-step hook: the tokens that became final; True ends the request."""


@dataclass(frozen=True)
class RequestMeta:
    """Who served a request, as the records name it."""

    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    cluster: str = "default"
    draft_model: str = ""
    draft_version: str = ""
    artifact_versions: dict[str, str] = field(default_factory=dict)
    """Artifact kind -> version the request used (the draft, a datastore, a knowledge base)."""
    engine: str = ""
    """The external engine that served the request (``vllm``), empty for ours (``MissRecord.engine``)."""


@dataclass(frozen=True)
class ServedResult:
    """A finished request and the draft that served it."""

    request_id: str
    cluster: str
    draft_model: str
    draft_version: str
    """The registry version decoded with (``base`` before the cluster had a champion)."""
    result: GenerationResult
    started_at: float = 0.0
    """Wall time just before the request took its draft handle."""
    versions: dict[str, str] = field(default_factory=dict)
    """Artifact kind -> version the request could use (``{"draft": ...}``)."""
    n_drafts: int = 0
    """Rows drafted per step by a multi-draft method (DReSD; 0 for the others)."""
    retrieval: dict | None = None
    """What a retrieval loop did (RaLMSeq/RaLMSpec or kNN-LM): the response's ``retrieval`` block."""
    engine: str = ""
    """The engine that decoded, when it is not ours (``vllm``: ``specops.serving.vllm.node``)."""
    counts_source: str = ""
    """Where another engine's drafted and accepted counts came from: ``vllm`` (its per-request
    metrics) or ``replay`` (recomputed from the output: ``specops.serving.vllm.replay``)."""

    def version_of(self, method: str) -> str:
        """The version of ``method``'s artifact that served this request ("" if it has none)."""
        spec = CATALOGUE.get(method)  # the plan's method, or one of its parts: no request look-up
        artifact = spec.artifact if spec is not None else None
        return self.versions.get(artifact, "") if artifact else ""


@dataclass(frozen=True)
class Decoded:
    """What a mode returns: the served result, and what the stream logger gets (if anything)."""

    served: ServedResult
    logged_prompt: tuple[int, ...] | None = None
    """The token ids the request decoded after (its prompt, or the context built around it);
    None: the request is not logged (kNN-LM: no draft served it)."""
    meta: RequestMeta | None = None


class DraftRef(Protocol):
    """The draft version a request took (``specops.serving.fleet.hotswap.DraftHandle``), as modes name it."""

    @property
    def model_name(self) -> str: ...

    @property
    def version(self) -> str: ...


class ModeHost(Protocol):
    """The members of the serving node (``specops.serving.fleet.node.ServingNode``) a mode calls."""

    pair: ModelPair
    """The target, the base draft and the tokenizer."""

    def decode(
        self,
        plan: DecodePlan,
        prompt_ids,
        *,
        on_step: OnStep = None,
        retrieved: tuple[tuple[int, ...], ...] = (),
        context_spans: tuple[ContextSpan, ...] = (),
    ) -> Decoded:
        """The plain decode of ``prompt_ids`` with the plan's method over the cluster's current draft."""
        ...

    def draft_pair(self, cluster: str) -> tuple[DraftRef, ModelPair]:
        """The cluster's current draft, taken once, and the pair it makes with the target."""
        ...

    def engine(self, pair: ModelPair, *, logged: bool) -> SpecEngine:
        """An engine over ``pair`` (sharing the batcher's target passes)."""
        ...

    def batched(self) -> AbstractContextManager[None]:
        """Counts the request among the batcher's running ones while it decodes."""
        ...

    def decoding(self) -> int:
        """Requests decoding on this node now (the batcher's count; 1 without a batcher)."""
        ...

    def record(self, plan: DecodePlan, handle: DraftRef, versions: dict[str, str], stats: RequestStats) -> None:
        """The drafted and accepted tokens go to the artifact version that drafted them."""
        ...

    def meta(self, plan: DecodePlan, handle: DraftRef, versions: dict[str, str]) -> RequestMeta:
        """The logged records' names of the request."""
        ...
