"""Register each trained draft in the registry and run the promotion gate.

For one cluster after an update (:meth:`Promoter.publish`), top to bottom:

1. **register** the checkpoint as a new version of ``draft-<cluster>`` with alias
   ``challenger``: weights, config and tokenizer; offline acceptance (sampling and
   greedy) on the held-out records; tokenizer hash, config hash, parent version and
   lineage (topic, partitions, offset range) as tags. Registration is idempotent: the
   checkpoint's ``source_id`` (trainer id / cluster / checkpoint version) is looked up
   first, so a trainer that crashed between checkpoint and commit re-registers nothing.
2. **gate**: take the cluster's most recent held-out records (:func:`gate_window`: the
   newest ``window`` requests, none older than ``window_s``), so that candidates are judged
   on the traffic the cluster gets now and a draft that followed a drift is not scored on
   the domain the traffic left; evaluate the champion (or, before the first promotion, the
   base draft) on the *same* records as the candidate. With metric ``served`` the evidence
   also takes the cluster's newest ``fresh`` *training* requests, each scored by the learning
   draft just before it trained on them (test-then-train, :class:`Fresh`), paired with the
   champion on the same request: ten times the held-out traffic, so a draft that follows a
   drift is promoted within tens of requests rather than hundreds. Promote iff the candidate
   wins by ``margin`` on at least ``min_positions`` positions, by more than noise, and (with
   fresh evidence) is not worse beyond noise on the held-out requests of the period the fresh
   ones cover; write the decision and both numbers on
   the candidate. ``served``
   is greedy agreement at every output position of held-out greedy requests, paired
   request by request; the rejected-position metrics (``sampling``, ``greedy``) are
   biased towards any draft other than the one that served (``specops.trainer.acceptance``). A promotion moves ``champion`` and is announced on
   ``spec.events`` by the registry's ``on_change`` hook.
3. **retain**: archive old, unaliased versions beyond the newest ``keep_versions``.

The trainer commits consumer offsets only after this returned, so a record is committed
only once the draft trained on it is registered.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from prometheus_client import Counter
from transformers import AutoModelForCausalLM

from specops.core import draft_vocab
from specops.core.clusters import cluster_label
from specops.core.draft_vocab import DraftVocab
from specops.core.models import from_pretrained, load_tokenizer, tokenizer_hash
from specops.registry import (
    CHAMPION,
    ArtifactVersion,
    GateResult,
    RegistryStore,
    decide,
)
from specops.streams.records import MissRecord
from specops.trainer.acceptance import Acceptance, evaluate_records, paired_gain

log = logging.getLogger(__name__)

GATE_METRICS = ("served", "sampling", "greedy")
WINDOW = 16
"""The gate's default window of held-out requests (:attr:`PromoteConfig.window`)."""
FRESH = 32
"""The gate's default number of fresh (test-then-train) requests (:attr:`PromoteConfig.fresh`)."""
GATE_DECISIONS = Counter(
    "specops_trainer_gate_decisions_total",
    "Promotion gate decisions on registered drafts (decision: promoted or rejected)",
    ["cluster", "decision"],
)


