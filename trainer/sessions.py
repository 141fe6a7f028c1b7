"""LLMA's past sessions on the trainer side: each cluster's outputs from ``spec.generations``,
rebuilt into a bounded set, gated on an offline copy hit rate, versioned as ``sessions-<cluster>``.

- :func:`copy_hit_rate`: the gate's offline proxy for how much a past-sessions index helps LLMA;
- :class:`SessionIndexRebuilder`: the rebuild job (consume, keep, gate, register, promote, commit).

Serving seeds each cluster's :class:`~specops.serving.proposers.session_cache.SessionCache` from
``sessions-<cluster>@champion`` (``serving/fleet/sessions.py``).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specops.core.sessions.cache import SessionCacheConfig, index_of, newest_within
from specops.core.sessions.ngram import MAX_EXTEND, NgramIndex
from specops.core.sessions.store import load_sessions, save_sessions
from specops.registry import ArtifactVersion
from specops.registry.artifacts import sha256_json
from specops.trainer.rebuild import Candidate, Rebuilder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HitRate:
    """How often a past-sessions index would draft the right next token of held-out outputs."""

    hits: int
    positions: int

    @property
    def rate(self) -> float:
        return self.hits / self.positions if self.positions else 0.0


def copy_hit_rate(
    index: NgramIndex | None, outputs: Sequence[Sequence[int]], *, k: int = 10, min_n: int = 1
) -> HitRate:
    """The copy hit rate of ``index`` on ``outputs``: over every position ``t >= 1`` of every
    output ``o``, the fraction where LLMA's best match for the trailing tokens ``o[:t]`` (the
    last ``MAX_EXTEND``; :meth:`NgramIndex.matches`, longest n-gram from ``max_n`` down to
    ``min_n``, ranked as serving ranks them for a draft of ``k``) copies ``o[t]`` as its first
    drafted token.

    A cheap offline proxy for what the index adds to serving, not serving's acceptance: it
    scores only the first copied token, uses the output alone as the tail (no prompt), and
    leaves out the request's own context, which LLMA copies from too."""
    hits = positions = 0
    for o in outputs:
        o = list(o)
        for t in range(1, len(o)):
            positions += 1
            if index is None or not len(index):
                continue
            found = index.matches(o[max(0, t - MAX_EXTEND) : t], k, min_n)
            if found and index.tokens[found[0].pos] == o[t]:
                hits += 1
    return HitRate(hits, positions)


@dataclass
class SessionRebuildConfig:
    """How past-sessions indexes are rebuilt from ``spec.generations``."""

    group: str = "sessions-rebuild"
    """Consumer group on ``spec.generations`` (its own: no other consumer's offsets move)."""
    min_new: int = 8
    """New outputs (kept and not seen before) a cluster needs before it is rebuilt."""
    heldout_fraction: float = 0.1
    """The newest this fraction of a cluster's outputs (at least one) is held out for the gate."""
    margin: float = 0.0
    """Promote when the candidate's hit rate is at least the champion's minus this (0: not worse)."""
    k: int = 10
    min_n: int = 1
    """LLMA's draft length and shortest match (serving's defaults), as the gate replays them."""
    cache: SessionCacheConfig = field(default_factory=SessionCacheConfig)
    """The same budget and filters serving's cache uses (``max_tokens`` per cluster, ``min_output_tokens``)."""
    poll_records: int = 500
    poll_timeout_s: float = 1.0
    max_polls: int = 100

    def __post_init__(self) -> None:
        if self.min_new < 1 or not 0.0 < self.heldout_fraction < 1.0 or self.k < 1 or self.min_n < 1:
            raise ValueError("need min_new >= 1, 0 < heldout_fraction < 1, k >= 1 and min_n >= 1")


