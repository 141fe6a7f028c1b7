"""One serving replica's wiring: the components behind the API, loaded in the background.

:class:`Replica` owns the components and loads them on a thread, so the API answers
``/healthz`` at once and ``/readyz`` turns 200 when the models are loaded:

1. the target and the base draft (one shared tokenizer, checked);
2. the stream logger (``spec.misses`` / ``spec.generations``), unless logging is off;
3. the draft follower (one hot-swapped draft per cluster, following ``champion``);
4. the router follower (the registered router's ``champion``), when routing is on;
5. the event watcher on ``spec.events``, pushing promotions to both followers;
6. one warm-up decode, then ready.

:meth:`Replica.decode` runs one request's :class:`~specops.serving.plan.DecodePlan` on the serving
node and counts it (``specops.serving.metrics``). What is HTTP (admission, validating the body into
a plan, streaming, deadlines) is ``specops.serving.http.server.ServingState``, which holds one.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specops.core.load_signal import write_load_signal
from specops.serving.config import ReplicaConfig
from specops.serving.engine.types import SamplingParams
from specops.serving.fleet.clusters import KnownClusters
from specops.serving.metrics import READY, count_request
from specops.serving.modes import mode_spec
from specops.serving.plan import DecodePlan

log = logging.getLogger(__name__)

READ_THROUGH = frozenset(
    "pair node ready load_error loading_step context_size known_clusters router follower policy logger registry "
    "datastores kbs knnlms batcher vllm session_follower cache_dir start_loading clusters".split()
)
"""The members of a :class:`Replica` that ``specops.serving.http.server.ServingState``, which holds one,
reads through (``state.pair`` is ``state.replica.pair``), read-only."""


class _Idle:
    running, waiting, load = 0, 0, 0.0


class Replica:
    """The components of one replica. ``start_loading`` returns at once; ``ready`` tells when done.

    ``cfg``: the sections it reads (``specops.serving.config.ReplicaConfig``: admission, engine, fleet,
    retrieval, vLLM, and its name). ``load_snapshot()``: the requests running and waiting now, and the
    load (``running``, ``waiting``, ``load``; the API's admission gives it): the ``auto`` policy's cost
    model and the load signal read it."""

    def __init__(
        self,
        cfg: ReplicaConfig,
        *,
        target_dir: Path,
        draft_dir: Path,
        cache_dir: Path,
        registry_factory: Callable[[], object | None] = lambda: None,
        stream_cfg=None,
        load_snapshot: Callable[[], object] = _Idle,
    ) -> None:
        self.cfg = cfg
        self.target_dir, self.draft_dir, self.cache_dir = Path(target_dir), Path(draft_dir), Path(cache_dir)
        self.registry_factory = registry_factory
        self.stream_cfg = stream_cfg
        self.load_snapshot = load_snapshot
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.loading_step = "not started"
        self.pair = self.node = self.follower = self.router = self.logger = self.watcher = self.registry = None
        self.datastores = None
        self.session_follower = None
        """Seeds the past-sessions cache from ``sessions-<cluster>@champion`` (``specops.serving.fleet.sessions``)."""
        self.batcher = None
        self.policy = None
        """The replica's ``auto`` policy (``specops.core.auto_policy.AutoPolicy``): acceptance per cluster, costs."""
        self.knnlms = None
        """kNN-LM datastores by name, loaded on first use."""
        self.vllm = None
        """``specops.serving.vllm.fleet.VLLMServers`` when vLLM decodes (``engine = "vllm"``)."""
        self.known_clusters = KnownClusters(
            [cfg.fleet.default_cluster, *cfg.fleet.clusters],
            router=lambda: self.router.current() if self.router is not None else None,
            champions=lambda: self.follower.champions if self.follower else (),
        )
        """The clusters a request may name (``specops.serving.fleet.clusters``); the followers follow no other."""
        self.kbs = None
        """Knowledge bases by name (``specops.serving.fleet.catalog.NamedArtifacts``), loaded on first use."""
        self.ralm_pool = ThreadPoolExecutor(cfg.admission.max_concurrency, thread_name_prefix="ralm-verify")
        """RaLMSpec's asynchronous verifications (one KB search per running request at most)."""
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------ lifecycle
    def start_loading(self) -> None:
        t = threading.Thread(target=self._load, name="serve-load", daemon=True)
        t.start()
        self._threads.append(t)

    def _load(self) -> None:
        from specops.core.threads import compute_thread

        compute_thread()  # loading times the target's linear routes: with the threads the batcher will have
        try:
            self._load_steps()
        except Exception as exc:  # readyz reports it; the process stays up for the operator to see
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.exception("serving could not start: %s", self.load_error)

    def _load_steps(self) -> None:
        from specops.core.device import Placement
        from specops.core.models import load_pair
        from specops.serving.fleet.hotswap import DraftFollower, HotSwapConfig
        from specops.serving.fleet.node import ServingNode

        cfg = self.cfg
        self.loading_step = "models"  # 1.
        # a missing GPU fails here, saying which flag to change
        placement = Placement(cfg.engine.device, cfg.engine.dtype)
        self.pair = load_pair(
            self.target_dir,
            self.draft_dir,
            draft_dtype=cfg.engine.draft_dtype,
            target_dtype=cfg.engine.dtype,
            device=placement.device,
            # vLLM decodes: the front door needs the models' configs and tokenizer, not their weights (a
            # draft is loaded here to validate a promoted version, and for a recount vLLM did not report)
            target_weights=cfg.engine.kind != "vllm",
            draft_weights=cfg.engine.kind != "vllm",
        )
        if self.stream_cfg is not None:  # 2.
            from specops.serving.fleet.stream_logger import LoggerConfig, StreamLogger

            self.loading_step = "stream logger"
            self.logger = StreamLogger(
                self.stream_cfg,
                LoggerConfig(sample_every=cfg.fleet.log_sample_every, queue_size=cfg.fleet.log_queue_size),
                vocab_size=self.pair.vocab_size,
            )
        self.loading_step = "registry"  # 3.
        self.registry = self.registry_factory()
        hcfg = HotSwapConfig(
            poll_s=cfg.fleet.poll_s,
            auto_rollback=cfg.fleet.auto_rollback,
            live_report_every=cfg.fleet.live_report_every,
            rollback_min_requests=cfg.fleet.rollback_min_requests,
            rollback_margin=cfg.fleet.rollback_margin,
            replica=cfg.name,  # reports what it serves to the registry (`registry ls`)
        )
        follow = dict(
            target_vocab=self.pair.vocab_size,
            target_tokenizer_sha256=self.pair.tokenizer_sha256,
            cache_dir=self.cache_dir / "drafts",
            cfg=hcfg,
        )
        if cfg.engine.kind == "vllm":
            self.follower = self._vllm_follower(follow)
        else:
            self.follower = DraftFollower(self.registry, self.pair.draft, **follow)
        self.follower.allow = self.known_clusters.exists
        self.follower.start()  # lists the clusters with a champion draft: they exist from the first request
        self.loading_step = "datastores"
        self.datastores = self._datastores()
        self.kbs = self._kbs()
        self.knnlms = self._knnlms()
        if cfg.fleet.router == "registry" and self.registry is not None:  # 4.
            from specops.core.embed import make_embedder
            from specops.serving.fleet.router import RouterFollower

            self.loading_step = "router"
            self.router = RouterFollower(
                self.registry,
                cache_dir=self.cache_dir / "router",
                embedder_factory=lambda kind: make_embedder(kind, target=self.pair),
                poll_s=cfg.fleet.poll_s,
            )
            self.router.start()
        if self.stream_cfg is not None:  # 5.
            from specops.serving.fleet.events import EventWatcher

            self.watcher = EventWatcher(self.stream_cfg, cfg.name, self._on_event).start()
        if cfg.engine.kind == "specops":  # every target pass runs on the batcher's thread, alone or batched
            from specops.serving.engine.batching import TargetBatcher

            self.batcher = TargetBatcher(
                self.pair.target,
                max_batch=min(cfg.engine.batch_max_size, cfg.admission.max_concurrency),
                window_s=cfg.engine.batch_window_ms / 1000,
            )
        sessions = None
        if cfg.retrieval.session_cache_tokens:
            from specops.core.sessions.cache import SessionCacheConfig
            from specops.serving.proposers.session_cache import SessionCache

            sessions = SessionCache(SessionCacheConfig(max_tokens=cfg.retrieval.session_cache_tokens))
            # shared: sessions-<cluster> mix tenants
            if self.registry is not None and cfg.retrieval.session_sharing == "shared":
                self.session_follower = self._session_follower(sessions)
        self.policy = self._policy()
        self.policy.padded_batches = self.batcher is not None and not self.batcher.packed
        parts = dict(logger=self.logger, datastores=self.datastores, sessions=sessions, policy=self.policy)
        if cfg.engine.kind == "vllm":
            from specops.serving.vllm.node import VLLMNode

            self.node = VLLMNode(
                self.pair,
                self.follower,
                speculation=cfg.vllm.speculations,
                k=cfg.vllm.k,
                copy_k=cfg.vllm.copy_k,
                served_name="target",
                request_timeout_s=cfg.admission.request_timeout_s,
                servers=self.vllm,
                **parts,
            )
        else:
            self.node = ServingNode(self.pair, self.follower, batcher=self.batcher, **parts)
            self.loading_step = "warm-up"  # 6.
            from specops.serving.engine.spec import SpecEngine
            from specops.serving.plan import plain_generate

            plain_generate(SpecEngine(self.pair), [0, 1, 2, 3], SamplingParams(max_new_tokens=2), "draft")
        if cfg.engine.auto_calibrate and cfg.engine.kind == "specops":
            from specops.serving.proposers.auto import calibrate

            costs = calibrate(self.policy, self.pair)
            log.info("auto policy calibrated: %s", ", ".join(f"{k} {v:.2f}" for k, v in costs.items()))
        if cfg.admission.load_signal:
            self._spawn(self._write_load_signal, "load-signal")
        self.loading_step = "ready"
        self.ready.set()
        READY.set(1)
        log.info(
            "serving ready: target %s, base draft %s, router %s, stream %s, registry %s",
            self.target_dir,
            self.draft_dir,
            cfg.fleet.router if self.router else "off",
            self.stream_cfg.url if self.stream_cfg else "off",
            getattr(getattr(self.registry, "cfg", None), "uri", "off"),
        )

    def _vllm_follower(self, follow: dict):
        """The draft follower whose versions vLLM serves: the base draft's server started (and
        ready) here, a champion's before its cluster swaps to it (``specops.serving.vllm.fleet``)."""
        import shlex

        from specops.serving.vllm.fleet import VLLMDraftFollower, VLLMServers
        from specops.serving.vllm.process import ServerSpec, vllm_python

        cfg = self.cfg
        self.loading_step = "vLLM servers"
        spec = ServerSpec(
            self.target_dir,
            cfg.vllm.speculations[0],
            None,
            cfg.vllm.k,
            served_name="target",
            max_model_len=cfg.vllm.max_model_len,
            kv_cache_gb=cfg.vllm.kv_cache_gb,
            max_num_seqs=max(cfg.admission.max_concurrency, 1),
            dtype=cfg.engine.dtype,
            extra_args=tuple(shlex.split(cfg.vllm.args)),
            views_dir=self.cache_dir / "vllm" / "draft-views" if cfg.vllm.draft_vocab else None,
        )
        self.vllm = VLLMServers(
            spec,
            methods=cfg.vllm.speculations,
            python=vllm_python(cfg.vllm.python),
            log_dir=self.cache_dir / "vllm",
            start_timeout_s=cfg.vllm.start_timeout_s,
            drain_s=cfg.admission.request_timeout_s,
            standby=cfg.vllm.standby,
            copy_k=cfg.vllm.copy_k,
        )
        follower = VLLMDraftFollower(
            self.registry, self.pair.draft, servers=self.vllm, base_draft_dir=self.draft_dir, **follow
        )
        # the base draft's server and the shared ones (target-only, n-gram, copy) start side by side:
        # much of a vLLM start is single-threaded (imports, loading), so two cores start two at once
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(self.vllm.methods)) as pool:
            started = [pool.submit(follower.start_base)]
            started += [pool.submit(self.vllm.get, None, m, m) for m in self.vllm.methods if m != "draft"]
            for f in started:
                f.result()
        follower.start_standby()  # after the servers requests need: the standby starts in the background
        return follower

    def _policy(self):
        """The ``auto`` policy: requests in flight from admission, priors from ``auto_priors``."""
        from specops.core.auto_policy import AutoPolicy

        policy = AutoPolicy(
            max_k=min(self.cfg.engine.auto_max_k, self.cfg.admission.max_k), load=lambda: self.load_snapshot().running
        )
        if self.cfg.engine.auto_priors:
            try:  # a bad file stops the start (readyz says why): the operator asked for these priors
                policy.load_priors(json.loads(Path(self.cfg.engine.auto_priors).read_text()))
            except ValueError as exc:
                raise ValueError(f"auto_priors {self.cfg.engine.auto_priors}: {exc}") from None
            log.info("auto policy priors from %s", self.cfg.engine.auto_priors)
        elif self.registry is not None:
            self._load_policy_priors(policy)
        return policy

    def _load_policy_priors(self, policy) -> None:
        """``policy@champion`` from the registry (``specops policy fit --register --promote``), if any.
        A failure is logged, never fatal: the policy then starts from its calibration."""
        try:
            v = self.registry.artifact("policy").by_alias("", "champion")
            if v is None:
                return
            dest = self.cache_dir / "policy" / str(v.version)
            if not (dest / "priors.json").exists():
                dest.parent.mkdir(parents=True, exist_ok=True)
                self.registry.artifact("policy").fetch(v, dest)
            policy.load_priors(json.loads((dest / "priors.json").read_text()))
            log.info("auto policy priors: policy version %s", v.version)
        except Exception as exc:  # the registry may be down or the file bad: serve on without priors
            log.warning("auto policy priors not loaded from the registry: %s: %s", type(exc).__name__, exc)

    def _datastores(self):
        """The DReSD datastore follower: ``datastore-<cluster>@champion`` per cluster, and the
        fallback of ``datastore_dir`` (checked to fit this target) for clusters without one."""
        from specops.core.datastore import Datastore
        from specops.serving.fleet.datastores import DatastoreFollower

        fallback = Datastore.load(Path(self.cfg.retrieval.datastore_dir)) if self.cfg.retrieval.datastore_dir else None
        follower = DatastoreFollower(
            self.registry,
            self.pair.target,
            cache_dir=self.cache_dir / "datastores",
            fallback=fallback,
            target_tokenizer_sha256=self.pair.tokenizer_sha256,
            vocab_size=self.pair.vocab_size,
            follow=self._follow_cfg(),
        )
        follower.allow = self.known_clusters.exists  # a registered datastore of no cluster is not polled
        return follower.start()

    def _follow_cfg(self):
        from specops.serving.fleet.follower import FollowConfig

        return FollowConfig(
            poll_s=self.cfg.fleet.poll_s,
            backoff_initial_s=min(1.0, self.cfg.fleet.poll_s),
            backoff_max_s=max(1.0, self.cfg.fleet.poll_s),
        )

    def _session_follower(self, sessions):
        """Past sessions seeded from each cluster's ``sessions-<cluster>@champion``, checked to fit
        this target's tokenizer and vocabulary."""
        from specops.serving.fleet.sessions import SessionFollower

        follower = SessionFollower(
            self.registry,
            sessions,
            cache_dir=self.cache_dir / "sessions",
            target_tokenizer_sha256=self.pair.tokenizer_sha256,
            vocab_size=self.pair.vocab_size,
            follow=self._follow_cfg(),
        )
        follower.allow = self.known_clusters.exists  # registered past sessions of no cluster are not polled
        return follower.start()

    def _kbs(self):
        """Knowledge bases: the local ``kb_dirs`` by their own names, then ``kb-<name>@champion``."""
        from specops.serving.fleet.catalog import NamedArtifacts
        from specops.serving.retrieval.kb import KnowledgeBase

        local = {}
        for d in self.cfg.retrieval.kb_dirs:
            kb = KnowledgeBase.load(Path(d))
            local[kb.name] = kb
        return NamedArtifacts(
            "kb",
            KnowledgeBase.load,
            registry=self.registry,
            cache_dir=self.cache_dir / "kbs",
            local=local,
            field="retrieval.kb",
            poll_s=self.cfg.fleet.poll_s,
        ).start()

    def _knnlms(self):
        """kNN-LM datastores: the local ``knnlm_dirs`` by folder name, then ``knnlm-<name>@champion``;
        each checked to fit this target and tokenizer."""
        from specops.serving.fleet.catalog import NamedArtifacts
        from specops.serving.ralm.knnlm.store import KnnDatastore

        def load(path: Path):
            return KnnDatastore.load(Path(path), target=self.pair.target, tokenizer_sha256=self.pair.tokenizer_sha256)

        local = {Path(d).name: load(Path(d)) for d in self.cfg.retrieval.knnlm_dirs}
        return NamedArtifacts(
            "knnlm",
            load,
            registry=self.registry,
            cache_dir=self.cache_dir / "knnlm",
            local=local,
            field="knnlm.datastore",
            poll_s=self.cfg.fleet.poll_s,
        ).start()

    def _spawn(self, fn: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=fn, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _on_event(self, event) -> None:
        self.follower.on_event(event)
        if self.datastores is not None:
            self.datastores.on_event(event)
        if self.session_follower is not None:
            self.session_follower.on_event(event)
        if self.router is not None:
            self.router.on_event(event)
        if getattr(event, "model_name", "") == "policy" and self.policy is not None and self.registry is not None:
            threading.Thread(
                target=self._load_policy_priors, args=(self.policy,), name="policy-priors", daemon=True
            ).start()  # a promoted priors version: merged in, off the event thread

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop taking work, finish what runs, flush the stream (accepted records are not lost)."""
        READY.set(0)
        self.ready.clear()
        self._stop.set()
        self.ralm_pool.shutdown(wait=False)
        for part in (
            self.watcher,
            self.router,
            self.follower,
            self.datastores,
            self.session_follower,
            self.batcher,
            self.kbs,
            self.knnlms,
        ):
            if part is not None:
                part.stop()
        if self.vllm is not None:
            self.vllm.close(timeout_s)
        if self.logger is not None:
            self.logger.close(timeout_s=timeout_s)

    # ------------------------------------------------------------ status
    @property
    def context_size(self) -> int:
        """The target's context; through vLLM, at most its servers' ``--max-model-len`` (a longer
        prompt is then the client's 400, not a server's failure)."""
        if self.cfg.engine.kind == "vllm":
            return min(self.pair.context_size, self.cfg.vllm.max_model_len)
        return self.pair.context_size

    def clusters(self) -> dict:
        """``/v1/clusters``' body: the draft version each cluster serves, the router's version, and with
        ``engine = "vllm"`` the vLLM servers (``specops.serving.vllm.fleet.VLLMServers.describe``)."""
        out: dict = {}
        if self.follower is not None:
            out["drafts"] = {c: s.current().version for c, s in sorted(self.follower.slots.items())}
        if self.router is not None:
            r = self.router.current()
            out["router"] = r.version if r is not None else None
        if self.vllm is not None:  # the vLLM servers behind this front door, the standbys, starts and reloads
            out["vllm"] = self.vllm.describe()
        return out

    def _write_load_signal(self) -> None:
        path = Path(self.cfg.admission.load_signal)
        path.parent.mkdir(parents=True, exist_ok=True)
        while not self._stop.wait(1.0):
            write_load_signal(path, self.load_snapshot().load)

    # ------------------------------------------------------------ one request
    def decode(self, plan: DecodePlan, on_step: Callable[[list[int]], bool | None] | None = None):
        """Decode ``plan`` on this (worker) thread (``specops.serving.fleet.node.ServingNode.serve``) and
        count it; returns the node's ``ServedResult``."""
        served = self.node.serve(plan, on_step=on_step, pool=self.ralm_pool)
        count_request(plan, served, policy=self.policy, sessions=self.node.sessions)
        mode_spec(plan.mode).count(served.retrieval)
        return served