@dataclass
class PromoteConfig:
    """How the trainer registers and promotes drafts."""

    margin: float = 0.005
    """The candidate must beat the champion's held-out acceptance by at least this much. A
    negative margin tolerates a candidate that is at most that much worse (prefer fresh
    drafts); -1 promotes every candidate that has ``min_positions`` of evidence."""
    metric: str = "served"
    """What the gate compares: ``served`` (greedy agreement at every output position of
    held-out greedy requests, paired per request, and the win must exceed z standard
    errors; falls back to ``sampling`` when no held-out request is greedy), or the
    rejected-position estimates ``sampling`` and ``greedy``."""
    z: float = 1.645
    """``served``: the win must exceed this many standard errors of the paired difference."""
    min_positions: int = 32
    """Held-out rejected positions needed before the gate decides anything."""
    window: int = WINDOW
    """The gate judges on the cluster's newest ``window`` held-out requests (0: every one the
    trainer keeps, ``OnlineConfig.holdout_capacity``). With one request in ten held out, 16 span
    the last ~160 requests, so after a drift the window is mostly the new traffic within ~80.
    Chosen on ``benchmarks/osd.py``'s shift run (sql -> math -> sql, docs/trainer.md#the-gate-window):
    16 adapted to math in 170 requests where 32 took 243 and the whole held-out set 282, and
    on steady traffic every window ended level (``benchmarks/out/osd_window_main.json``)."""
    fresh: int = FRESH
    """``served``: the gate also pairs the learner and the champion on the cluster's newest
    ``fresh`` training requests, each scored by the draft as it was just before it trained on
    them (so never on a request it had trained on), only those scored by a draft newer than the
    champion (0: held-out requests only). The learner that scored them is this candidate or one
    of its recent predecessors, so this is evidence about the learning draft; the candidate
    itself must also not be worse beyond noise on the held-out requests of the same period. Chosen on
    ``benchmarks/osd.py``'s shift run (docs/trainer.md#fresh-evidence)."""
    window_s: float = 0.0
    """Also leave out held-out requests logged more than this many seconds ago (0: no age
    limit). For clusters whose traffic is steady enough that a time window means a number of
    requests; a quiet cluster then gets no decision until fresh held-out traffic comes."""
    register_every: int = 1
    """Register every N-th update of a cluster (1 = every update)."""
    keep_versions: int = 20
    """Retention: archive unaliased versions beyond the newest N (0 = keep everything)."""

    def __post_init__(self) -> None:
        if self.metric not in GATE_METRICS:
            raise ValueError(f"metric must be one of {GATE_METRICS}, got {self.metric!r}")
        if (
            not -1.0 <= self.margin <= 1.0
            or self.min_positions < 0
            or self.register_every < 1
            or self.keep_versions < 0
        ):
            raise ValueError("need -1 <= margin <= 1, min_positions >= 0, register_every >= 1, keep_versions >= 0")
        if not self.z >= 0:
            raise ValueError(f"z must be >= 0, got {self.z!r}")
        if self.window < 0 or not self.window_s >= 0 or self.fresh < 0:
            raise ValueError(
                f"need window >= 0, window_s >= 0 and fresh >= 0, got {self.window!r}, {self.window_s!r} and "
                f"{self.fresh!r}"
            )


@dataclass(frozen=True)
class Fresh:
    """A training request scored by the learning draft just before it trained on it."""

    record: MissRecord
    learner_version: int
    """The cluster's checkpoint version that scored it (its weights had not seen the request)."""
    agree: int
    """Output positions where that draft's argmax is the target's token."""
    positions: int
    """Output positions of the request."""


def score_fresh(model: torch.nn.Module, records, learner_version: int, vocab: DraftVocab | None) -> list[Fresh]:
    """Score ``records`` (not yet trained on) with the learner as it is now: the greedy ones
    only (``served`` agreement needs the target's own greedy output)."""
    out = []
    for rec in records:
        acc = evaluate_records(model, [rec], vocab=vocab)
        if acc.per_request:
            agree, n = acc.per_request[0]
            out.append(Fresh(rec, learner_version, agree, n))
    return out


def fresh_window(fresh, cfg: PromoteConfig, champion_version: int, now: float | None = None) -> list[Fresh]:
    """The fresh requests the gate pairs: the newest ``cfg.fresh`` scored by a learner newer
    than the champion (checkpoint ``champion_version``; 0 = the base draft), none older than
    ``cfg.window_s``. Requests scored by the champion itself would pair a draft with itself."""
    if not cfg.fresh or cfg.metric != "served":
        return []
    newer = [f for f in fresh if f.learner_version > champion_version]
    if cfg.window_s:
        cutoff = (time.time() if now is None else now) - cfg.window_s
        newer = [f for f in newer if f.record.timestamp >= cutoff]
    return newer[-cfg.fresh :]