@dataclass(frozen=True)
class SessionRebuildResult:
    """What one rebuild run did, per cluster rebuilt: ``promoted``, ``registered``, or ``unchanged``
    (the outputs kept are the champion's already: records read again after a run that could not commit)."""

    consumed: int
    clusters: dict[str, str] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    hit_rate: dict[str, tuple[float, float | None]] = field(default_factory=dict)
    """Per cluster: (candidate's held-out copy hit rate, champion's or None)."""
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per cluster: (outputs, tokens) of the registered version."""

    @property
    def status(self) -> str:
        if not self.clusters:
            return "no_new_records" if not self.consumed else "waiting"
        outcomes = set(self.clusters.values())
        return "promoted" if "promoted" in outcomes else "registered" if "registered" in outcomes else "unchanged"


class SessionIndexRebuilder(Rebuilder[list[tuple[int, ...]]]):
    """Rebuilds each cluster's past-sessions index from its served outputs. :meth:`run_once`
    (``specops.trainer.rebuild.Rebuilder``) reads top to bottom:

    1. **consume** GenerationRecords in its own consumer group; an output shorter than
       ``min_output_tokens`` is skipped, a repeat of one held moves to the newest place;
    2. for each cluster with ``min_new`` new outputs, **build**: keep the newest that fit the
       token budget, after the champion's (a restarted rebuilder carries the champion's outputs
       on: committed records are not read again);
    3. **gate**: hold out the newest ``heldout_fraction``; the candidate (the rest) and the
       champion (without the held-out outputs) are scored with :func:`copy_hit_rate`;
    4. **register** ``sessions-<cluster>`` with every kept output (the held-out ones too; metrics
       ``hit_rate``, ``num_outputs``, ``num_tokens``) and 5. **promote** it when not worse; the same
       outputs (and config) register once: read again, they name the version they are in;
    6. **commit** the offsets, only once every cluster's new outputs are in a registered
       version: a crash before this re-reads the records.
    """

    kind = "sessions"

    def __init__(
        self, stream_cfg, registry, *, tokenizer_sha256: str = "", cfg: SessionRebuildConfig | None = None
    ) -> None:
        super().__init__(stream_cfg, registry, cfg or SessionRebuildConfig())
        self.tokenizer_sha256 = tokenizer_sha256
        self.outputs: dict[str, dict[tuple[int, ...], None]] = {}
        """Per cluster, the outputs held, oldest first (a dict: ordered and deduplicated)."""
        self._tokens: dict[str, int] = {}
        self._new: dict[str, int] = {}
        self._from_champion: set[str] = set()
        self._seen: set[tuple[str, int, int]] = set()
        self.num_skipped = 0
        """Outputs too short to keep."""

    @property
    def waiting(self) -> list[str]:
        """Clusters with new outputs not in a registered version yet (short of ``min_new``)."""
        return sorted(c for c, n in self._new.items() if n)

    def consume(self) -> int:
        """Step 1; returns the records consumed."""
        n = 0
        for source, rec in self.reader.records():
            n += 1
            if source in self._seen:  # redelivered after a rebalance: used once
                continue
            self._seen.add(source)
            doc = self.cfg.cache.keepable(rec.output_ids.tolist())
            if doc is None:
                self.num_skipped += 1
                continue
            c, budget = rec.cluster, self.cfg.cache.max_tokens
            held = self.outputs.setdefault(c, {})
            repeat = doc in held
            held.pop(doc, None)  # a repeated output is kept once, as the newest
            held[doc] = None
            self._tokens[c] = self._tokens.get(c, 0) + (0 if repeat else len(doc))
            if self._tokens[c] > 2 * budget:  # bounded between runs too
                self._trim(c, budget)
            self._new[c] = self._new.get(c, 0) + 1
        return n

    def _trim(self, cluster: str, budget: int) -> list[tuple[int, ...]]:
        kept = newest_within(list(self.outputs[cluster]), budget)
        self.outputs[cluster] = dict.fromkeys(kept)
        self._tokens[cluster] = sum(len(d) for d in kept)
        return kept

    def start(self, consumed: int) -> SessionRebuildResult:
        return SessionRebuildResult(consumed)

    def due(self) -> list[str]:
        return sorted(c for c, n in self._new.items() if n >= self.cfg.min_new)

    def build(self, cluster: str) -> Candidate:
        champion = self.champion(cluster, lambda path, _version: load_sessions(path).docs)
        if champion is not None and cluster not in self._from_champion:
            new = self.outputs[cluster]
            self.outputs[cluster] = {**dict.fromkeys(d for d in champion[1] if d not in new), **new}
        self._from_champion.add(cluster)
        return Candidate(self._trim(cluster, self.cfg.cache.max_tokens), {"champion": champion})

    def gate(self, cluster: str, c: Candidate) -> tuple[bool, str]:
        cfg, docs, champion = self.cfg, c.artifact, c.info["champion"]
        num_heldout = max(1, round(cfg.heldout_fraction * len(docs)))
        heldout = docs[-num_heldout:]
        held_set = set(heldout)
        hit = copy_hit_rate(index_of(docs[:-num_heldout], cfg.cache), heldout, k=cfg.k, min_n=cfg.min_n).rate
        champ_hit = None
        if champion is not None:
            champ_hit = copy_hit_rate(
                index_of([d for d in champion[1] if d not in held_set], cfg.cache), heldout, k=cfg.k, min_n=cfg.min_n
            ).rate
        c.info.update(hit=hit, champ_hit=champ_hit, num_heldout=num_heldout)
        passed = champ_hit is None or hit >= champ_hit - cfg.margin
        return passed, f"held-out copy hit rate {hit:.3f} vs {'none' if champ_hit is None else f'{champ_hit:.3f}'}"

    def register(self, cluster: str, c: Candidate) -> ArtifactVersion:
        cfg, docs, champion = self.cfg, c.artifact, c.info["champion"]
        hit, champ_hit = c.info["hit"], c.info["champ_hit"]
        c.info["num_tokens"] = num_tokens = sum(len(d) for d in docs)
        lineage = {**self.reader.lineage(), "outputs": len(docs), "heldout": c.info["num_heldout"]}
        with tempfile.TemporaryDirectory(prefix="specops-sessions-") as tmp:
            path = save_sessions(
                Path(tmp) / "s",
                cluster,
                docs,
                self.tokenizer_sha256,
                extra={
                    "config": asdict(cfg.cache),
                    "config_hash": cfg.cache.hash(),
                    "lineage": lineage,
                    "gate": {
                        "hit_rate": hit,
                        "champion_hit_rate": champ_hit,
                        "heldout_outputs": c.info["num_heldout"],
                        "champion_version": champion[0] if champion else None,
                    },
                },
            )
            content = sha256_json([cfg.cache.hash(), docs])
            return self.artifacts.register(
                cluster,
                path,
                meta={"config_hash": cfg.cache.hash()},
                lineage=lineage,
                source_id=content,
                tags={
                    "config_hash": cfg.cache.hash(),
                    "tokenizer_sha256": self.tokenizer_sha256,
                    "champion_hit_rate": "" if champ_hit is None else f"{champ_hit:.6f}",
                    "source": "spec.generations",
                },
                metrics={
                    "hit_rate": hit,
                    "num_outputs": float(len(docs)),
                    "num_tokens": float(num_tokens),
                    "gate_passed": float(c.passed),
                },
            )

    def outcome(self, cluster: str, c: Candidate) -> str:
        champion = c.info["champion"]
        unchanged = champion is not None and c.version.version == champion[0]
        return "unchanged" if unchanged else "promoted" if c.passed else "registered"

    def record(self, cluster: str, c: Candidate, result: SessionRebuildResult) -> None:
        hit, champ_hit, docs = c.info["hit"], c.info["champ_hit"], c.artifact
        self._new[cluster] = 0
        result.clusters[cluster] = c.outcome
        result.versions[cluster] = c.version.version
        result.hit_rate[cluster] = (hit, champ_hit)
        result.sizes[cluster] = (len(docs), c.info["num_tokens"])
        log.info(
            "sessions-%s: version %s, %d outputs (%d tokens), held-out copy hit rate %.3f vs champion %s: %s",
            cluster,
            c.version.version,
            len(docs),
            c.info["num_tokens"],
            hit,
            "none" if champ_hit is None else f"{champ_hit:.3f}",
            "kept the champion" if c.outcome == "registered" else c.outcome,
        )

    def may_commit(self) -> bool:
        # Only when every kept output is in a registered version: a cluster still short of
        # min_new holds the commit back, so a crash re-reads its records.
        return not any(self._new.values())

    def commit(self) -> None:
        self.reader.commit()
        self._seen.clear()
