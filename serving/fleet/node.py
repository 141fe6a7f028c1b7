"""A serving node: one target, one hot-swappable draft per cluster, concurrent requests.

``ServingNode.generate`` is what the HTTP API (and the hot-swap benchmark's load
generator) calls from many threads at once:

1. take the cluster's current :class:`~serving.fleet.hotswap.DraftHandle`, once;
2. decode the whole request with that draft (``SpecEngine``, a fresh KV cache per
   request; model weights are only read, so requests share them safely);
3. name the version used in the result and in the logged ``MissRecord``;
4. count the request's drafted and accepted tokens on that version (live feedback), for a
   method whose artifact is the draft (``serving.proposers.catalogue``).

A swap that lands while a request runs changes nothing for that request.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from serving.engine.batching import TargetBatcher
from serving.engine.spec import SpecEngine
from serving.fleet.hotswap import DraftFollower, DraftHandle
from serving.engine.models import ModelPair
from serving.fleet.stream_logger import RequestMeta, StreamLogger
from serving.engine.types import GenerationResult, SamplingParams
from serving.proposers.catalogue import ProposerConfig, ProposerResources, method_spec


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

    def version_of(self, method: str) -> str:
        """The version of ``method``'s artifact that served this request ("" if it has none)."""
        artifact = method_spec(method).artifact
        return self.versions.get(artifact, "") if artifact else ""


class ServingNode:
    """Thread-safe ``generate`` over a target and the follower's per-cluster drafts."""

    def __init__(self, pair: ModelPair, follower: DraftFollower, *, logger: StreamLogger | None = None,
                 batcher: TargetBatcher | None = None, datastores=None) -> None:  # fmt: skip
        self.pair = pair
        self.follower = follower
        self.datastores = datastores
        """``serving.fleet.datastores.DatastoreFollower``: the cluster's DReSD datastore (or None)."""
        self.logger = logger
        self.batcher = batcher
        """When set, concurrent requests share target forward passes (``serving.engine.batching``)."""

    def generate(self, prompt_ids: list[int], params: SamplingParams, *, cluster: str = "default",
                 method: str = "draft", k: int | None = None, n_drafts: int = 0, request_id: str | None = None,
                 on_step: Callable[[list[int]], bool | None] | None = None) -> ServedResult:  # fmt: skip
        started_at = time.time()
        handle: DraftHandle = self.follower.slot(cluster).current()  # 1.
        pair = ModelPair(target=self.pair.target, draft=handle.model, tokenizer=self.pair.tokenizer,
                         tokenizer_sha256=self.pair.tokenizer_sha256)  # fmt: skip
        engine = SpecEngine(pair, logger=self.logger, target_lm=self.batcher.lm if self.batcher else None)
        rid = request_id or uuid.uuid4().hex
        versions = {"draft": handle.version}
        datastore = self.datastores.current(cluster) if self.datastores is not None else None  # 1. (once, too)
        if datastore is not None and datastore.datastore is not None:
            versions["datastore"] = datastore.version
        resources = ProposerResources(pair=pair, cluster=cluster, versions=versions,
                                      datastore=datastore.datastore if datastore is not None else None)  # fmt: skip
        meta = RequestMeta(request_id=rid, cluster=cluster, draft_model=handle.model_name, draft_version=handle.version,
                           artifact_versions={k: v for k, v in versions.items()
                                              if k == method_spec(method).artifact})  # fmt: skip
        if self.batcher is not None:
            self.batcher.begin()
        try:
            result = engine.generate(prompt_ids, params, proposer_cfg=ProposerConfig(method=method, n_drafts=n_drafts),
                                     k=k, resources=resources, meta=meta, on_step=on_step)  # 2. + 3.  # fmt: skip
        finally:
            if self.batcher is not None:
                self.batcher.end()
        if method_spec(method).artifact == "draft":
            self.follower.record(handle, result.stats)  # 4.
        elif method_spec(method).artifact == "datastore" and "datastore" in versions:
            self.datastores.record(cluster, versions["datastore"], result.stats)
        if method == "dresd" and resources.datastore is not None:
            from serving.proposers.dresd import resolve_shape

            n_drafts = resolve_shape(resources.datastore, n_drafts)[0]
        return ServedResult(rid, cluster, handle.model_name, handle.version, result, started_at, versions,
                            n_drafts if method_spec(method).default_n_drafts else 0)  # fmt: skip