def reference_pairs(
    model: torch.nn.Module, fresh: list[Fresh], vocab: DraftVocab | None, cache: dict
) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(learner, reference) served agreement per fresh request; ``cache`` (request id ->
    the reference's pair) belongs to one reference model: the caller empties it on a swap."""
    pairs = []
    for f in fresh:
        key = f.record.request_id
        if key not in cache:
            got = score_fresh(model, [f.record], 0, vocab)
            cache[key] = (got[0].agree, got[0].positions) if got else None
        if cache[key] is not None:
            pairs.append(((f.agree, f.positions), cache[key]))
    return pairs


def gate_window(holdout: list[MissRecord], cfg: PromoteConfig, now: float | None = None) -> list[MissRecord]:
    """The held-out records the gate judges on: the newest ``cfg.window`` of ``holdout`` (oldest
    first, as the trainer keeps them), without those logged more than ``cfg.window_s`` before
    ``now``. Kept in arrival order, so the candidate and the champion are paired request by request."""
    recent = list(holdout[-cfg.window :]) if cfg.window else list(holdout)
    if cfg.window_s:
        cutoff = (time.time() if now is None else now) - cfg.window_s
        recent = [r for r in recent if r.timestamp >= cutoff]
    return recent


class Promoter:
    """The trainer's side of the registry."""

    def __init__(
        self,
        registry: RegistryStore,
        base_draft: Path,
        out_dir: Path,
        cfg: PromoteConfig | None = None,
        *,
        tokenizer_dir: Path | None = None,
    ) -> None:
        self.registry = registry
        self.drafts = registry.artifact("draft")
        self.cfg = cfg or PromoteConfig()
        self.base_draft = Path(base_draft)
        self.tokenizer_dir = Path(tokenizer_dir or base_draft)
        self.tokenizer_sha256 = tokenizer_hash(load_tokenizer(self.tokenizer_dir))
        self.vocab = load_draft_vocab(self.base_draft)
        """The draft vocabulary serving scores drafts with (evaluations use it too)."""
        self.trainer_id = _trainer_id(Path(out_dir))
        self._reference: dict[str, tuple[str, torch.nn.Module]] = {}
        """Per cluster: the last champion (or ``base``) model the gate loaded, by version."""
        self._fresh_cache: dict[str, dict] = {}
        """Per cluster: that model's served agreement on fresh requests, by request id."""
        self.last_registered: dict[str, str] = {}

    def source_id(self, cluster: str, checkpoint_version: int) -> str:
        return f"{self.trainer_id}/{cluster}/v{checkpoint_version:06d}"

    def is_registered(self, cluster: str, checkpoint_version: int) -> ArtifactVersion | None:
        return self.drafts.find_source(cluster, self.source_id(cluster, checkpoint_version))

    def publish(
        self,
        cluster: str,
        checkpoint: Path,
        checkpoint_version: int,
        state: dict,
        candidate: torch.nn.Module,
        holdout: list[MissRecord],
        after: Acceptance,
        fresh: list[Fresh] = (),
        champion_checkpoint: int = 0,
    ) -> GateResult:
        """Register the checkpoint (1.), gate it (2.), apply retention (3.). ``fresh``: the
        cluster's test-then-train scores (:class:`Fresh`), oldest first; ``champion_checkpoint``:
        the checkpoint version of this trainer's draft that is champion (0: none or unknown),
        so only scores of newer learners are paired."""
        lineage = state.get("lineage", {})
        dv = self.drafts.register(  # 1.
            cluster,
            checkpoint,
            tokenizer_sha256=self.tokenizer_sha256,
            tokenizer_dir=self.tokenizer_dir,
            metrics={
                "offline_acceptance_sampling": after.sampling,
                "offline_acceptance_greedy": after.greedy,
                "offline_positions": after.num_positions,
            },
            params={
                "checkpoint_version": checkpoint_version,
                "updates": state.get("updates"),
                "records_trained": state.get("records_trained"),
                "config_hash": state.get("config_hash"),
                "base_draft": str(self.base_draft),
                **_flat(state.get("config", {})),
            },
            lineage=lineage,
            parent_version=self.last_registered.get(cluster),
            config_sha256=state.get("config_hash"),
            source_id=self.source_id(cluster, checkpoint_version),
        )
        self.last_registered[cluster] = dv.version
        recent = gate_window(holdout, self.cfg)  # 2.
        # the trainer's evaluation covers its whole held-out set: a smaller window is evaluated again
        result = self.gate(
            cluster,
            dv.version,
            candidate,
            recent,
            after if len(recent) == len(holdout) else None,
            fresh=fresh_window(fresh, self.cfg, champion_checkpoint),
        )
        self.drafts.apply_gate(cluster, result)
        GATE_DECISIONS.labels(cluster_label(cluster), "promoted" if result.promoted else "rejected").inc()
        if self.cfg.keep_versions:  # 3.
            self.drafts.retain(cluster, keep_last=self.cfg.keep_versions)
        return result

    def gate(
        self,
        cluster: str,
        version: str,
        candidate: torch.nn.Module,
        holdout: list[MissRecord],
        candidate_acc: Acceptance | None = None,
        *,
        fresh: list[Fresh] = (),
    ) -> GateResult:
        """Candidate vs champion (or base) on the same held-out records (already the gate's window),
        and the learner vs the champion on ``fresh`` (already :func:`fresh_window`'s selection)."""
        champion = self.drafts.by_alias(cluster, CHAMPION)
        ref_version, ref_model = self._reference_model(cluster, champion)
        return judge(
            version,
            ref_version,
            candidate,
            ref_model,
            holdout,
            list(fresh),
            self.cfg,
            self.vocab,
            candidate_acc=candidate_acc,
            fresh_cache=self._fresh_cache.setdefault(cluster, {}),
        )

    def _reference_model(self, cluster: str, champion: ArtifactVersion | None) -> tuple[str, torch.nn.Module]:
        """The champion's weights (fetched and verified once per version), or the base draft."""
        want = champion.version if champion is not None else "base"
        cached = self._reference.get(cluster)
        if cached is not None and cached[0] == want:
            return cached
        self._fresh_cache[cluster] = {}  # the reference's fresh scores were another model's
        if champion is None:
            model = from_pretrained(AutoModelForCausalLM, self.base_draft, use_safetensors=True)
        else:
            with tempfile.TemporaryDirectory(prefix="specops-gate-") as tmp:
                self.drafts.fetch(champion, Path(tmp) / "draft")
                model = from_pretrained(AutoModelForCausalLM, Path(tmp) / "draft", use_safetensors=True)
        model.eval()
        self._reference[cluster] = (want, model)
        return want, model


def judge(
    candidate_name: str,
    reference_name: str | None,
    candidate: torch.nn.Module,
    reference: torch.nn.Module,
    window: list[MissRecord],
    fresh: list[Fresh],
    cfg: PromoteConfig,
    vocab: DraftVocab | None,
    *,
    candidate_acc: Acceptance | None = None,
    reference_acc: Acceptance | None = None,
    fresh_cache: dict | None = None,
) -> GateResult:
    """The whole gate on models: ``window`` (:func:`gate_window`'s held-out records) and
    ``fresh`` (:func:`fresh_window`'s selection), evaluated and decided by :func:`gate_decision`.
    ``candidate_acc`` / ``reference_acc``: evaluations of ``window`` already made; ``fresh_cache``:
    :func:`reference_pairs`' cache for ``reference``."""
    cand = candidate_acc or evaluate_records(candidate, window, vocab=vocab)
    ref = reference_acc or evaluate_records(reference, window, vocab=vocab)
    pairs = reference_pairs(reference, fresh, vocab, {} if fresh_cache is None else fresh_cache)
    guard = None
    if pairs:  # the held-out requests of the period the fresh evidence covers
        since = min(f.record.timestamp for f in fresh)
        recent = [r for r in window if r.timestamp >= since]
        if recent:
            guard = (evaluate_records(candidate, recent, vocab=vocab), evaluate_records(reference, recent, vocab=vocab))
    result = gate_decision(candidate_name, reference_name, cand, ref, cfg, fresh=pairs, guard=guard)
    result.extra["window_requests"] = len(window)
    return result


def gate_decision(
    candidate: str,
    reference: str | None,
    cand: Acceptance,
    ref: Acceptance,
    cfg: PromoteConfig,
    *,
    fresh: list[tuple[tuple[int, int], tuple[int, int]]] = (),
    guard: tuple[Acceptance, Acceptance] | None = None,
) -> GateResult:
    """The gate's rule on two evaluations of the same held-out records (the candidate's and
    the champion's, or the base draft's) and, metric ``served``, the (learner, champion) pairs
    on fresh requests (:func:`reference_pairs`). ``guard``: the candidate's and the champion's
    evaluations on the held-out requests of the period the fresh ones cover: with fresh
    evidence, a candidate worse there beyond noise is not promoted."""
    metric, note = cfg.metric, ""
    if metric == "served" and fresh:
        cand, ref = _with_pairs(cand, [a for a, _ in fresh]), _with_pairs(ref, [b for _, b in fresh])
    if metric == "served" and not (cand.served_positions and len(cand.per_request) == len(ref.per_request)):
        metric, note = "sampling", "no greedy held-out requests, compared at rejected positions: "
    if metric == "served":
        _, stderr = paired_gain(cand, ref)
        result = decide(
            candidate,
            reference,
            cand.served,
            ref.served,
            margin=cfg.margin,
            num_positions=cand.served_positions,
            min_positions=cfg.min_positions,
            metric="served",
            stderr=stderr,
            z=cfg.z,
        )
    else:
        result = decide(
            candidate,
            reference,
            getattr(cand, metric),
            getattr(ref, metric),
            margin=cfg.margin,
            num_positions=cand.num_positions,
            min_positions=cfg.min_positions,
            metric=metric,
        )
    if metric == "served" and fresh:
        result.extra["fresh_requests"] = len(fresh)
        gc, gr = guard or (None, None)
        own, own_se = (
            paired_gain(gc, gr)
            if gc is not None and gc.per_request and len(gc.per_request) == len(gr.per_request)
            else (0.0, float("inf"))
        )
        result.extra["guard_requests"] = len(gc.per_request) if gc is not None else 0
        if math.isfinite(own_se):
            result.extra["guard_served_gain"] = own
        if result.promoted and cfg.margin > -1 and math.isfinite(own_se) and own + cfg.z * own_se < 0:
            result = dataclasses.replace(
                result,
                promoted=False,
                reason=(
                    f"the learner wins on fresh traffic, but this candidate is worse than the champion on the "
                    f"held-out requests of the same period ({own:+.4f} ± {own_se:.4f})"
                ),
            )
    for other in ("served", "sampling", "greedy"):
        if other != metric:
            result.extra.update({f"candidate_{other}": getattr(cand, other), f"champion_{other}": getattr(ref, other)})
    return dataclasses.replace(result, reason=note + result.reason) if note else result


def _with_pairs(acc: Acceptance, pairs: list[tuple[int, int]]) -> Acceptance:
    """``acc`` with more requests' served agreement after its own."""
    per_request = tuple(acc.per_request) + tuple(pairs)
    matched, n = sum(m for m, _ in per_request), sum(k for _, k in per_request)
    return dataclasses.replace(acc, per_request=per_request, served=matched / n if n else 0.0, served_positions=n)


def load_draft_vocab(draft_dir: Path) -> DraftVocab | None:
    """The draft vocabulary a draft directory carries (``draft_vocab.json``), or None."""
    import json

    cfg = json.loads((Path(draft_dir) / "config.json").read_text())
    return draft_vocab.load(draft_dir, int(cfg["vocab_size"]))


def _trainer_id(out_dir: Path) -> str:
    """A stable id of this trainer's checkpoint directory (created once, kept in ``out_dir``)."""
    path = out_dir / "trainer_id"
    if not path.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(uuid.uuid4().hex[:12])
    return path.read_text().strip()


def _flat(config: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
