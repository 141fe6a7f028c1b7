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

from specops.serving.engine.batching import TargetBatcher
from specops.serving.engine.spec import SpecEngine
from specops.serving.fleet.hotswap import DraftFollower, DraftHandle
from specops.serving.engine.models import ModelPair
from specops.serving.fleet.stream_logger import RequestMeta, StreamLogger
from specops.serving.engine.types import GenerationResult, SamplingParams
from specops.serving.proposers.catalogue import ProposerConfig, ProposerResources, method_spec


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

    def version_of(self, method: str) -> str:
        """The version of ``method``'s artifact that served this request ("" if it has none)."""
        artifact = method_spec(method).artifact
        return self.versions.get(artifact, "") if artifact else ""


@dataclass(frozen=True)
class _Part:
    """The drafted and accepted tokens of one method within an ``auto`` request (live acceptance)."""

    num_drafted: int
    num_accepted: int


class ServingNode:
    """Thread-safe ``generate`` over a target and the follower's per-cluster drafts."""

    def __init__(self, pair: ModelPair, follower: DraftFollower, *, logger: StreamLogger | None = None,
                 batcher: TargetBatcher | None = None, datastores=None, sessions=None, policy=None) -> None:  # fmt: skip
        self.pair = pair
        self.policy = policy
        """The replica's ``auto`` policy (``serving.engine.auto.AutoPolicy``; None: the process default)."""
        self.sessions = sessions
        """``serving.proposers.session_cache.SessionCache``: each cluster's past outputs, LLMA's
        cache-assisted copy source (or None: off)."""
        self.follower = follower
        self.datastores = datastores
        """``serving.fleet.datastores.DatastoreFollower``: the cluster's DReSD datastore (or None)."""
        self.logger = logger
        self.batcher = batcher
        """When set, concurrent requests share target forward passes (``serving.engine.batching``)."""

    def generate(self, prompt_ids: list[int], params: SamplingParams, *, cluster: str = "default",
                 method: str = "draft", k: int | None = None, n_drafts: int = 0, request_id: str | None = None,
                 on_step: Callable[[list[int]], bool | None] | None = None,
                 references: tuple[tuple[int, ...], ...] = (), llma_min_n: int = 1,
                 retrieved: tuple[tuple[int, ...], ...] = (), context_spans: tuple = (),
                 session_scope: str = "") -> ServedResult:  # fmt: skip
        """``session_scope``: whose past outputs of the cluster the request copies from and adds
        its output to (a tenant id; ``""``: the cluster's shared scope)."""
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
        copies = method in ("llma", "auto")
        past = self.sessions.index(cluster, session_scope) if self.sessions is not None and copies else None
        resources = ProposerResources(pair=pair, cluster=cluster, versions=versions, references=tuple(references),
                                      retrieved=tuple(retrieved),
                                      reference_indexes=(past,) if past is not None else (),
                                      datastore=datastore.datastore if datastore is not None else None,
                                      policy=self.policy)  # fmt: skip
        meta = RequestMeta(request_id=rid, cluster=cluster, draft_model=handle.model_name, draft_version=handle.version,
                           artifact_versions={k: v for k, v in versions.items()
                                              if k == method_spec(method).artifact or method == "auto"})  # fmt: skip
        if self.batcher is not None:
            self.batcher.begin()
        try:
            cfg = ProposerConfig(method=method, n_drafts=n_drafts, llma_min_n=llma_min_n)
            result = engine.generate(prompt_ids, params, proposer_cfg=cfg, k=k, resources=resources, meta=meta,
                                     on_step=on_step, context_spans=tuple(context_spans))  # 2. + 3.  # fmt: skip
        finally:
            if self.batcher is not None:
                self.batcher.end()
        if self.sessions is not None:
            self.sessions.add(cluster, result.token_ids, session_scope)
        if method == "auto":  # 4., for the parts auto drafted with a versioned artifact
            part = result.stats.proposer
            if part.get("drafted_draft"):
                self.follower.record(handle, _Part(part["drafted_draft"], part["accepted_draft"]))
            if part.get("drafted_dresd") and "datastore" in versions:
                self.datastores.record(cluster, versions["datastore"], _Part(part["drafted_dresd"], part["accepted_dresd"]))
        elif method_spec(method).artifact == "draft":
            self.follower.record(handle, result.stats)  # 4.
        elif method_spec(method).artifact == "datastore" and "datastore" in versions:
            self.datastores.record(cluster, versions["datastore"], result.stats)
        if method == "dresd" and resources.datastore is not None:
            from specops.serving.proposers.dresd import resolve_shape

            n_drafts = resolve_shape(resources.datastore, n_drafts)[0]
        return ServedResult(rid, cluster, handle.model_name, handle.version, result, started_at, versions,
                            n_drafts if method_spec(method).default_n_drafts else 0)  # fmt: skip

    def generate_ralm(self, prompt_ids: list[int], params: SamplingParams, *, kb, retriever: str, ralm,
                      cluster: str = "default", method: str = "draft", k: int | None = None,
                      request_id: str | None = None,
                      on_step: Callable[[list[int]], bool | None] | None = None, pool=None) -> ServedResult:  # fmt: skip
        """One request through RaLMSeq or RaLMSpec (``serving.ralm.loop``) over ``kb`` (a
        ``serving.fleet.catalog.Loaded`` knowledge base), decoding between retrievals with
        ``method`` and the cluster's current draft. ``on_step(final)`` gets verified output only."""
        from specops.serving.engine.types import GenerationResult, RequestStats
        from specops.serving.ralm.loop import RalmGenerator

        started_at = time.time()
        handle: DraftHandle = self.follower.slot(cluster).current()
        pair = ModelPair(target=self.pair.target, draft=handle.model, tokenizer=self.pair.tokenizer,
                         tokenizer_sha256=self.pair.tokenizer_sha256)  # fmt: skip
        engine = SpecEngine(pair, target_lm=self.batcher.lm if self.batcher else None)
        rid = request_id or uuid.uuid4().hex
        versions = {"draft": handle.version, "kb": kb.version}
        knowledge = kb.artifact
        gen = RalmGenerator(engine, knowledge.retriever(retriever), lambda ids: [p.text for p in knowledge.passages(ids)],
                            pair.tokenizer, ralm, method=method, k=k,
                            resources=ProposerResources(pair=pair, cluster=cluster, versions=versions), pool=pool)  # fmt: skip
        if self.batcher is not None:
            self.batcher.begin()
        try:
            out = gen.generate(prompt_ids, params, on_final=on_step)
        finally:
            if self.batcher is not None:
                self.batcher.end()
        stats = RequestStats(method=method, num_prompt_tokens=len(prompt_ids), num_generated=len(out.token_ids),
                             num_drafted=out.num_drafted, num_accepted=out.num_accepted,
                             num_target_forwards=out.num_target_forwards, finish_reason=out.finish_reason)  # fmt: skip
        stats.time_s["total"] = out.stats.time_s["total"]
        result = GenerationResult(token_ids=out.token_ids, stats=stats, text=out.text)
        if method_spec(method).artifact == "draft" and out.num_drafted:
            self.follower.record(handle, stats)
        if self.logger is not None:  # the finished generation feeds the trainer like any other
            self.logger.log(list(prompt_ids), result, params, RequestMeta(
                request_id=rid, cluster=cluster, draft_model=handle.model_name, draft_version=handle.version))
        used, seen = [], set()
        for pid in out.passages:
            if pid not in seen:
                seen.add(pid)
                used.append(pid)
        cited = [{"id": p.id, "title": p.title} for p in knowledge.passages(used)]
        block = {"kb": kb.name, "kb_version": kb.version, "retriever": retriever, "passages": cited,
                 "interval_passages": list(out.passages), **out.stats.to_dict()}  # fmt: skip
        return ServedResult(rid, cluster, handle.model_name, handle.version, result, started_at, versions, 0, block)

    def generate_oneshot(self, prompt_ids: list[int], params: SamplingParams, *, kb, retriever: str, ralm,
                         method: str = "draft", **kw) -> ServedResult:  # fmt: skip
        """One-shot retrieval-augmented generation: the top ``ralm.passages`` passages of ``kb``
        for the prompt are put before it (``serving.ralm.loop.oneshot_context``), then the request
        decodes as :meth:`generate` does (``kw``); with ``llma`` the passages are also its
        ``retrieved`` references. The response's ``retrieval`` block names the passages."""
        from dataclasses import replace

        from specops.serving.ralm.loop import oneshot_context

        knowledge = kb.artifact
        shot = oneshot_context(knowledge.retriever(retriever), lambda ids: [p.text for p in knowledge.passages(ids)],
                               self.pair.tokenizer, list(prompt_ids), ralm)  # fmt: skip
        served = self.generate(shot.context_ids, params, method=method, context_spans=shot.spans,
                               retrieved=shot.passage_tokens if method in ("llma", "auto") else (), **kw)  # fmt: skip
        cited = [{"id": p.id, "title": p.title} for p in knowledge.passages(shot.passage_ids)]
        block = {"kb": kb.name, "kb_version": kb.version, "retriever": retriever, "mode": "oneshot", "passages": cited,
                 "kb_calls": 1, "kb_queries": 1, "speculations": 0, "mismatches": 0,
                 "context_tokens": len(shot.context_ids) - len(prompt_ids),
                 "time_s": {"embed": 0.0, "cache": 0.0, "kb_wait": round(shot.search_s, 6),
                            "generate": round(served.result.stats.time_s.get("total", 0.0), 6), "async_overlap": 0.0}}  # fmt: skip
        return replace(served, versions={**served.versions, "kb": kb.version}, retrieval=block)

    def generate_knnlm(self, prompt_ids: list[int], params: SamplingParams, *, store, knn, cluster: str = "default",
                       request_id: str | None = None,
                       on_step: Callable[[list[int]], bool | None] | None = None) -> ServedResult:  # fmt: skip
        """One request decoded by kNN-LM (``serving.ralm.knnlm``) over ``store`` (a
        ``serving.fleet.catalog.Loaded`` datastore): baseline or speculative, same output."""
        from specops.serving.engine.types import GenerationResult, RequestStats
        from specops.serving.ralm.knnlm import KnnLM

        started_at = time.time()
        rid = request_id or uuid.uuid4().hex
        out = KnnLM(self.pair.target, store.artifact, knn, eos_token_ids=self.pair.eos_token_ids,
                    tokenizer=self.pair.tokenizer).generate(prompt_ids, params, on_final=on_step)  # fmt: skip
        reason = "eos" if out.finish_reason == "stop" else out.finish_reason
        stats = RequestStats(method="target", num_prompt_tokens=len(prompt_ids), num_generated=len(out.token_ids),
                             finish_reason=reason)  # fmt: skip
        stats.time_s["total"] = out.stats.total_s
        result = GenerationResult(token_ids=out.token_ids, stats=stats, text=out.text)
        block = {"datastore": store.name, "version": store.version, "lambda": knn.lam, **out.stats.to_dict()}
        return ServedResult(rid, cluster, "", "", result, started_at, {"knnlm": store.version}, 0, block)
