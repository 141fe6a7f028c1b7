"""DReSD datastores on the trainer side: their documents, their offline evaluation, their build.

- :func:`corpus_documents`: the out-of-distribution documents, snippets of the bootstrap's
  training text (code and prose; never its held-out files), tokenized;
- :func:`offline_mar`: a datastore's mean acceptance rate (MAR, DReSD §4.3: accepted / drafted
  per document, averaged over documents) replayed on held-out target generations;
- :func:`choose_shape`: the draft shape (rows x tokens) with the most tokens per step time;
- :func:`register_datastore`: a version of ``datastore-<cluster>`` with sizes and hashes.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specops.core.datastore import Datastore, DatastoreConfig
from specops.core.keys import target_hidden_states
from specops.registry import ArtifactVersion
from specops.trainer.rebuild import Candidate, Rebuilder

log = logging.getLogger(__name__)


def corpus_documents(
    model_dir: Path, tokenizer, *, per_domain: int = 400, chars: int = 2000, seed: int = 0
) -> list[list[int]]:
    """Token ids of up to ``per_domain`` snippets of ``chars`` characters per bootstrap domain."""
    from specops.trainer.router_fit import bootstrap_texts

    texts = bootstrap_texts(Path(model_dir), per_domain=per_domain, chars=chars, per_doc=1, seed=seed)
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for domain in sorted(texts) for t in texts[domain]]


@dataclass(frozen=True)
class MarResult:
    """Replayed acceptance of a datastore on documents."""

    mar: float
    """Accepted / drafted per document, averaged over documents (the paper's MAR)."""
    accepted_per_step: float
    """Accepted draft tokens per verification step, pooled."""
    num_docs: int
    num_steps: int
    nodes_per_step: float = 0.0
    """Distinct drafted tokens (token-tree nodes) per verification step."""


def offline_mar(
    store: Datastore,
    target,
    docs: Sequence[Sequence[int]],
    starts: Sequence[int],
    *,
    n_drafts: int = 3,
    k: int = 10,
    batch_tokens: int = 4096,
    hidden: dict[int, np.ndarray] | None = None,
) -> MarResult:
    """Replay greedy DReSD over each document's output (positions ``starts[i]`` on): at each
    step the drafts come from the hidden state before the step's first token, the accepted
    length is the longest prefix of any row that matches the document, and the step emits
    accepted + 1 tokens. For greedy target outputs this is exactly what serving would accept.
    ``hidden`` (doc index -> [len, hidden]) skips the target pass when the caller has it."""
    per_doc, steps, accepted_total, nodes = [], 0, 0, 0
    states = hidden.items() if hidden is not None else target_hidden_states(target, docs, batch_tokens=batch_tokens)
    for i, h in states:
        doc = list(docs[i])
        t = max(1, int(starts[i])) + 1  # the first output token comes from the prefill: nothing drafted
        drafted = accepted = 0
        while t < len(doc) - 1:
            rows = store.drafts(h[t - 1], doc[t], n_drafts=n_drafts, length=min(k, len(doc) - t - 1))
            best = 0
            for row in rows:
                n = 0
                while n < len(row) and t + 1 + n < len(doc) and row[n] == doc[t + 1 + n]:
                    n += 1
                best = max(best, n)
            drafted += max((len(r) for r in rows), default=0)
            nodes += len({tuple(r[: j + 1]) for r in rows for j in range(len(r))})
            accepted += best
            steps += 1
            t += best + 1
        accepted_total += accepted
        per_doc.append(accepted / drafted if drafted else 0.0)
    return MarResult(
        float(np.mean(per_doc)) if per_doc else 0.0,
        accepted_total / steps if steps else 0.0,
        len(per_doc),
        steps,
        nodes / steps if steps else 0.0,
    )


SHAPES = ((1, 4), (3, 6), (3, 10), (3, 20), (10, 6), (10, 10))
"""Draft shapes (rows, tokens per row) a rebuild tries: the paper's 3x20 and 10x10 among them."""


def choose_shape(
    store: Datastore,
    target,
    docs: Sequence[Sequence[int]],
    starts: Sequence[int],
    *,
    node_cost: float,
    step_overhead: float = 0.04,
    shapes: Sequence[tuple[int, int]] = SHAPES,
    hidden: dict[int, np.ndarray] | None = None,
) -> tuple[tuple[int, int], dict]:
    """The shape with the most tokens per unit of step time, replayed on ``docs``: a step
    emits ``accepted + 1`` tokens and costs ``1 + step_overhead + node_cost * nodes`` target
    steps (one target pass plus its drafted tree nodes; ``node_cost`` is what one more token in
    a verify pass costs, as a fraction of a one-token pass: about 0.15 for SmolLM2-135M on
    2 CPU cores, expected near zero on a GPU, not measured here). Returns the shape and every shape's numbers."""
    hidden = hidden if hidden is not None else dict(target_hidden_states(target, docs))
    scores = {}
    for n, k in shapes:
        m = offline_mar(store, target, docs, starts, n_drafts=n, k=k, hidden=hidden)
        speed = (m.accepted_per_step + 1) / (1 + step_overhead + node_cost * m.nodes_per_step)
        scores[f"{n}x{k}"] = {
            "mar": round(m.mar, 4),
            "accepted_per_step": round(m.accepted_per_step, 3),
            "nodes_per_step": round(m.nodes_per_step, 1),
            "speed_vs_target": round(speed, 3),
        }
    best = max(shapes, key=lambda s: scores[f"{s[0]}x{s[1]}"]["speed_vs_target"])
    return best, scores


def register_datastore(
    registry,
    cluster: str,
    store: Datastore,
    stats,
    *,
    tags: dict | None = None,
    metrics: dict | None = None,
    lineage: dict | None = None,
):
    """Register ``store`` as a new version of ``datastore-<cluster>`` (alias ``challenger``) with
    its sizes, config hash and tokenizer hash; returns the version. Metrics are also tags (the
    registry writes each as a ``%.6f`` tag), so sizes are not repeated as tags."""
    cfg_hash = store.cfg.hash()
    with tempfile.TemporaryDirectory(prefix="specops-datastore-") as tmp:
        store.save(Path(tmp) / "ds")
        return registry.artifact("datastore").register(
            cluster,
            Path(tmp) / "ds",
            meta={"config_hash": cfg_hash},
            tags={"config_hash": cfg_hash, "tokenizer_sha256": store.meta.get("tokenizer_sha256", ""), **(tags or {})},
            metrics={
                "num_entries": float(store.num_entries),
                "bytes_per_entry": store.bytes_per_entry,
                "embed_tokens_per_s": stats.embed_tokens_per_s,
                **(metrics or {}),
            },
            lineage=lineage,
        )


# ---------------------------------------------------------------- rebuilds from served traffic
@dataclass
class RebuildConfig:
    """How datastores are rebuilt from ``spec.generations``."""

    group: str = "datastore-rebuild"
    """Consumer group on ``spec.generations`` (its own: no other consumer's offsets move)."""
    min_new: int = 32
    """New generations a cluster needs before its datastore is rebuilt."""
    max_docs: int = 20_000
    """Most recent generations per cluster a datastore is built from (older ones age out)."""
    heldout_every: int = 10
    """Every N-th generation of a cluster is held out for the gate, never stored."""
    max_heldout: int = 200
    margin: float = 0.0
    """Promote only when the candidate's held-out MAR beats the champion's by more than this."""
    n_drafts: int = 3
    k: int = 10
    """The draft shape the gate replays."""
    node_cost: float = 0.15
    """Cost of one more drafted token in a verify pass, as a fraction of a one-token target pass
    (SmolLM2-135M on 2 CPU cores: about 0.15; on a GPU expected near zero, not measured here): the rebuild picks the
    shape serving uses by default (``choose_shape``) with it."""
    datastore: DatastoreConfig = field(default_factory=lambda: DatastoreConfig(value_len=21))
    poll_records: int = 500
    poll_timeout_s: float = 1.0
    max_polls: int = 100

    def __post_init__(self) -> None:
        if self.min_new < 1 or self.max_docs < self.min_new or self.heldout_every < 2 or self.max_heldout < 1:
            raise ValueError("need 1 <= min_new <= max_docs, heldout_every >= 2 and max_heldout >= 1")


@dataclass(frozen=True)
class RebuildResult:
    """What one rebuild run did, per cluster rebuilt: ``promoted`` or ``registered``."""

    consumed: int
    clusters: dict[str, str] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    mar: dict[str, tuple[float, float | None]] = field(default_factory=dict)
    """Per cluster: (candidate's held-out MAR, champion's or None)."""

    @property
    def status(self) -> str:
        if not self.clusters:
            return "no_new_records" if not self.consumed else "waiting"
        outcomes = set(self.clusters.values())
        return "promoted" if "promoted" in outcomes else "registered" if "registered" in outcomes else "unchanged"


def inputs_sha256(
    cluster: str,
    cfg: DatastoreConfig,
    tokenizer_sha256: str,
    train: Sequence[Sequence[int]],
    heldout: Sequence[tuple[Sequence[int], int]],
) -> str:
    """sha256 of everything a rebuilt datastore and its gate come from: the cluster, the build
    config, the tokenizer, the training documents and the held-out ones (with their output starts).
    Equal hashes mean the same version would be built again (the rebuild's lineage check)."""
    h = hashlib.sha256(f"{cluster}\0{cfg.hash()}\0{tokenizer_sha256}\0{len(train)}\0{len(heldout)}".encode())
    for doc, start in [(d, -1) for d in train] + list(heldout):
        ids = np.asarray(doc, dtype=np.int64)
        h.update(np.asarray([len(ids), start], dtype=np.int64).tobytes())
        h.update(ids.tobytes())
    return h.hexdigest()


class DatastoreRebuilder(Rebuilder[Datastore]):
    """Rebuilds each cluster's DReSD datastore from its served generations. :meth:`run_once`
    (``specops.trainer.rebuild.Rebuilder``) reads top to bottom:

    1. **consume** GenerationRecords in its own consumer group; each (context + output) goes
       to its cluster's training buffer, every ``heldout_every``-th to its held-out set;
    2. for each cluster with ``min_new`` new generations, **build** a datastore over the
       buffer (the target's hidden states in batches, z-norm and PCA refitted, the index);
    3. **gate**: its MAR replayed on the held-out generations must beat the champion's;
    4. **register** ``datastore-<cluster>`` (lineage: offsets, sizes, config hash, and the
       ``inputs_sha256`` of its documents) and 5. **promote** it when the gate passed;
    6. **commit** the offsets, only now, and only once every cluster's new generations are in
       a registered version: a crash before this re-reads the records.

    **Idempotent after a crash.** Killed after step 4 but before step 6, a restarted trainer reads
    the same generations again. Before building (step 2), the rebuild hashes its inputs
    (:func:`inputs_sha256`); when the latest version of ``datastore-<cluster>`` carries the same
    hash, nothing is built or registered (outcome ``unchanged``, logged) and the offsets commit. A
    version whose gate passed but which was never promoted (killed between register and promote)
    is promoted then.
    """

    kind = "datastore"

    def __init__(
        self, stream_cfg, registry, target, *, tokenizer_sha256: str = "", cfg: RebuildConfig | None = None
    ) -> None:
        super().__init__(stream_cfg, registry, cfg or RebuildConfig())
        self.target = target
        self.tokenizer_sha256 = tokenizer_sha256
        self.train: dict[str, deque] = {}
        self.heldout: dict[str, deque] = {}
        self._count: dict[str, int] = {}
        self._new: dict[str, int] = {}
        self._seen: set[tuple[str, int, int]] = set()

    def consume(self) -> int:
        """Step 1; returns the records consumed."""
        n = 0
        for source, rec in self.reader.records():
            n += 1
            if source in self._seen:  # redelivered after a rebalance: used once
                continue
            self._seen.add(source)
            context = [int(t) for t in rec.prompt_ids]
            doc = (context + [int(t) for t in rec.output_ids], len(context))
            c = rec.cluster
            self._count[c] = self._count.get(c, 0) + 1
            if self._count[c] % self.cfg.heldout_every == 0:
                self.heldout.setdefault(c, deque(maxlen=self.cfg.max_heldout)).append(doc)
            else:
                self.train.setdefault(c, deque(maxlen=self.cfg.max_docs)).append(doc)
                self._new[c] = self._new.get(c, 0) + 1
        return n

    def start(self, consumed: int) -> RebuildResult:
        return RebuildResult(consumed)

    def due(self) -> list[str]:
        return sorted(c for c, n in self._new.items() if n >= self.cfg.min_new and self.heldout.get(c))

    def _inputs(self, cluster: str) -> str:
        docs = [d for d, _ in self.train[cluster]]
        return inputs_sha256(cluster, self.cfg.datastore, self.tokenizer_sha256, docs, list(self.heldout[cluster]))

    def already_registered(self, cluster: str, result: RebuildResult) -> bool:
        """True when the latest version of ``datastore-<cluster>`` was built from these inputs (its
        ``inputs_sha256``): nothing to build or register; a gate it passed but a promotion it never
        got (a crash between the two) is finished here."""
        inputs = self._inputs(cluster)
        versions = self.artifacts.versions(cluster)
        latest = versions[-1] if versions else None
        if latest is None or latest.tags.get("inputs_sha256") != inputs:
            return False
        outcome = "unchanged"
        passed = latest.metric("gate_passed") == 1.0
        if passed and "promoted_at" not in latest.tags and not latest.archived and "champion" not in latest.aliases:
            reason = "rebuild gate passed before a restart; promotion finished"
            self.artifacts.promote(cluster, latest.version, reason=reason)
            outcome = "promoted"
        finished = "; promoted it, which the run that registered it did not live to do" if outcome == "promoted" else ""
        log.info(
            "datastore-%s: version %s was built from these same %d generations (inputs %s): not registering it again%s",
            cluster,
            latest.version,
            len(self.train[cluster]),
            inputs[:12],
            finished,
        )
        self._new[cluster] = 0
        result.clusters[cluster] = outcome
        result.versions[cluster] = latest.version
        return True

    def build(self, cluster: str) -> Candidate:
        docs = [d for d, _ in self.train[cluster]]
        champion = self.champion(cluster, lambda path, _version: Datastore.load(path))
        meta = {"cluster": cluster, "tokenizer_sha256": self.tokenizer_sha256}
        store, stats = Datastore.build(self.target, docs, self.cfg.datastore, meta=meta)
        return Candidate(
            store,
            {
                "stats": stats,
                "docs": len(docs),
                "inputs": self._inputs(cluster),
                "champion": champion[1] if champion else None,
            },
        )

    def _mar(self, store: Datastore, cluster: str, hidden: dict[int, np.ndarray] | None = None) -> float:
        docs = list(self.heldout.get(cluster, ()))
        if not docs:
            return 0.0
        return offline_mar(
            store,
            self.target,
            [d for d, _ in docs],
            [s for _, s in docs],
            n_drafts=self.cfg.n_drafts,
            k=self.cfg.k,
            hidden=hidden,
        ).mar

    def gate(self, cluster: str, c: Candidate) -> tuple[bool, str]:
        """Held-out MAR against the champion's (one target pass, three replays), and the draft shape."""
        store, champion = c.artifact, c.info["champion"]
        held = list(self.heldout[cluster])
        hidden = dict(target_hidden_states(self.target, [d for d, _ in held]))
        mar = self._mar(store, cluster, hidden)
        champ_mar = self._mar(champion, cluster, hidden) if champion is not None else None
        (n, k), shapes = choose_shape(
            store, self.target, [d for d, _ in held], [s for _, s in held], node_cost=self.cfg.node_cost, hidden=hidden
        )
        store.meta["shape"] = {"n_drafts": n, "k": k, "node_cost": self.cfg.node_cost, "replayed": shapes}
        if shapes[f"{n}x{k}"]["speed_vs_target"] < 1.0:
            log.warning(
                "datastore-%s: even its best draft shape (%dx%d) replays at %.2fx target-only speed at "
                "node_cost %.3f: on this hardware target-only (or another method) serves this cluster "
                "faster",
                cluster,
                n,
                k,
                shapes[f"{n}x{k}"]["speed_vs_target"],
                self.cfg.node_cost,
            )
        c.info.update(mar=mar, champ_mar=champ_mar, shape=f"{n}x{k}", speed=shapes[f"{n}x{k}"]["speed_vs_target"])
        passed = champ_mar is None or mar > champ_mar + self.cfg.margin
        return passed, f"held-out MAR {mar:.3f} vs {'none' if champ_mar is None else f'{champ_mar:.3f}'}"

    def register(self, cluster: str, c: Candidate) -> ArtifactVersion:
        mar, champ_mar = c.info["mar"], c.info["champ_mar"]
        lineage = {**self.reader.lineage(), "docs": c.info["docs"], "heldout": len(self.heldout[cluster])}
        return register_datastore(
            self.registry,
            cluster,
            c.artifact,
            c.info["stats"],
            lineage=lineage,
            tags={
                "mar": f"{mar:.6f}",
                "champion_mar": "" if champ_mar is None else f"{champ_mar:.6f}",
                "source": "spec.generations",
                "shape": c.info["shape"],
                "inputs_sha256": c.info["inputs"],
            },
            metrics={"mar": mar, "gate_passed": float(c.passed), "shape_speed_vs_target": c.info["speed"]},
        )

    def record(self, cluster: str, c: Candidate, result: RebuildResult) -> None:
        mar, champ_mar = c.info["mar"], c.info["champ_mar"]
        self._new[cluster] = 0
        result.clusters[cluster] = c.outcome
        result.versions[cluster] = c.version.version
        result.mar[cluster] = (mar, champ_mar)
        log.info(
            "datastore-%s: version %s from %d generations (%d entries, keys at %.0f tokens/s), held-out MAR "
            "%.3f vs champion %s: %s",
            cluster,
            c.version.version,
            c.info["docs"],
            c.artifact.num_entries,
            c.info["stats"].embed_tokens_per_s,
            mar,
            "none" if champ_mar is None else f"{champ_mar:.3f}",
            "promoted" if c.passed else "kept the champion",
        )

    def may_commit(self) -> bool:
        # Only when every consumed generation is in a registered version (or held out): a cluster
        # still short of min_new holds the commit back, so a crash re-reads its records.
        return not any(self._new.values())

    def commit(self) -> None:
        self.reader.commit()
        self._seen.clear()
