"""What one serving replica runs behind the HTTP API, and one request's path through it.

:class:`ServingState` owns the components and loads them in the background, so the API
answers ``/healthz`` at once and ``/readyz`` turns 200 when the models are loaded:

1. the target and the base draft (one shared tokenizer, checked);
2. the stream logger (``spec.misses`` / ``spec.generations``), unless logging is off;
3. the draft follower (one hot-swapped draft per cluster, following ``champion``);
4. the router follower (the registered router's ``champion``), when routing is on;
5. the event watcher on ``spec.events``, pushing promotions to both followers;
6. one warm-up decode, then ready.

A request is a :class:`Job`: :meth:`ServingState.prepare` tokenizes, bounds-checks and
routes it (errors here are the caller's 4xx); :meth:`ServingState.run` decodes it on a
worker thread, streaming text deltas through ``Job.on_delta`` and ending early on a stop
sequence, a client that went away, or the request deadline.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import Counter, Gauge

from specops.serving.http.admission import Admission
from specops.serving.http.config import ServeConfig
from specops.serving.engine import limits
from specops.serving.load_signal import write_load_signal
from specops.serving.errors import (InvalidRequestError, PromptTooLongError, RequestTimeoutError, RequestTooLargeError,
                            UnavailableError)  # fmt: skip
from specops.serving.errors import ForbiddenError
from specops.serving.http.tenancy import ANONYMOUS, Tenant
from specops.serving.fleet.clusters import KnownClusters, cluster_label
from specops.serving.proposers.catalogue import ProposerResources, check_resources, method_spec
from specops.serving.engine.types import SamplingParams

log = logging.getLogger(__name__)

GENERATED = Counter("specops_generated_tokens_total", "Tokens generated", ["cluster"])
DRAFTED = Counter("specops_drafted_tokens_total", "Draft tokens proposed", ["cluster", "method", "version"])
ACCEPTED = Counter("specops_accepted_tokens_total", "Draft tokens accepted", ["cluster", "method", "version"])
TOKENS_PER_S = Gauge("specops_tokens_per_second", "Generated tokens per second over the last 10 s")
ROUTED = Counter("specops_routed_requests_total", "Requests per cluster and how the cluster was chosen",
                 ["cluster", "source"])  # fmt: skip
CANCELLED = Counter("specops_requests_cancelled_total", "Requests ended early", ["reason"])
READY = Gauge("specops_ready", "1 when the models are loaded and requests are served")
KNNLM_REQUESTS = Counter("specops_knnlm_requests_total", "kNN-LM requests", ["searcher", "mode"])
KNNLM_SEARCHES = Counter("specops_knnlm_searches_total", "kNN-LM datastore searches (a batched verification is one)",
                         ["searcher", "mode"])  # fmt: skip
KNNLM_TOKENS = Counter("specops_knnlm_tokens_total", "Tokens decoded by kNN-LM", ["searcher", "mode"])
LLMA_STEPS = Counter("specops_llma_steps_total", "LLMA proposer calls", ["cluster"])
LLMA_HITS = Counter("specops_llma_hits_total", "LLMA proposer calls that copied, by the source of the best copy",
                    ["cluster", "source"])  # fmt: skip
LLMA_REFERENCE_TOKENS = Counter("specops_llma_reference_tokens_total", "Reference tokens LLMA requests sent "
                                "(references and earlier chat turns)", ["cluster"])  # fmt: skip
SESSION_CACHE_TOKENS = Gauge("specops_llma_session_cache_tokens", "Tokens of past outputs held per cluster "
                             "(LLMA's cache-assisted source)", ["cluster"])  # fmt: skip
SESSION_CACHE_OUTPUTS = Gauge("specops_llma_session_cache_outputs", "Past outputs held per cluster", ["cluster"])
AUTO_STEPS = Counter("specops_auto_steps_total", "Decoding steps of method 'auto' requests, by the method each "
                     "step chose ('target': no draft)", ["cluster", "method"])  # fmt: skip
AUTO_ESTIMATE = Gauge("specops_auto_estimate_tokens_per_second", "The auto policy's latest speed estimate of each "
                      "option (its best k), per cluster", ["cluster", "method"])  # fmt: skip
AUTO_ACCEPTANCE = Gauge("specops_auto_acceptance", "The auto policy's acceptance estimate (decayed, per drafted "
                        "token) per cluster, method (llma@mN: copy at match length N+) and temperature bucket",
                        ["cluster", "key", "temperature"])  # fmt: skip
AUTO_VERIFY_MS = Gauge("specops_auto_verify_ms", "Measured target verify cost a + b*tokens, per requests-in-flight "
                       "bucket", ["load", "coef"])  # fmt: skip
RALM_REQUESTS = Counter("specops_ralm_requests_total", "Retrieval-loop requests", ["retriever", "mode"])
RALM_KB_QUERIES = Counter("specops_ralm_kb_queries_total", "Queries sent to knowledge bases", ["retriever", "mode"])
RALM_KB_CALLS = Counter("specops_ralm_kb_calls_total", "Knowledge-base searches (a batched verification is one)",
                        ["retriever", "mode"])  # fmt: skip
RALM_SPECULATIONS = Counter("specops_ralm_speculations_total", "Retrievals answered from a request's local cache",
                            ["retriever", "mode"])  # fmt: skip
RALM_MISMATCHES = Counter("specops_ralm_mismatches_total", "Verifications that found a wrong speculated passage",
                          ["retriever", "mode"])  # fmt: skip
RALM_SECONDS = Counter("specops_ralm_seconds_total", "Wall seconds of retrieval-loop requests by stage "
                       "(retrieval waited for, generation, verification hidden by async overlap)",
                       ["retriever", "mode", "stage"])  # fmt: skip


class ClientGone(Exception):
    """The streaming client disconnected: stop decoding (nothing is logged)."""


@dataclass
class Job:
    """One admitted request, from parse to response."""

    prompt_ids: list[int]
    prompt_text: str
    params: SamplingParams
    method: str
    k: int
    cluster: str
    cluster_source: str
    """``request`` (the request's field), ``router`` or ``default``."""
    router_version: str = ""
    stop: list[str] = field(default_factory=list)
    n_drafts: int = 0
    """Rows per step for a multi-draft method (0: the method's default)."""
    ralm: object | None = None
    """``serving.ralm.loop.RalmConfig`` when the request asked for a retrieval loop."""
    kb: object | None = None
    """The knowledge base it names (``serving.fleet.catalog.Loaded``)."""
    retriever: str = ""
    knnlm: object | None = None
    """``serving.ralm.knnlm.KnnConfig`` when the request asked for kNN-LM decoding."""
    knnlm_store: object | None = None
    """The kNN-LM datastore it names (``serving.fleet.catalog.Loaded``)."""
    references: tuple[tuple[int, ...], ...] = ()
    """LLMA's reference texts, tokenized (the request's ``references``, earlier chat turns)."""
    llma_min_n: int = 1
    tenant: str = ANONYMOUS.id
    """The id of the tenant that sent it (``serving.http.tenancy``; never the key)."""
    on_delta: Callable[[str], None] | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    cancel: threading.Event = field(default_factory=threading.Event)
    # filled in by run()
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0
    """Characters of ``text`` already handed to ``on_delta``."""
    stopped: bool = False
    abandoned: bool = False
    """The API answered with the request timeout while a step had not returned (``ServingState.abandon``)."""


class ServingState:
    """The components of one replica. ``start_loading`` returns at once; ``ready`` tells when done."""

    def __init__(self, cfg: ServeConfig, *, target_dir: Path, draft_dir: Path, cache_dir: Path,
                 registry_factory: Callable[[], object | None] = lambda: None, stream_cfg=None) -> None:  # fmt: skip
        self.cfg = cfg
        self.target_dir, self.draft_dir, self.cache_dir = Path(target_dir), Path(draft_dir), Path(cache_dir)
        self.registry_factory = registry_factory
        self.stream_cfg = stream_cfg
        self.admission = Admission(cfg.max_concurrency, cfg.max_queue, cfg.queue_timeout_s)
        self.executor = ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="decode")
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.loading_step = "not started"
        self.pair = self.node = self.follower = self.router = self.logger = self.watcher = self.registry = None
        self.datastores = None
        self.session_follower = None
        """Seeds the past-sessions cache from ``sessions-<cluster>@champion`` (``serving.fleet.sessions``)."""
        self.batcher = None
        self.policy = None
        """The replica's ``auto`` policy (``serving.engine.auto.AutoPolicy``): acceptance per cluster, costs."""
        self.knnlms = None
        """kNN-LM datastores by name, loaded on first use."""
        self.known_clusters = KnownClusters([cfg.default_cluster, *cfg.clusters],
                                            router=lambda: self.router.current() if self.router is not None else None,
                                            champions=lambda: self.follower.champions if self.follower else ())  # fmt: skip
        """The clusters a request may name (``serving.fleet.clusters``); the followers follow no other."""
        self.kbs = None
        """Knowledge bases by name (``serving.fleet.catalog.NamedArtifacts``), loaded on first use."""
        self.ralm_pool = ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="ralm-verify")
        """RaLMSpec's asynchronous verifications (one KB search per running request at most)."""
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._recent_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------ lifecycle
    def start_loading(self) -> None:
        t = threading.Thread(target=self._load, name="serve-load", daemon=True)
        t.start()
        self._threads.append(t)

    def _load(self) -> None:
        try:
            self._load_steps()
        except Exception as exc:  # readyz reports it; the process stays up for the operator to see
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.exception("serving could not start: %s", self.load_error)

    def _load_steps(self) -> None:
        from specops.serving.fleet.hotswap import DraftFollower, HotSwapConfig
        from specops.serving.engine.device import Placement
        from specops.serving.engine.models import load_pair
        from specops.serving.fleet.node import ServingNode

        cfg = self.cfg
        self.loading_step = "models"  # 1.
        placement = Placement(cfg.device, cfg.dtype)  # a missing GPU fails here, saying which flag to change
        self.pair = load_pair(self.target_dir, self.draft_dir, draft_dtype=cfg.draft_dtype, target_dtype=cfg.dtype,
                              device=placement.device)  # fmt: skip
        if self.stream_cfg is not None:  # 2.
            from specops.serving.fleet.stream_logger import LoggerConfig, StreamLogger

            self.loading_step = "stream logger"
            self.logger = StreamLogger(self.stream_cfg, LoggerConfig(sample_every=cfg.log_sample_every,
                                       queue_size=cfg.log_queue_size), vocab_size=self.pair.vocab_size)  # fmt: skip
        self.loading_step = "registry"  # 3.
        self.registry = self.registry_factory()
        hcfg = HotSwapConfig(poll_s=cfg.poll_s, auto_rollback=cfg.auto_rollback, live_report_every=cfg.live_report_every,
                             rollback_min_requests=cfg.rollback_min_requests, rollback_margin=cfg.rollback_margin)  # fmt: skip
        self.follower = DraftFollower(self.registry, self.pair.draft, target_vocab=self.pair.vocab_size,
                                      target_tokenizer_sha256=self.pair.tokenizer_sha256,
                                      cache_dir=self.cache_dir / "drafts", cfg=hcfg)  # fmt: skip
        self.follower.allow = self.known_clusters.exists
        self.follower.start()  # lists the clusters with a champion draft: they exist from the first request
        self.loading_step = "datastores"
        self.datastores = self._datastores()
        self.kbs = self._kbs()
        self.knnlms = self._knnlms()
        if cfg.router == "registry" and self.registry is not None:  # 4.
            from specops.serving.fleet.router import RouterFollower, make_embedder

            self.loading_step = "router"
            self.router = RouterFollower(self.registry, cache_dir=self.cache_dir / "router",
                                         embedder_factory=lambda kind: make_embedder(kind, target=self.pair),
                                         poll_s=cfg.poll_s)  # fmt: skip
            self.router.start()
        if self.stream_cfg is not None:  # 5.
            from specops.serving.fleet.events import EventWatcher

            self.watcher = EventWatcher(self.stream_cfg, cfg.replica_name, self._on_event).start()
        if cfg.batch_max_size > 1 and cfg.max_concurrency > 1:
            from specops.serving.engine.batching import TargetBatcher

            self.batcher = TargetBatcher(self.pair.target, max_batch=min(cfg.batch_max_size, cfg.max_concurrency),
                                         window_s=cfg.batch_window_ms / 1000)  # fmt: skip
        sessions = None
        if cfg.session_cache_tokens:
            from specops.serving.proposers.session_cache import SessionCache, SessionCacheConfig

            sessions = SessionCache(SessionCacheConfig(max_tokens=cfg.session_cache_tokens))
            if self.registry is not None and cfg.session_sharing == "shared":  # sessions-<cluster> mix tenants
                self.session_follower = self._session_follower(sessions)
        self.policy = self._policy()
        self.policy.padded_batches = self.batcher is not None
        self.node = ServingNode(self.pair, self.follower, logger=self.logger, batcher=self.batcher,
                                datastores=self.datastores, sessions=sessions, policy=self.policy)  # fmt: skip
        self.loading_step = "warm-up"  # 6.
        from specops.serving.engine.spec import SpecEngine

        SpecEngine(self.pair).generate([0, 1, 2, 3], SamplingParams(max_new_tokens=2), method="draft")
        if cfg.auto_calibrate:
            costs = self.policy.calibrate(self.pair)
            log.info("auto policy calibrated: %s", ", ".join(f"{k} {v:.2f}" for k, v in costs.items()))
        if cfg.load_signal:
            self._spawn(self._write_load_signal, "load-signal")
        self._spawn(self._throughput, "throughput")
        self.loading_step = "ready"
        self.ready.set()
        READY.set(1)
        log.info("serving ready: target %s, base draft %s, router %s, stream %s, registry %s", self.target_dir,
                 self.draft_dir, cfg.router if self.router else "off",
                 self.stream_cfg.url if self.stream_cfg else "off",
                 getattr(getattr(self.registry, "cfg", None), "uri", "off"))  # fmt: skip

    def _policy(self):
        """The ``auto`` policy: requests in flight from admission, priors from ``auto_priors``."""
        from specops.serving.engine.auto import AutoPolicy

        policy = AutoPolicy(max_k=min(self.cfg.auto_max_k, self.cfg.max_k),
                            load=lambda: self.admission.snapshot().running)  # fmt: skip
        if self.cfg.auto_priors:
            try:  # a bad file stops the start (readyz says why): the operator asked for these priors
                policy.load_priors(json.loads(Path(self.cfg.auto_priors).read_text()))
            except ValueError as exc:
                raise ValueError(f"auto_priors {self.cfg.auto_priors}: {exc}") from None
            log.info("auto policy priors from %s", self.cfg.auto_priors)
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
                self.registry.fetch(v, dest)
            policy.load_priors(json.loads((dest / "priors.json").read_text()))
            log.info("auto policy priors: policy version %s", v.version)
        except Exception as exc:  # the registry may be down or the file bad: serve on without priors
            log.warning("auto policy priors not loaded from the registry: %s: %s", type(exc).__name__, exc)

    def _datastores(self):
        """The DReSD datastore follower: ``datastore-<cluster>@champion`` per cluster, and the
        fallback of ``datastore_dir`` (checked to fit this target) for clusters without one."""
        from specops.serving.fleet.datastores import DatastoreFollower
        from specops.serving.retrieval.datastore import Datastore

        fallback = Datastore.load(Path(self.cfg.datastore_dir)) if self.cfg.datastore_dir else None
        follower = DatastoreFollower(self.registry, self.pair.target, cache_dir=self.cache_dir / "datastores",
                                     fallback=fallback, target_tokenizer_sha256=self.pair.tokenizer_sha256,
                                     vocab_size=self.pair.vocab_size, follow=self._follow_cfg())  # fmt: skip
        follower.allow = self.known_clusters.exists  # a registered datastore of no cluster is not polled
        return follower.start()

    def _follow_cfg(self):
        from specops.serving.fleet.follower import FollowConfig

        return FollowConfig(poll_s=self.cfg.poll_s, backoff_initial_s=min(1.0, self.cfg.poll_s),
                            backoff_max_s=max(1.0, self.cfg.poll_s))  # fmt: skip

    def _session_follower(self, sessions):
        """Past sessions seeded from each cluster's ``sessions-<cluster>@champion``, checked to fit
        this target's tokenizer and vocabulary."""
        from specops.serving.fleet.sessions import SessionFollower

        follower = SessionFollower(self.registry, sessions, cache_dir=self.cache_dir / "sessions",
                                   target_tokenizer_sha256=self.pair.tokenizer_sha256, vocab_size=self.pair.vocab_size,
                                   follow=self._follow_cfg())  # fmt: skip
        follower.allow = self.known_clusters.exists  # registered past sessions of no cluster are not polled
        return follower.start()

    def _kbs(self):
        """Knowledge bases: the local ``kb_dirs`` by their own names, then ``kb-<name>@champion``."""
        from specops.serving.fleet.catalog import NamedArtifacts
        from specops.serving.retrieval.kb import KnowledgeBase

        local = {}
        for d in self.cfg.kb_dirs:
            kb = KnowledgeBase.load(Path(d))
            local[kb.name] = kb
        return NamedArtifacts("kb", KnowledgeBase.load, registry=self.registry, cache_dir=self.cache_dir / "kbs",
                              local=local, field="retrieval.kb", poll_s=self.cfg.poll_s).start()  # fmt: skip

    def _knnlms(self):
        """kNN-LM datastores: the local ``knnlm_dirs`` by folder name, then ``knnlm-<name>@champion``;
        each checked to fit this target and tokenizer."""
        from specops.serving.fleet.catalog import NamedArtifacts
        from specops.serving.ralm.knnlm_store import KnnDatastore

        def load(path: Path):
            return KnnDatastore.load(Path(path), target=self.pair.target, tokenizer_sha256=self.pair.tokenizer_sha256)

        local = {Path(d).name: load(Path(d)) for d in self.cfg.knnlm_dirs}
        return NamedArtifacts("knnlm", load, registry=self.registry, cache_dir=self.cache_dir / "knnlm", local=local,
                              field="knnlm.datastore", poll_s=self.cfg.poll_s).start()  # fmt: skip

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
            threading.Thread(target=self._load_policy_priors, args=(self.policy,), name="policy-priors",
                             daemon=True).start()  # a promoted priors version: merged in, off the event thread

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop taking work, finish what runs, flush the stream (accepted records are not lost)."""
        READY.set(0)
        self.ready.clear()
        self._stop.set()
        self.executor.shutdown(wait=True, cancel_futures=False)
        self.ralm_pool.shutdown(wait=False)
        for part in (self.watcher, self.router, self.follower, self.datastores, self.session_follower, self.batcher,
                     self.kbs, self.knnlms):  # fmt: skip
            if part is not None:
                part.stop()
        if self.logger is not None:
            self.logger.close(timeout_s=timeout_s)

    # ------------------------------------------------------------ status
    @property
    def context_size(self) -> int:
        return self.pair.context_size

    def status(self) -> dict:
        """``/readyz``'s body: readiness and load, no cluster names (the probe needs no key)."""
        snap = self.admission.snapshot()
        out = {"ready": self.ready.is_set(), "step": self.loading_step, "running": snap.running,
               "waiting": snap.waiting, "load": round(snap.load, 3)}  # fmt: skip
        if self.load_error:
            out["error"] = self.load_error
        return out

    def clusters(self) -> dict:
        """``/v1/clusters``' body: the draft version each cluster serves, and the router's version."""
        out: dict = {}
        if self.follower is not None:
            out["drafts"] = {c: s.current().version for c, s in sorted(self.follower.slots.items())}
        if self.router is not None:
            r = self.router.current()
            out["router"] = r.version if r is not None else None
        return out

    def _write_load_signal(self) -> None:
        path = Path(self.cfg.load_signal)
        path.parent.mkdir(parents=True, exist_ok=True)
        while not self._stop.wait(1.0):
            write_load_signal(path, self.admission.snapshot().load)

    def _throughput(self, window_s: float = 10.0) -> None:
        while not self._stop.wait(1.0):
            now = time.time()
            with self._recent_lock:
                while self._recent and self._recent[0][0] < now - window_s:
                    self._recent.popleft()
                TOKENS_PER_S.set(sum(n for _, n in self._recent) / window_s)

    # ------------------------------------------------------------ requests
    def prepare(self, prompt: str | list[int], *, params: SamplingParams, method: str | None, k: int | None,
                cluster: str | None, stop: list[str] | None, n_drafts: int | None = None,
                retrieval=None, knnlm=None, references: list[str] | None = None, turns: list[str] | None = None,
                llma_n: int | None = None, tenant: Tenant = ANONYMOUS) -> Job:  # fmt: skip
        """Tokenize, bound-check and route one request (raises the caller's 4xx errors).
        ``tenant``: who sent it (``serving.http.tenancy``; without keys, the one anonymous tenant)."""
        cfg, tok = self.cfg, self.pair.tokenizer
        if cluster is not None and not tenant.may_route:
            raise ForbiddenError("this API key may not choose its cluster: leave `cluster` out and the router "
                                 "decides (the server's route_tenants lists the tenants that may)", "cluster")  # fmt: skip
        limit = min(cfg.max_prompt_tokens, self.context_size - 1)  # the one limit enforced, and the one stated
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty: give at least one character", "prompt")
            if len(prompt) > limit * 32:  # refuse before tokenizing megabytes
                raise PromptTooLongError(f"prompt has {len(prompt)} characters; the limit is {limit} tokens",
                                         "prompt")  # fmt: skip
            try:
                ids = tok(prompt, add_special_tokens=False, verbose=False)["input_ids"]
            except (TypeError, ValueError) as exc:  # text the tokenizer refuses is the caller's to fix
                raise InvalidRequestError(f"prompt cannot be tokenized ({type(exc).__name__}): send valid "
                                          "Unicode text", "prompt") from None  # fmt: skip
            text = prompt
        else:
            ids, text = list(prompt), None
        if not ids and text is not None:
            raise InvalidRequestError("prompt tokenizes to nothing: give at least one token", "prompt")
        limits.check_prompt(ids, vocab_size=self.pair.vocab_size, context=self.context_size,
                            limit=cfg.max_prompt_tokens)  # fmt: skip
        if params.max_new_tokens > cfg.max_tokens_limit:
            raise InvalidRequestError(f"max_tokens is {params.max_new_tokens}; this server allows at most "
                                      f"{cfg.max_tokens_limit}", "max_tokens")  # fmt: skip
        if k is not None and k > cfg.max_k:
            raise InvalidRequestError(f"speculation.k is {k}; this server allows at most {cfg.max_k}", "speculation.k")
        if n_drafts is not None and n_drafts > cfg.max_n_drafts:
            raise InvalidRequestError(f"speculation.n_drafts is {n_drafts}; this server allows at most "
                                      f"{cfg.max_n_drafts}", "speculation.n_drafts")  # fmt: skip
        if knnlm is not None:
            _refuse_ignored("knnlm", "kNN-LM decodes with the target and its datastore alone and drafts nothing (its "
                            "own speculation is knnlm.speculative and knnlm.speculation_stride; knnlm.k counts its "
                            "neighbours)", method=method, k=k, n_drafts=n_drafts, llma_n=llma_n,
                            references=references)  # fmt: skip
            method = "target"
        elif retrieval is not None and retrieval.mode != "oneshot":
            _refuse_ignored(f"retrieval.mode {retrieval.mode!r}", "the retrieval loop drafts one chain per step with "
                            "the method's default settings (retrieval.mode 'oneshot' takes them)",
                            n_drafts=n_drafts, llma_n=llma_n)  # fmt: skip
        spec = method_spec(method or cfg.default_method)
        method, k = spec.name, k or min(spec.default_k, cfg.max_k)  # a default never exceeds the server's cap
        refs = self._references(references, turns if method in ("llma", "auto") else None, method)
        if llma_n is not None and method not in ("llma", "auto"):
            raise InvalidRequestError(f"speculation.n is LLMA's match length; method {method!r} has none",
                                      "speculation.n")  # fmt: skip
        source, router_version = "request", ""
        if cluster is not None:
            self.known_clusters.check(cluster)  # 400 naming `cluster` unless it exists
        else:
            cluster, source = cfg.default_cluster, "default"
            router = self.router.current() if self.router is not None else None
            if router is not None:
                decision = router.route(text if text is not None else tok.decode(ids))
                cluster, source, router_version = decision.cluster, "router", decision.router_version
        datastores = self.datastores
        check_resources(spec, ProposerResources(pair=self.pair, cluster=cluster, datastore=(
            datastores.current(cluster).datastore if datastores is not None else None)))  # fmt: skip
        ralm, kb, retriever = self._retrieval(retrieval, method)
        if ralm is not None and ralm.mode != "oneshot" and references:
            raise InvalidRequestError(f"retrieval.mode {ralm.mode!r} re-retrieves as it decodes and copies from its "
                                      "passages through the context; references go with retrieval.mode 'oneshot' "
                                      "or without retrieval", "references")  # fmt: skip
        knn_cfg, knn_store = self._knnlm(knnlm, retrieval)
        ROUTED.labels(cluster_label(cluster), source).inc()
        return Job(prompt_ids=ids, prompt_text=text or "", params=params, method=method, k=k, cluster=cluster,
                   cluster_source=source, router_version=router_version, stop=stop or [],
                   n_drafts=n_drafts or 0, ralm=ralm, kb=kb, retriever=retriever, knnlm=knn_cfg,
                   knnlm_store=knn_store, references=refs, llma_min_n=llma_n or 1, tenant=tenant.id)  # fmt: skip

    def _references(self, texts: list[str] | None, turns: list[str] | None, method: str) -> tuple[tuple[int, ...], ...]:
        """LLMA's references, tokenized: the request's texts, then the earlier chat turns
        (400 when the method does not copy, 413 beyond the server's limits, naming the field)."""
        cfg, tok = self.cfg, self.pair.tokenizer
        if texts and method not in ("llma", "auto"):
            raise InvalidRequestError(f"references are copied by speculation.method 'llma' or 'auto' only; method "
                                      f"{method!r} ignores them: set speculation.method to 'llma' or 'auto', or "
                                      "leave references out",
                                      "references")  # fmt: skip
        texts = list(texts or [])
        if len(texts) > cfg.max_references:
            raise RequestTooLargeError(f"references has {len(texts)} texts; this server allows at most "
                                       f"{cfg.max_references}", "references")  # fmt: skip
        budget, out = cfg.max_reference_tokens, []
        for i, text in enumerate(texts + [t for t in (turns or []) if t]):
            where = f"references[{i}]" if i < len(texts) else "messages"
            if i < len(texts) and not text:
                raise InvalidRequestError(f"{where} is empty: give some text or leave it out", where)
            if len(text) > budget * 32 + 32:  # refuse before tokenizing megabytes
                ids = None
            else:
                try:
                    ids = tok(text, add_special_tokens=False, verbose=False)["input_ids"]
                except (TypeError, ValueError) as exc:
                    raise InvalidRequestError(f"{where} cannot be tokenized ({type(exc).__name__}): send valid "
                                              "Unicode text", where) from None  # fmt: skip
            if ids is None or len(ids) > budget:
                if i >= len(texts):
                    break  # earlier turns beyond the budget are not copied from; the request is still served
                raise RequestTooLargeError(f"references hold more than {cfg.max_reference_tokens} tokens together "
                                           f"(at {where}); send fewer or shorter texts", "references")  # fmt: skip
            budget -= len(ids)
            out.append(tuple(ids))
        return tuple(out)

    def _knnlm(self, knnlm, retrieval):
        """The request's kNN-LM config and the datastore it names (4xx naming the field)."""
        if knnlm is None:
            return None, None
        from specops.serving.ralm.knnlm import KnnConfig

        if retrieval is not None:
            raise InvalidRequestError("send one of retrieval and knnlm, not both", "knnlm")
        cfg = KnnConfig(mode="speculative" if knnlm.speculative else "baseline", k=knnlm.k, lam=knnlm.lam,
                        speculation_stride=knnlm.speculation_stride)  # fmt: skip
        if self.knnlms is None:
            raise InvalidRequestError("knnlm: this server has no kNN-LM datastores", "knnlm.datastore")
        return cfg, self.knnlms.get(knnlm.datastore)

    def _retrieval(self, retrieval, method: str):
        """The request's retrieval loop: its config, the KB it names and the retriever (4xx naming the field)."""
        if retrieval is None:
            return None, None, ""
        from specops.serving.ralm.loop import RalmConfig

        if retrieval.mode != "oneshot" and (method_spec(method).default_n_drafts > 1
                                            or "datastore" in method_spec(method).needs):  # fmt: skip
            raise InvalidRequestError(f"speculation.method {method!r} drafts from the cluster's datastore, which the "
                                      "retrieval loop does not support yet; use draft, pld, llma or target",
                                      "speculation.method")  # fmt: skip
        ralm = RalmConfig(mode=retrieval.mode, interval=retrieval.stride, query_tokens=retrieval.query_tokens,
                          speculation_stride=retrieval.speculation_stride, prefetch=retrieval.prefetch,
                          asynchronous=retrieval.asynchronous, speculation_off=retrieval.speculation_off,
                          passages=retrieval.passages)  # fmt: skip
        if self.kbs is None:
            raise InvalidRequestError("retrieval: this server has no knowledge bases", "retrieval.kb")
        kb = self.kbs.get(retrieval.kb)
        if retrieval.retriever not in kb.artifact.retrievers:
            raise InvalidRequestError(f"retrieval.retriever {retrieval.retriever!r} is not built for knowledge base "
                                      f"{retrieval.kb!r} (built: {', '.join(kb.artifact.retrievers)})",
                                      "retrieval.retriever")  # fmt: skip
        return ralm, kb, retriever_kind(retrieval)

    def abandon(self, job: Job) -> RequestTimeoutError:
        """The API's backstop for a decode that outlived ``request_timeout_s`` inside one step
        (the worker checks the deadline only between steps): mark ``job`` cancelled, so its
        worker stops at its next step if it ever reaches one, and return the 504 to answer now.
        The worker's admission slot comes back only when it returns."""
        job.abandoned = True
        job.cancel.set()
        CANCELLED.labels("timeout").inc()
        log.warning("request %s is still decoding after request_timeout_s=%gs within one step; answered with the "
                    "timeout", job.request_id, self.cfg.request_timeout_s)  # fmt: skip
        return RequestTimeoutError(f"request decoded for more than {self.cfg.request_timeout_s:g}s")

    def run(self, job: Job):
        """Decode ``job`` on this (worker) thread; always gives the admission slot back."""
        try:
            return self._run(job)
        finally:
            self.admission.release()

    def _run(self, job: Job):
        tok = self.pair.tokenizer
        deadline = time.monotonic() + self.cfg.request_timeout_s

        def on_step(emitted: list[int]) -> bool:
            if job.cancel.is_set():
                if not job.abandoned:  # (an abandoned request was counted as a timeout)
                    CANCELLED.labels("client_gone").inc()
                raise ClientGone(job.request_id)
            if time.monotonic() > deadline:
                CANCELLED.labels("timeout").inc()
                raise RequestTimeoutError(f"request decoded for more than {self.cfg.request_timeout_s:g}s")
            job.output_ids.extend(emitted)
            if job.on_delta is None and not job.stop:
                return False  # nothing to stream or stop on: the text is decoded once, at the end
            text = tok.decode(job.output_ids, skip_special_tokens=True)
            stop_at = _find_stop(text, job.stop)
            if stop_at is not None:
                job.text, job.stopped = text[:stop_at], True
            else:
                job.text = text[: len(text) - _held_back(text, job.stop)]
            if job.on_delta is not None and len(job.text) > job.sent:
                job.on_delta(job.text[job.sent:])
                job.sent = len(job.text)
            return job.stopped

        if job.knnlm is not None:
            served = self.node.generate_knnlm(job.prompt_ids, job.params, store=job.knnlm_store, knn=job.knnlm,
                                              cluster=job.cluster, request_id=job.request_id, on_step=on_step)  # fmt: skip
            block = served.retrieval
            KNNLM_REQUESTS.labels(block["searcher"], block["mode"]).inc()
            KNNLM_SEARCHES.labels(block["searcher"], block["mode"]).inc(block["kb_searches"])
            KNNLM_TOKENS.labels(block["searcher"], block["mode"]).inc(block["tokens"])
        elif job.ralm is not None and job.ralm.mode == "oneshot":
            served = self.node.generate_oneshot(job.prompt_ids, job.params, kb=job.kb, retriever=job.retriever,
                                                ralm=job.ralm, cluster=job.cluster, method=job.method, k=job.k,
                                                n_drafts=job.n_drafts, request_id=job.request_id, on_step=on_step,
                                                references=job.references, llma_min_n=job.llma_min_n,
                                                session_scope=self._session_scope(job))  # fmt: skip
            _count_retrieval(served.retrieval)
        elif job.ralm is not None:
            served = self.node.generate_ralm(job.prompt_ids, job.params, kb=job.kb, retriever=job.retriever, ralm=job.ralm,
                                             cluster=job.cluster, method=job.method, k=job.k, request_id=job.request_id,
                                             on_step=on_step, pool=self.ralm_pool)  # fmt: skip
            _count_retrieval(served.retrieval)
        else:
            served = self.node.generate(job.prompt_ids, job.params, cluster=job.cluster, method=job.method, k=job.k,
                                        n_drafts=job.n_drafts, request_id=job.request_id, on_step=on_step,
                                        references=job.references, llma_min_n=job.llma_min_n,
                                        session_scope=self._session_scope(job))  # fmt: skip
        if not job.stopped:  # the whole output, the held-back tail included
            job.text = tok.decode(served.result.token_ids, skip_special_tokens=True)
            if job.on_delta is not None and len(job.text) > job.sent:
                job.on_delta(job.text[job.sent:])
                job.sent = len(job.text)
        st = served.result.stats
        GENERATED.labels(cluster_label(job.cluster)).inc(st.num_generated)
        if st.method == "llma" and st.proposer:
            _count_llma(job.cluster, st.proposer)
        if self.node.sessions is not None:
            held = self.node.sessions.stats().get(job.cluster)  # every tenant's together: no tenant label
            if held is not None:
                SESSION_CACHE_TOKENS.labels(cluster_label(job.cluster)).set(held["tokens"])
                SESSION_CACHE_OUTPUTS.labels(cluster_label(job.cluster)).set(held["outputs"])
        if st.method == "auto":
            self._count_auto(job.cluster, served)
        elif st.num_drafted:
            version = served.version_of(st.method) or "none"
            DRAFTED.labels(cluster_label(job.cluster), st.method, version).inc(st.num_drafted)
            ACCEPTED.labels(cluster_label(job.cluster), st.method, version).inc(st.num_accepted)
        with self._recent_lock:
            self._recent.append((time.time(), st.num_generated))
        return served


    def _session_scope(self, job: Job) -> str:
        """Whose past outputs the job copies from and adds to: its tenant's, or with
        ``session_sharing = "shared"`` the cluster's shared scope (``""``)."""
        return job.tenant if self.cfg.session_sharing == "tenant" else ""

    def _count_auto(self, cluster: str, served) -> None:
        """An ``auto`` request's steps and drafts per chosen method, and the policy's gauges."""
        label = cluster_label(cluster)
        per = served.result.stats.policy.get("methods", {})
        for method, n in per.items():
            AUTO_STEPS.labels(label, method).inc(n["steps"])
            if n["drafted"]:
                version = served.version_of(method) or "none"
                DRAFTED.labels(label, method, version).inc(n["drafted"])
                ACCEPTED.labels(label, method, version).inc(n["accepted"])
        try:  # the gauges wait briefly for the policy's lock, the response does not wait on them
            snap = self.policy.snapshot(cluster, timeout_s=1.0) if self.policy is not None else {}
        except UnavailableError:
            snap = {}
        state = snap.get("clusters", {}).get(cluster, {})
        for method, speed in ((state.get("last") or {}).get("estimates") or {}).items():
            AUTO_ESTIMATE.labels(label, method).set(speed)
        for name, est in state.get("acceptance", {}).items():
            key, temp = name.rsplit("/", 1)
            AUTO_ACCEPTANCE.labels(label, key, temp).set(est["mean"])
        for load, fit in snap.get("verify_ms", {}).items():
            AUTO_VERIFY_MS.labels(load, "a").set(fit["a_ms"])
            AUTO_VERIFY_MS.labels(load, "b").set(fit["b_ms"])


