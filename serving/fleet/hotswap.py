"""Hot-swap: each cluster's draft slot follows the registry alias ``champion``.

:class:`DraftFollower` is the ``draft`` kind's :class:`~specops.serving.fleet.follower.AliasFollower`
(one worker thread, polling and events, backoff). One check of a cluster is:

1. **resolve** ``draft-<cluster>@champion`` in the registry (on a timer every
   ``poll_s``, and at once when a ModelEvent for the model arrives);
2. if it names a version the slot does not hold, **fetch** it into the cache directory
   and verify every checksum (``RegistryStore.fetch``);
3. **validate** it: the tokenizer hash equals the target's, the weights load from
   safetensors with no missing, unexpected or mis-shaped tensors, the vocabulary equals
   the target's, and one forward pass gives finite logits of the right shape;
4. **swap**: one reference assignment in the slot. A request takes the slot's handle
   once, when it starts, and decodes every step with that handle, so requests in flight
   finish on the version they started with and the next request gets the new one.

All of this runs on the follower's worker thread; a request never waits for it. A
registry outage or a refused artifact leaves the current version serving; it is logged,
counted (``specops_hotswap_failures_total``) and retried with exponential backoff.

**Live feedback.** :meth:`DraftFollower.record` counts drafted and accepted tokens per
version served. Every ``live_report_every`` requests the version's live acceptance goes
to the registry (metric ``live_acceptance``). When the champion has served
``rollback_min_requests`` requests and its live acceptance is below the version it
replaced by more than ``rollback_margin``, the follower rolls ``champion`` back, with the
numbers as the reason, and swaps to the restored version.

**Which clusters exist.** The follower also lists the clusters with a champion draft
(:attr:`DraftFollower.champions`: one registry search at start, every ``poll_s``, and when a
ModelEvent names a draft it does not know); a request may name those (``specops.serving.fleet.clusters``).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from prometheus_client import Counter, Gauge
from transformers import PreTrainedModel

from specops.core.clusters import cluster_label
from specops.core.errors import ModelConfigError
from specops.core.models import has_weights, load_model, load_tokenizer, tokenizer_hash
from specops.registry import (
    CHAMPION,
    KINDS,
    ArtifactIntegrityError,
    ArtifactVersion,
    RegistryError,
    RegistryStore,
)
from specops.serving.engine.types import RequestStats
from specops.serving.fleet.follower import AliasFollower, FollowConfig, LiveStats

log = logging.getLogger(__name__)

SWAPS = Counter("specops_hotswap_swaps_total", "Draft versions swapped into a cluster slot", ["cluster"])
FAILURES = Counter(
    "specops_hotswap_failures_total", "Failed follow attempts (the current version kept serving)", ["cluster", "reason"]
)
ROLLBACKS = Counter("specops_hotswap_auto_rollbacks_total", "Champions rolled back on live acceptance", ["cluster"])
LIVE_ACCEPTANCE = Gauge(
    "specops_live_acceptance", "Live acceptance rate per draft version served", ["cluster", "version"]
)
SERVED_VERSION = Gauge(
    "specops_draft_version_served", "1 for the version each cluster slot serves now", ["cluster", "version"]
)

BASE = "base"
"""Version name of the base draft a slot serves before the cluster has a champion."""
LIST = "list:"
"""Worker item: list the clusters with a registered champion draft (``DraftFollower.champions``)."""


@dataclass(frozen=True)
class DraftHandle:
    """One loaded draft version. Immutable: a request keeps its handle until it finishes."""

    cluster: str
    version: str
    model: PreTrainedModel
    previous_champion: str = ""
    """The version this one replaced as champion (the auto-rollback's comparison)."""
    loaded_at: float = field(default_factory=time.time)
    backend: object | None = None
    """What serves this version outside the process, if anything (``specops.serving.vllm``: the vLLM server)."""

    @property
    def model_name(self) -> str:
        return KINDS["draft"].model_name(self.cluster)


class DraftSlot:
    """The draft a cluster serves now. ``current()`` and ``swap()`` are atomic."""

    def __init__(self, handle: DraftHandle) -> None:
        self._handle = handle
        self._lock = threading.Lock()
        self.swapped_at = 0.0
        self.history: list[tuple[float, str]] = [(0.0, handle.version)]
        """(wall time just before the swap, version) of every version the slot held."""

    def current(self) -> DraftHandle:
        return self._handle  # one reference read: atomic under the GIL

    def swap(self, handle: DraftHandle) -> DraftHandle:
        with self._lock:
            now = time.time()
            old, self._handle = self._handle, handle
            self.swapped_at = now
            self.history.append((now, handle.version))
        label = cluster_label(handle.cluster)
        SERVED_VERSION.labels(label, old.version).set(0)
        SERVED_VERSION.labels(label, handle.version).set(1)
        return old


@dataclass
class HotSwapConfig:
    """How serving follows the registry."""

    poll_s: float = 10.0
    """Seconds between registry polls of every cluster's champion (events trigger one at once)."""
    backoff_initial_s: float = 1.0
    """First retry delay after a failed fetch or an unreachable registry; doubles per failure."""
    backoff_max_s: float = 60.0
    live_report_every: int = 50
    """Requests served on a version between reports of its live acceptance to the registry."""
    replica: str = ""
    """This replica's name: it reports the version it serves per cluster, and the last it refused,
    on the registered model (``served_by.<replica>``; ``specops registry ls`` shows them). Empty: no report."""
    auto_rollback: bool = True
    rollback_min_requests: int = 200
    """M: requests the champion must have served before its live acceptance is judged."""
    rollback_margin: float = 0.05
    """Roll back when live acceptance < the replaced version's - this margin."""
    validate_tokens: int = 8
    """Tokens of the smoke forward run on each fetched draft."""

    def __post_init__(self) -> None:
        if self.poll_s <= 0 or not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("need poll_s > 0 and 0 < backoff_initial_s <= backoff_max_s")
        if self.live_report_every < 1 or self.rollback_min_requests < 1 or self.rollback_margin < 0:
            raise ValueError("live_report_every and rollback_min_requests must be >= 1, rollback_margin >= 0")


class DraftFollower(AliasFollower):
    """Keeps one :class:`DraftSlot` per cluster on the registry's champion."""

    def __init__(
        self,
        registry: RegistryStore | None,
        base_draft: PreTrainedModel,
        *,
        target_vocab: int,
        target_tokenizer_sha256: str,
        cache_dir: Path,
        cfg: HotSwapConfig | None = None,
    ) -> None:
        self.cfg = cfg or HotSwapConfig()
        super().__init__(
            registry, "draft", FollowConfig(self.cfg.poll_s, self.cfg.backoff_initial_s, self.cfg.backoff_max_s)
        )
        self.base_draft = base_draft
        self.target_vocab = target_vocab
        self.target_tokenizer_sha256 = target_tokenizer_sha256
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.slots: dict[str, DraftSlot] = {}
        self.live: dict[tuple[str, str], LiveStats] = {}
        self.swaps: list[dict] = []
        """Every swap: cluster, from, to, at (wall time), load_s; for tests and benchmarks."""
        self._judged: set[tuple[str, str]] = set()
        self._reported: dict[str, tuple[str, str]] = {}
        """Per cluster: the last (serving, refused) reported (``_report`` writes only changes)."""
        self.base_backend: object | None = None
        """The base draft's outside server (``specops.serving.vllm``), given to every new slot."""
        self.on_swap: list = []
        """Called after every swap as ``fn(cluster, version)`` (the registry's ``ArtifactVersion``
        now serving): the serving node re-seeds ``auto``'s estimates of the draft there. A
        listener that raises is logged; the swap stands."""
        self.champions: frozenset[str] = frozenset()
        """Clusters with a registered champion draft, as last listed (every ``poll_s``, and when a
        ModelEvent names a draft not in it): clusters that exist (``specops.serving.fleet.clusters``)."""

    def start(self) -> DraftFollower:
        super().start()
        if self.registry is not None:
            self.list_champions()  # at once: a request for a cluster with a champion is served from the start
            self._schedule_list()
        return self

    def list_champions(self) -> frozenset[str]:
        """List the clusters with a champion draft now (one registry search); on failure keep the last list."""
        if self.registry is None:
            return self.champions
        try:
            self.champions = frozenset(self.registry.artifact("draft").keys(alias=CHAMPION))
        except RegistryError as exc:  # the next listing retries; the last list stands meanwhile
            log.warning("could not list the clusters with a champion draft: %s", exc)
        return self.champions

    def _schedule_list(self) -> None:
        if not self._stop.is_set():
            timer = threading.Timer(self.follow_cfg.poll_s, self.enqueue, args=(LIST,))
            timer.daemon = True
            timer.start()

    # ------------------------------------------------------------ request path
    def slot(self, cluster: str) -> DraftSlot:
        """The cluster's slot; a new cluster starts on the base draft and is checked at once."""
        slot = self.slots.get(cluster)
        if slot is None:
            with self._lock:
                slot = self.slots.get(cluster)
                if slot is None:
                    slot = self.slots[cluster] = DraftSlot(
                        DraftHandle(cluster, BASE, self.base_draft, backend=self.base_backend)
                    )
                    SERVED_VERSION.labels(cluster_label(cluster), BASE).set(1)
        if cluster not in self.keys:  # new, or no longer followed while it was not a cluster
            self.follow(cluster)
        return slot

    def record(self, handle: DraftHandle, stats: RequestStats, requests: int = 1) -> None:
        """Count one finished request on the version it used (cheap; the registry work is queued);
        ``requests``: how many requests ``stats`` sums (an engine that reports per interval: vLLM)."""
        key = (handle.cluster, handle.version)
        with self._lock:
            live = self.live.setdefault(key, LiveStats())
            live.requests += requests
            live.drafted += stats.num_drafted
            live.accepted += stats.num_accepted
            due = live.requests - live.reported_at >= self.cfg.live_report_every
            judge = (
                self.cfg.auto_rollback
                and handle.version != BASE
                and live.requests >= self.cfg.rollback_min_requests
                and key not in self._judged
            )
        LIVE_ACCEPTANCE.labels(cluster_label(handle.cluster), handle.version).set(live.acceptance)
        if due or judge:
            self.enqueue(f"live:{handle.cluster}:{handle.version}")

    # ------------------------------------------------------------ the follower's steps
    def handle(self, item: str) -> bool:
        if item == LIST:
            self.list_champions()
            self._schedule_list()
            return True
        if not item.startswith("live:"):
            return False
        _, cluster, version = item.split(":", 2)
        self._live(cluster, version)
        return True

    def serving_version(self, key: str) -> str | None:
        slot = self.slots.get(key)
        return slot.current().version if slot is not None else None

    def on_event(self, event) -> None:
        """A ModelEvent: check that cluster now, if this replica serves it (others load on first use)."""
        key = self.kind.key_of(getattr(event, "model_name", "") or "")
        if key is not None and key in self.slots:
            self.request_check(key)
        if key is not None and key not in self.champions:
            self.enqueue(LIST)  # maybe a new cluster's first champion: it exists from now on

    def load(self, key: str, version) -> PreTrainedModel:
        return self._load(version)

    def install(self, key: str, version, obj, load_s: float) -> None:
        slot = self.slots[key]
        old = slot.swap(self.new_handle(key, version, obj))  # 4.
        self._report(key, version.version)
        SWAPS.labels(cluster_label(key)).inc()
        self.swaps.append(
            {"cluster": key, "from": old.version, "to": version.version, "at": time.time(), "load_s": load_s}
        )
        log.info(
            "cluster %s: swapped draft %s -> %s (fetched and validated in %.2fs)",
            key,
            old.version,
            version.version,
            load_s,
        )
        for fn in list(self.on_swap):
            try:
                fn(key, version)
            except Exception:  # a listener must never undo or fail a swap
                log.exception("cluster %s: a swap listener failed after the swap to %s", key, version.version)

    def new_handle(self, key: str, version, obj) -> DraftHandle:
        """The handle of a loaded version (``obj``: what :meth:`load` returned)."""
        return DraftHandle(key, version.version, obj, previous_champion=version.tags.get("previous_champion", ""))

    def failed(self, key: str, exc: Exception, reason: str, retry_in: float | None) -> None:
        FAILURES.labels(cluster_label(key), reason).inc()
        if isinstance(exc, (ModelConfigError, ArtifactIntegrityError)):  # the version is at fault, not the registry
            refused = getattr(exc, "refused_version", "")
            self._report(key, self.serving_version(key), f"{refused}: {exc}" if refused else str(exc))
        log.warning(
            "cluster %s keeps draft version %s: %s (%s); retrying in %.1fs",
            key,
            self.serving_version(key),
            exc,
            reason,
            retry_in or 0.0,
        )

    def _report(self, key: str, serving: str, refused: str = "") -> None:
        """Tell the registry what this replica serves of ``key`` (``HotSwapConfig.replica``); a
        report that fails is logged and dropped: it never holds up or undoes a swap."""
        if not self.cfg.replica or self.registry is None:
            return
        if self._reported.get(key) == (serving, refused):
            return
        try:
            self.registry.artifact("draft").report_served(key, self.cfg.replica, serving, refused)
            self._reported[key] = (serving, refused)
        except Exception as exc:  # noqa: BLE001 (a report is best effort)
            log.warning("cluster %s: could not report the served version %s to the registry: %s", key, serving, exc)

    def _load(self, dv: ArtifactVersion) -> PreTrainedModel:
        """Fetch, verify and validate one version; raises on anything wrong (naming the version)."""
        try:
            return self._fetch_and_validate(dv)
        except Exception as exc:
            exc.refused_version = dv.version  # type: ignore[attr-defined] (``failed`` reports it)
            raise

    def _fetch_and_validate(self, dv: ArtifactVersion) -> PreTrainedModel:
        if dv.tokenizer_sha256 and dv.tokenizer_sha256 != self.target_tokenizer_sha256:
            raise ModelConfigError(
                f"{dv.name} version {dv.version} was trained with tokenizer "
                f"{dv.tokenizer_sha256[:12]}, serving's target uses "
                f"{self.target_tokenizer_sha256[:12]}"
            )
        dest = self.cache_dir / dv.cluster / f"v{dv.version}"
        self.registry.artifact("draft").fetch(dv, dest)  # checksums  # type: ignore[union-attr]
        try:
            return self._validate(dv, dest)
        except Exception:
            shutil.rmtree(dest, ignore_errors=True)
            raise

    def _validate(self, dv: ArtifactVersion, path: Path) -> PreTrainedModel:
        served_here = has_weights(self.base_draft)  # else a config-only draft: vLLM serves it (on the CPU here)
        return validate_draft(
            path,
            f"{dv.name} version {dv.version}",
            target_tokenizer_sha256=self.target_tokenizer_sha256,
            target_vocab=self.target_vocab,
            dtype=self.base_draft.dtype,  # served as the base draft is
            device=self.base_draft.device if served_here else "cpu",
            prepare=served_here,  # not decoded here: a smoke forward only
            validate_tokens=self.cfg.validate_tokens,
        )

    # ------------------------------------------------------------ live feedback
    def _live(self, cluster: str, version: str) -> None:
        key = (cluster, version)
        with self._lock:
            live = self.live[key]
            snapshot = LiveStats(live.requests, live.drafted, live.accepted)
        if self.registry is None or version == BASE:
            return
        if snapshot.requests - live.reported_at >= self.cfg.live_report_every:
            try:
                drafts = self.registry.artifact("draft")
                drafts.log_metric(cluster, version, "live_acceptance", snapshot.acceptance, step=snapshot.requests)
                drafts.log_metric(cluster, version, "live_requests", snapshot.requests, step=snapshot.requests)
                live.reported_at = snapshot.requests
            except RegistryError as exc:
                FAILURES.labels(cluster_label(cluster), "live_report").inc()
                log.warning("could not report live acceptance of draft-%s version %s: %s", cluster, version, exc)
        self._maybe_rollback(cluster, version, snapshot)

    def _maybe_rollback(self, cluster: str, version: str, live: LiveStats) -> None:
        cfg = self.cfg
        handle = self.slots[cluster].current()
        if not cfg.auto_rollback or handle.version != version or live.requests < cfg.rollback_min_requests:
            return
        if (cluster, version) in self._judged or not handle.previous_champion:
            return
        prev = handle.previous_champion
        reference = self._reference_acceptance(cluster, prev)
        if reference is None:
            return  # nothing to compare with yet: judge again after more requests
        self._judged.add((cluster, version))
        if live.acceptance >= reference - cfg.rollback_margin:
            log.info(
                "cluster %s: champion %s holds live acceptance %.3f (version %s: %.3f) over %d requests",
                cluster,
                version,
                live.acceptance,
                prev,
                reference,
                live.requests,
            )
            return
        reason = (
            f"auto-rollback: live acceptance {live.acceptance:.3f} over {live.requests} requests < version "
            f"{prev}'s {reference:.3f} - margin {cfg.rollback_margin}"
        )
        try:
            change = self.registry.artifact("draft").rollback(  # type: ignore[union-attr]
                cluster, reason=reason, to=prev, expect_current=version
            )
        except RegistryError as exc:
            self._judged.discard((cluster, version))  # try again on the next report
            FAILURES.labels(cluster_label(cluster), "rollback").inc()
            log.warning("cluster %s: wanted to roll back %s but: %s", cluster, version, exc)
            return
        if change is not None:
            ROLLBACKS.labels(cluster_label(cluster)).inc()
            self.request_check(cluster)

    def _reference_acceptance(self, cluster: str, version: str) -> float | None:
        """The replaced version's live acceptance: as this replica measured it, else the registry's."""
        with self._lock:
            mine = self.live.get((cluster, version))
        if mine is not None and mine.requests >= self.cfg.rollback_min_requests:
            return mine.acceptance
        try:
            dv = self.registry.artifact("draft").get(cluster, version)  # type: ignore[union-attr]
        except RegistryError:
            return None
        requests, acceptance = dv.metric("live_requests"), dv.metric("live_acceptance")
        if requests is None or acceptance is None or requests < self.cfg.rollback_min_requests:
            return None
        return acceptance


def validate_draft(
    path: Path,
    label: str,
    *,
    target_tokenizer_sha256: str,
    target_vocab: int,
    dtype=torch.float32,
    device="cpu",
    prepare: bool = False,
    validate_tokens: int = 8,
) -> PreTrainedModel:
    """The checks a draft version passes before serving swaps it in (``label`` names it in the
    errors), also run by ``specops registry promote`` before it moves the alias: the target's
    tokenizer, every tensor's shape (named), no missing or unexpected weights, the target's
    vocabulary, and a smoke forward with finite logits of the right shape. Returns the model."""
    got = tokenizer_hash(load_tokenizer(path))
    if got != target_tokenizer_sha256:
        raise ModelConfigError(
            f"{label}: its tokenizer (sha256 {got[:12]}) is not the target's ({target_tokenizer_sha256[:12]})"
        )
    try:
        model, info = load_model(path, dtype=dtype, device=device, loading_info=True, prepare=prepare)
    except ModelConfigError as exc:
        raise ModelConfigError(f"{label}: {exc}") from None
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise ModelConfigError(f"{label}: weights do not fit its config: {bad}")
    if int(model.config.vocab_size) != target_vocab:
        raise ModelConfigError(f"{label} has vocabulary {model.config.vocab_size}, the target {target_vocab}")
    for name, tensor in model.state_dict().items():  # a NaN in one weight need not reach a short smoke forward
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ModelConfigError(f"{label}: tensor {name} holds non-finite values (NaN or infinity)")
    n = validate_tokens
    with torch.no_grad():
        ids = torch.arange(n, device=model.device).remainder(target_vocab)[None]  # [1, n]
        logits = model(input_ids=ids).logits  # [1, n, vocab]
    if tuple(logits.shape) != (1, n, target_vocab) or not torch.isfinite(logits).all():
        raise ModelConfigError(f"{label}: smoke forward gave {tuple(logits.shape)} logits or non-finite values")
    return model
