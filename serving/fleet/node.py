"""A serving node: one target, one hot-swappable draft per cluster, concurrent requests.

``ServingNode.serve(plan)`` is what the replica (``specops.serving.replica``) calls from many
threads at once, for one request's :class:`~specops.serving.plan.DecodePlan`:

1. dispatch once over the mode catalogue (``specops.serving.modes``): plain, one-shot RAG, RaLM or
   kNN-LM; a mode decodes with the cluster's current :class:`~specops.serving.fleet.hotswap.DraftHandle`,
   taken once (:meth:`decode`: a fresh KV cache per request; model weights are only read, so
   requests share them safely), and names the versions used in the result;
2. count the request's drafted and accepted tokens on the artifact version that drafted them
   (live feedback, :meth:`record`), as the method's catalogue entry says;
3. hand the finished request to the stream logger, here and only here, for every mode.

A swap that lands while a request runs changes nothing for that request.
``ServingNode.generate`` serves a plan built without an HTTP request (``DecodePlan.plain``:
benchmarks, tests), its resources checked as the HTTP layer does.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from specops.core.models import ModelPair
from specops.serving.engine.batching import TargetBatcher
from specops.serving.engine.spec import RequestHooks, SpecEngine
from specops.serving.engine.types import ContextSpan
from specops.serving.fleet.hotswap import DraftFollower, DraftHandle
from specops.serving.fleet.stream_logger import RequestMeta, StreamLogger
from specops.serving.modes import Decoded, ServedResult, mode_spec
from specops.serving.plan import DecodePlan
from specops.serving.proposers.catalogue import (
    CATALOGUE,
    ProposerResources,
    check_resources,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Part:
    """The drafted and accepted tokens of one method within a request (live acceptance)."""

    num_drafted: int
    num_accepted: int


class ServingNode:
    """Thread-safe ``serve`` over a target and the follower's per-cluster drafts."""

    def __init__(
        self,
        pair: ModelPair,
        follower: DraftFollower,
        *,
        logger: StreamLogger | None = None,
        batcher: TargetBatcher | None = None,
        datastores=None,
        sessions=None,
        policy=None,
    ) -> None:
        self.pair = pair
        self.policy = policy
        """The replica's ``auto`` policy (None: the process default)."""
        self.sessions = sessions
        """``specops.serving.proposers.session_cache.SessionCache``: each cluster's past outputs, the copy
        source of methods that copy references (or None: off)."""
        self.follower = follower
        self.datastores = datastores
        """``specops.serving.fleet.datastores.DatastoreFollower``: the cluster's DReSD datastore (or None)."""
        self.logger = logger
        self.batcher = batcher
        """When set, concurrent requests share target forward passes (``specops.serving.engine.batching``)."""
        if hasattr(follower, "on_swap"):
            follower.on_swap.append(self.draft_swapped)

    def draft_swapped(self, cluster: str, version) -> None:
        """A new draft serves ``cluster``: ``auto``'s estimates of the draft model there were the
        old one's. They start over from the promotion gate's ``served`` score of the new version
        (its per-token agreement on the cluster's recent greedy traffic), or, without one, from
        no evidence (so ``auto`` tries the new draft rather than keep avoiding the old one)."""
        from specops.core.auto_policy import AutoPolicy
        from specops.serving.proposers.auto import default_policy
        from specops.serving.proposers.catalogue import CATALOGUE

        policy = self.policy if isinstance(self.policy, AutoPolicy) else default_policy()
        methods = [s.name for s in CATALOGUE.values() if s.joins_auto and "draft_model" in s.needs]
        alpha = gate_alpha(getattr(version, "tags", None) or {})
        policy.reseed(cluster, methods, alpha)
        log.info(
            "cluster %s: auto's estimate of the draft model restarts at %s (draft version %s)",
            cluster,
            "no evidence" if alpha is None else f"the gate's served α {alpha:.3f}",
            getattr(version, "version", version),
        )

    # ------------------------------------------------------------ one request
    def serve(
        self, plan: DecodePlan, *, on_step: Callable[[list[int]], bool | None] | None = None, pool=None
    ) -> ServedResult:
        """Decode ``plan`` in its mode (1., 2.), then hand it to the stream logger (3.).
        ``on_step(final)`` gets the tokens that became final after each step; returning True
        ends the request (a stop sequence), and an exception it raises ends it unlogged."""
        decoded = mode_spec(plan.mode).run(self, plan, on_step, pool)
        if self.logger is not None and decoded.logged_prompt is not None:  # 3.: never blocks or raises
            t_log = time.perf_counter()
            result = decoded.served.result
            self.logger.log(list(decoded.logged_prompt), result, plan.params, decoded.meta or RequestMeta())
            result.stats.time_s["log"] = time.perf_counter() - t_log
        return decoded.served

    def generate(self, plan: DecodePlan, *, on_step: Callable[[list[int]], bool | None] | None = None) -> ServedResult:
        """A plan's decode without an HTTP request (``DecodePlan.plain``: benchmarks, tests): the
        method's resources checked here, as the HTTP layer does, then :meth:`serve`."""
        cluster = plan.cluster
        datastore = self.datastores.current(cluster).datastore if self.datastores is not None else None
        check_resources(
            plan.spec,
            ProposerResources(
                pair=self.draft_pair(cluster)[1], cluster=cluster, datastore=datastore, references=plan.references
            ),
        )
        return self.serve(plan, on_step=on_step)

    fixed_method: str | None = None
    """The one method this node decodes every request with, which a request that names none
    gets instead of ``default_method`` (vLLM's speculation); ``None``: our engine runs any."""

    def check_plan(self, plan: DecodePlan, *, explicit_method: bool, explicit_k: bool) -> None:
        """Refuse (4xx) a plan this node cannot decode as asked; our engine decodes every plan."""

    # ------------------------------------------------------------ what the modes use
    def draft_pair(self, cluster: str) -> tuple[DraftHandle, ModelPair]:
        """The cluster's current draft handle, taken once, and the pair it makes with the target."""
        handle: DraftHandle = self.follower.slot(cluster).current()
        pair = ModelPair(
            target=self.pair.target,
            draft=handle.model,
            tokenizer=self.pair.tokenizer,
            tokenizer_sha256=self.pair.tokenizer_sha256,
        )
        return handle, pair

    def engine(self, pair: ModelPair, *, logged: bool) -> SpecEngine:
        """An engine over ``pair`` (sharing target passes with the batcher, when on); ``logged``:
        keep the target's distributions at rejections, for the stream logger's records."""
        collect = logged and self.logger is not None and self.logger.cfg.enabled
        return SpecEngine(pair, collect_rejections=collect, target_lm=self.batcher.lm if self.batcher else None)

    @contextlib.contextmanager
    def batched(self):
        """Counts the request among the batcher's running ones while it decodes."""
        if self.batcher is not None:
            self.batcher.begin()
        try:
            yield
        finally:
            if self.batcher is not None:
                self.batcher.end()

    def decoding(self) -> int:
        """Requests decoding on this node now (the batcher's count; 1 without a batcher)."""
        return max(1, self.batcher.active) if self.batcher is not None else 1

    def meta(self, plan: DecodePlan, handle: DraftHandle, versions: dict[str, str]) -> RequestMeta:
        """The logged records' names: the request, its cluster, the draft and the artifact versions
        its method used (all of them for a method that drafts with others)."""
        spec = plan.spec
        used = {k: v for k, v in versions.items() if k == spec.artifact or spec.parts is not None}
        return RequestMeta(
            request_id=plan.request_id,
            cluster=plan.cluster,
            draft_model=handle.model_name,
            draft_version=handle.version,
            artifact_versions=used,
        )

    def record(self, plan: DecodePlan, handle: DraftHandle, versions: dict[str, str], stats) -> None:
        """2.: the drafted and accepted tokens go to the artifact version that drafted them."""
        if plan.spec.parts is None:
            self._record(plan.spec.artifact, plan.cluster, handle, versions, stats, plan.spec.name)
            return
        for method, (drafted, accepted) in plan.spec.parts(stats).items():
            spec = CATALOGUE.get(method)
            if drafted and spec is not None:
                self._record(spec.artifact, plan.cluster, handle, versions, _Part(drafted, accepted), method)

    def _record(
        self, artifact: str | None, cluster: str, handle: DraftHandle, versions: dict[str, str], counts, method: str
    ) -> None:
        if artifact == "draft":
            self.follower.record(handle, counts)
        elif artifact == "datastore" and "datastore" in versions:
            self.datastores.record(cluster, versions["datastore"], counts, method)

    def decode(
        self,
        plan: DecodePlan,
        prompt_ids,
        *,
        on_step=None,
        retrieved: tuple[tuple[int, ...], ...] = (),
        context_spans: tuple[ContextSpan, ...] = (),
    ) -> Decoded:
        """The plain decode of ``prompt_ids`` (the prompt, or a context built around it) with the
        plan's method, over the cluster's current draft and datastore."""
        started_at = time.time()
        handle, pair = self.draft_pair(plan.cluster)
        engine = self.engine(pair, logged=True)
        spec, cluster = plan.spec, plan.cluster
        versions = {"draft": handle.version}
        datastore = self.datastores.current(cluster) if self.datastores is not None else None  # once, too
        if datastore is not None and datastore.datastore is not None:
            versions["datastore"] = datastore.version
        copies = spec.copies_references
        past = self.sessions.index(cluster, plan.session_scope) if self.sessions is not None and copies else None
        resources = ProposerResources(
            pair=pair,
            cluster=cluster,
            versions=versions,
            references=plan.references,
            retrieved=tuple(retrieved),
            reference_indexes=(past,) if past is not None else (),
            datastore=datastore.datastore if datastore is not None else None,
            policy=self.policy,
            model_lm=self.batcher.lm if self.batcher is not None else None,
            n_drafts=plan.n_drafts,
        )
        hooks = RequestHooks(on_step=on_step, prefix_share=plan.prefix_share)
        with self.batched():
            proposer = plan.proposer(resources)
            result = engine.generate(list(prompt_ids), plan.params, proposer, plan.k, tuple(context_spans), hooks)
        if self.sessions is not None:
            self.sessions.add(cluster, result.token_ids, plan.session_scope)
        self.record(plan, handle, versions, result.stats)
        n_drafts = plan.n_drafts
        if spec.served_n_drafts is not None:
            n_drafts = spec.served_n_drafts(resources, n_drafts)
        served = ServedResult(
            plan.request_id, cluster, handle.model_name, handle.version, result, started_at, versions, n_drafts
        )
        return Decoded(served, tuple(int(t) for t in prompt_ids), self.meta(plan, handle, versions))


def gate_alpha(tags: dict) -> float | None:
    """The promotion gate's ``served`` score of a draft version (its tags), or None when it was
    gated on another metric (rejected-position acceptance is not the per-token α) or not at all."""
    if tags.get("gate_metric") != "served":
        return None
    try:
        alpha = float(tags.get("gate_candidate_acceptance", ""))
    except ValueError:
        return None
    return alpha if 0.0 <= alpha <= 1.0 else None