def _refuse_ignored(path: str, why: str, *, method: str | None = None, k: int | None = None,
                    n_drafts: int | None = None, llma_n: int | None = None, references: list[str] | None = None) -> None:
    """A 400 naming the first field ``path`` (kNN-LM, a retrieval loop) would silently ignore; ``why`` says why."""
    given = {"speculation.method": method not in (None, "target"), "speculation.k": k is not None,
             "speculation.n_drafts": n_drafts is not None, "speculation.n": llma_n is not None,
             "references": bool(references)}  # fmt: skip
    for name, sent in given.items():
        if sent:
            raise InvalidRequestError(f"{name} does not apply to {path}: {why}; leave {name} out", name)


def retriever_kind(retrieval) -> str:
    return retrieval.retriever


def _count_llma(cluster: str, counters: dict[str, int]) -> None:
    from specops.serving.proposers.llma import SOURCES

    label = cluster_label(cluster)
    LLMA_STEPS.labels(label).inc(counters["steps"])
    LLMA_REFERENCE_TOKENS.labels(label).inc(counters["reference_tokens"])
    for source in SOURCES:
        LLMA_HITS.labels(label, source).inc(counters[f"hits_{source}"])


def _count_retrieval(block: dict | None) -> None:
    """Per-retriever metrics of one retrieval-loop request."""
    if not block:
        return
    labels = (block["retriever"], block["mode"])
    RALM_REQUESTS.labels(*labels).inc()
    RALM_KB_QUERIES.labels(*labels).inc(block["kb_queries"])
    RALM_KB_CALLS.labels(*labels).inc(block["kb_calls"])
    RALM_SPECULATIONS.labels(*labels).inc(block["speculations"])
    RALM_MISMATCHES.labels(*labels).inc(block["mismatches"])
    t = block["time_s"]
    RALM_SECONDS.labels(*labels, "retrieval").inc(t["embed"] + t["cache"] + t["kb_wait"])
    RALM_SECONDS.labels(*labels, "generate").inc(t["generate"])
    RALM_SECONDS.labels(*labels, "async_overlap").inc(t["async_overlap"])


def _find_stop(text: str, stops: list[str]) -> int | None:
    """Index where the earliest stop sequence starts in ``text``, if any."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` not to stream yet: an incomplete UTF-8 character
    (decoded as U+FFFD) or a prefix of a stop sequence that the next tokens may complete."""
    hold = 1 if text.endswith("\ufffd") else 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return hold
