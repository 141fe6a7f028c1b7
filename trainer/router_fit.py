"""Fitting the prompt router: spherical k-means with stable cluster names.

- :func:`fit_router` embeds texts and fits K unit centroids by spherical k-means (cosine).
  Seeded from the current router, every cluster keeps its name across refits: its old
  centroid is the starting point, and after the fit the old names are matched to the new
  centroids by the assignment that maximises total cosine similarity (exact for small K,
  greedy beyond). A cluster never disappears: each one owns a draft lineage. Labelled
  texts (a request's ``cluster``) seed a centroid for a name the router does not know
  yet; a K larger than the known names adds fresh names ``c<N>``.
- :func:`bootstrap_router` fits the first router on the bootstrap's *training* documents,
  labelled by domain (``code``, ``prose``); held-out documents are left to the demo.
- :class:`RouterRefitter` refits from ``spec.generations`` (the scheduled ``router-refit``
  job and ``specops router fit``) and registers and promotes each new version.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import random
import tempfile
import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specops.core.embed import Embedder, normalise
from specops.core.errors import RouterError
from specops.core.router import LOCAL, Router
from specops.registry import ArtifactVersion, RegistryStore
from specops.registry.artifacts import sha256_json
from specops.streams import StreamConfig
from specops.trainer.rebuild import Candidate, Rebuilder

log = logging.getLogger(__name__)

EXACT_MATCH_LIMIT = 40_320
"""Name matchings tried exhaustively up to this many (8 clusters); greedy beyond."""


def fit_router(
    data: Mapping[str, Sequence[str]] | Sequence[str],
    embedder: Embedder,
    k: int | None = None,
    *,
    init: Router | None = None,
    labels: Sequence[str | None] | None = None,
    seed: int = 0,
    iters: int = 50,
    refine: bool = True,
    ignore_labels: Sequence[str] = (),
) -> Router:
    """A router with ``k`` centroids fitted on ``data`` (texts, or texts by cluster label).

    ``init``: the current router; its centroids seed the fit and its names are kept.
    ``labels``: one cluster label (or None) per text when ``data`` is a plain sequence.
    ``refine=False``: no k-means; each labelled name's centroid is the mean of its texts
    (the bootstrap, where the labels are the truth). ``ignore_labels`` never seed a name.
    ``k`` defaults to the known names plus the new labelled ones; it may not drop a name.
    """
    if isinstance(data, Mapping):
        texts = [t for texts in data.values() for t in texts]
        labels = [name for name, texts in data.items() for _ in texts]
    else:
        texts = list(data)
        labels = list(labels) if labels is not None else [None] * len(texts)
    if len(labels) != len(texts):
        raise ValueError(f"{len(labels)} labels for {len(texts)} texts")
    x = embedder.embed(texts)  # [n, dim]
    keep = np.linalg.norm(x, axis=1) > 0  # an empty text has no direction
    x, labels = x[keep], [lab for lab, ok in zip(labels, keep, strict=True) if ok]
    if not len(x):
        raise ValueError("no non-empty texts to fit a router on")
    if init is not None and (init.embedder_kind != embedder.kind or init.embedder_sha256 != embedder.config_sha256):
        raise RouterError(
            f"the current router (version {init.version}) was fitted with embedder {init.embedder_kind} "
            f"(config {init.embedder_sha256[:12]}), this fit uses {embedder.kind} "
            f"(config {embedder.config_sha256[:12]}): fit with the same embedder"
        )
    rng = np.random.default_rng(seed)

    # 1. starting centroids: the current router's, then new labelled names, then fresh ones
    names = list(init.clusters) if init is not None else []
    rows = [c for c in init.centroids] if init is not None else []
    counts = Counter(lab for lab in labels if lab and lab not in names and lab not in set(ignore_labels))
    new_labels = [lab for lab, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    k = k if k is not None else len(names) + len(new_labels)
    if k < max(1, len(names)):
        raise ValueError(
            f"k={k}: a refit keeps every cluster of the current router ({len(names)}: {names}), "
            "each has a draft lineage"
        )
    if k > len(x):
        raise ValueError(f"k={k} centroids need at least {k} non-empty texts, got {len(x)}")
    for lab in new_labels[: k - len(names)]:
        names.append(lab)
        rows.append(normalise(x[[i for i, got in enumerate(labels) if got == lab]].mean(axis=0, keepdims=True))[0])
    while len(names) < k:  # k-means++ seeding away from the centroids we have
        names.append(_fresh_name(names))
        rows.append(x[_far_point(x, np.stack(rows) if rows else None, rng)])
    start = np.stack(rows).astype(np.float32)  # [k, dim]
    if not refine:
        for j, name in enumerate(names):  # supervised: the mean of each name's texts
            members = [i for i, lab in enumerate(labels) if lab == name]
            if members:
                start[j] = normalise(x[members].mean(axis=0, keepdims=True))[0]

    # 2. spherical k-means from there (an emptied cluster keeps its centroid)
    centroids = _kmeans(x, start, iters) if refine else start

    # 3. the old names follow their centroids
    if init is not None and refine:
        order = _match(init.centroids @ centroids.T)  # order[j]: the row old name j goes to
        rest = [r for r in range(k) if r not in order]
        by_row = dict(zip(order, names[: init.k], strict=True)) | dict(zip(rest, names[init.k :], strict=True))
        names = [by_row[r] for r in range(k)]

    # 4. metrics on the fitted texts
    sims = x @ centroids.T  # [n, k]
    assign = sims.argmax(axis=1)
    dist = 1.0 - sims[np.arange(len(x)), assign]
    metrics = {"num_texts": float(len(x)), "mean_distance": float(dist.mean()), "inertia": float(dist.sum())}
    if init is not None:
        old = np.asarray(init.clusters)[(x @ init.centroids.T).argmax(axis=1)]
        metrics["agreement"] = float((np.asarray(names)[assign] == old).mean())
    fitted_on = {name: int((assign == j).sum()) for j, name in enumerate(names)}
    return Router(
        centroids=normalise(centroids),
        clusters=tuple(names),
        embedder_kind=embedder.kind,
        embedder_sha256=embedder.config_sha256,
        version=LOCAL,
        fitted_on=fitted_on,
        metrics=metrics,
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        embedder=embedder,
    )


def _kmeans(x: np.ndarray, centroids: np.ndarray, iters: int) -> np.ndarray:
    """Spherical k-means: assign by cosine, re-centre on the normalised sum, until nothing moves."""
    centroids = centroids.copy()
    assign = None
    for _ in range(iters):
        new = (x @ centroids.T).argmax(axis=1)
        if assign is not None and (new == assign).all():
            break
        assign = new
        for j in range(len(centroids)):
            total = x[assign == j].sum(axis=0)
            if np.linalg.norm(total) > 0:
                centroids[j] = total / np.linalg.norm(total)
    return centroids


def _match(sim: np.ndarray) -> list[int]:
    """For each row (old name) of ``sim`` [m, k] (m <= k) a distinct column (new centroid),
    maximising the total similarity: exhaustively for small sizes, else greedily."""
    m, k = sim.shape
    if math.perm(k, m) <= EXACT_MATCH_LIMIT:
        best = max(itertools.permutations(range(k), m), key=lambda cols: sum(sim[i, c] for i, c in enumerate(cols)))
        return list(best)
    out: dict[int, int] = {}
    for flat in np.argsort(-sim, axis=None):
        i, c = divmod(int(flat), k)
        if i not in out and c not in out.values():
            out[i] = c
    return [out[i] for i in range(m)]


def _fresh_name(names: list[str]) -> str:
    n = 0
    while f"c{n}" in names:
        n += 1
    return f"c{n}"


def _far_point(x: np.ndarray, centroids: np.ndarray | None, rng: np.random.Generator) -> int:
    """A row of ``x`` drawn with probability proportional to its squared distance to the nearest centroid."""
    if centroids is None:
        return int(rng.integers(len(x)))
    d = np.clip(1.0 - (x @ centroids.T).max(axis=1), 0.0, None) ** 2
    return int(rng.choice(len(x), p=d / d.sum())) if d.sum() > 0 else int(rng.integers(len(x)))


# ---------------------------------------------------------------- the first router
def bootstrap_texts(
    model_dir: Path, *, per_domain: int = 200, chars: int = 600, per_doc: int = 2, seed: int = 0
) -> dict[str, list[str]]:
    """Up to ``per_domain`` snippets of ``chars`` characters per domain, from the bootstrap's
    training documents (never the held-out ones the demo prompts come from), each starting
    at a line break, at most ``per_doc`` per document."""
    from specops.trainer.bootstrap import load_manifest
    from specops.trainer.bootstrap.corpus import read_document

    manifest = load_manifest(Path(model_dir))
    rng = random.Random(seed)
    out: dict[str, list[str]] = {}
    for domain, split in sorted(manifest["domains"].items()):
        heldout = set(split.get("heldout", ()))
        paths = [p for p in split["train"] if p not in heldout]
        rng.shuffle(paths)
        snippets: list[str] = []
        for path in paths:
            text = read_document(path, domain)
            if text is None or len(text) < chars // 2:
                continue
            breaks = [i + 1 for i, ch in enumerate(text[: max(1, len(text) - chars)]) if ch == "\n"] or [0]
            for start in sorted(rng.sample(breaks, min(per_doc, len(breaks)))):
                snippet = text[start : start + chars].strip()
                if len(snippet) >= chars // 4:
                    snippets.append(snippet)
            if len(snippets) >= per_domain:
                break
        if snippets:
            out[domain] = snippets[:per_domain]
        else:
            log.warning("bootstrap router: no training text of domain %s is readable here", domain)
    if not out:
        raise ValueError(f"no readable training documents in the bootstrap at {model_dir}")
    return out


def bootstrap_router(
    model_dir: Path, embedder: Embedder, *, per_domain: int = 200, chars: int = 600, seed: int = 0
) -> Router:
    """The first router: one centroid per bootstrap domain, the mean of its training snippets."""
    data = bootstrap_texts(model_dir, per_domain=per_domain, chars=chars, seed=seed)
    router = fit_router(data, embedder, seed=seed, refine=False)
    log.info(
        "bootstrap router: clusters %s from %s training snippets (mean distance %.3f)",
        ",".join(router.clusters),
        {d: len(t) for d, t in data.items()},
        router.metrics["mean_distance"],
    )
    return router


# ---------------------------------------------------------------- refits from traffic
@dataclass
class RefitConfig:
    """How the router is refitted from ``spec.generations``."""

    group: str = "router-refit"
    """Consumer group on ``spec.generations`` (its own: no other consumer's offsets move)."""
    min_records: int = 50
    """Prompts buffered before a refit runs."""
    buffer_size: int = 2000
    """Most recent prompts kept for refits, in memory: a restart re-reads the uncommitted
    records only, so after one the buffer refills from new traffic."""
    k: int | None = None
    """Centroids; None = the champion's clusters plus clusters named by new labels."""
    min_agreement: float = 0.5
    """Promote only if at least this fraction of the buffered prompts keep the champion's cluster."""
    ignore_labels: tuple[str, ...] = ("default",)
    """Record clusters that name no topic (serving's fallback) and never seed a centroid."""
    max_chars: int = 4000
    """Characters of each decoded prompt kept (the embedders truncate to far fewer tokens)."""
    poll_records: int = 500
    poll_timeout_s: float = 1.0
    max_polls: int = 100
    """Polls per run at most (a run stops earlier at the first empty poll)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.min_records < 1 or self.buffer_size < self.min_records:
            raise ValueError(f"need 1 <= min_records <= buffer_size, got {self.min_records} and {self.buffer_size}")
        if self.k is not None and self.k < 1:
            raise ValueError(f"k must be >= 1 or None, got {self.k}")
        if not 0.0 <= self.min_agreement <= 1.0:
            raise ValueError(f"min_agreement must be in [0, 1], got {self.min_agreement}")


@dataclass(frozen=True)
class RefitResult:
    """What one refit run did."""

    status: str
    """``promoted``, ``registered`` (the gate kept the champion), ``waiting`` (too few prompts) or
    ``no_new_records``."""
    consumed: int
    """Records consumed by this run."""
    buffered: int
    """Prompts in the buffer after consuming."""
    version: str = ""
    """Registered router version (empty when nothing was registered)."""
    reason: str = ""
    """The gate's reason."""
    metrics: dict[str, float] = field(default_factory=dict)


class RouterRefitter(Rebuilder[Router]):
    """Refits the router from served prompts. One :meth:`run_once` (``specops.trainer.rebuild.Rebuilder``)
    reads top to bottom:

    1. **consume** GenerationRecords from ``spec.generations`` in its own consumer group;
       decode each prompt with the target's tokenizer into a bounded buffer;
    2. **build**: fit on the buffer, seeded from ``router@champion`` (names stay stable);
    3. **gate**: finite unit centroids, every champion cluster kept, agreement with the
       champion's assignments >= ``min_agreement`` (or no champion yet);
    4. **register** the new version (lineage: offsets consumed since the last commit;
       metrics) and 5. **promote** it when the gate passed;
    6. **commit** the offsets, only now: a crash before this re-reads the records.
    """

    kind = "router"
    gate_name = "refit gate"

    def __init__(
        self,
        stream_cfg: StreamConfig,
        registry: RegistryStore,
        tokenizer,
        embedder: Embedder,
        cfg: RefitConfig | None = None,
    ) -> None:
        super().__init__(stream_cfg, registry, cfg or RefitConfig())
        self.tokenizer = tokenizer
        self.embedder = embedder
        self.buffer: deque[tuple[str, str, tuple[str, int, int]]] = deque(maxlen=self.cfg.buffer_size)
        """(prompt text, record cluster, (topic, partition, offset)), oldest first."""
        self._in_buffer: set[tuple[str, int, int]] = set()
        self._new = 0

    def consume(self) -> int:
        """Step 1: buffer every new prompt; returns the records consumed."""
        n = 0
        for source, rec in self.reader.records():
            n += 1
            if source in self._in_buffer:  # redelivered after a rebalance: buffered once
                continue
            # the request's own prompt: references or retrieved passages in its context are not what it asked
            text = self.tokenizer.decode([int(t) for t in rec.request_prompt_ids], skip_special_tokens=True)
            if len(self.buffer) == self.buffer.maxlen:
                self._in_buffer.discard(self.buffer[0][2])
            self.buffer.append((text[: self.cfg.max_chars], rec.cluster, source))
            self._in_buffer.add(source)
            self._new += 1
        return n

    def champion(self) -> Router | None:  # type: ignore[override]
        """``router@champion``, fetched, verified and loaded once per version (None before the first)."""
        held = super().champion("", lambda path, version: Router.load(path, version=version))
        return held[1] if held is not None else None

    def start(self, consumed: int) -> dict:
        return {"consumed": consumed}

    def due(self) -> list[str]:
        if not self._new:
            return []
        if len(self.buffer) < self.cfg.min_records:
            log.info("router refit: %d prompts buffered, waiting for %d", len(self.buffer), self.cfg.min_records)
            return []
        return [""]

    def build(self, key: str) -> Candidate:
        init = self.champion()
        texts, labels = [b[0] for b in self.buffer], [b[1] for b in self.buffer]
        router = fit_router(
            texts,
            self.embedder,
            self.cfg.k,
            init=init,
            labels=labels,
            seed=self.cfg.seed,
            ignore_labels=self.cfg.ignore_labels,
        )
        return Candidate(router, {"init": init, "records_used": len(texts)})

    def gate(self, key: str, c: Candidate) -> tuple[bool, str]:
        return gate(c.artifact, c.info["init"], self.cfg.min_agreement)

    def register(self, key: str, c: Candidate) -> ArtifactVersion:
        router, init = c.artifact, c.info["init"]
        lineage = self.reader.lineage()
        source_id = f"{self.cfg.group}/" + sha256_json(lineage)[:16]
        c.info["metrics"] = metrics = {
            **router.metrics,
            "records_used": float(c.info["records_used"]),
            "gate_passed": float(c.passed),
        }
        with tempfile.TemporaryDirectory(prefix="specops-router-") as tmp:
            return self.artifacts.register(
                "",
                router.save(Path(tmp) / "router"),
                metrics=metrics,
                lineage=lineage,
                source_id=source_id,
                parent_version=init.version if init is not None else None,
                params={
                    "gate_reason": c.reason,
                    "k": router.k,
                    "clusters": ",".join(router.clusters),
                    "fitted_on": json.dumps(router.fitted_on, sort_keys=True),
                    "embedder": self.embedder.kind,
                    "min_agreement": self.cfg.min_agreement,
                    "buffer_size": self.cfg.buffer_size,
                },
            )

    def record(self, key: str, c: Candidate, result: dict) -> None:
        self._new = 0
        result["candidate"] = c
        log.info(
            "router refit: version %s %s (%s); clusters %s",
            c.version.version,
            "promoted" if c.passed else "registered, not promoted",
            c.reason,
            c.artifact.fitted_on,
        )

    def finish(self, result: dict) -> RefitResult:
        consumed, c = result["consumed"], result.get("candidate")
        if c is None:
            return RefitResult("waiting" if self._new else "no_new_records", consumed, len(self.buffer))
        return RefitResult(c.outcome, consumed, len(self.buffer), c.version.version, c.reason, c.info["metrics"])


def gate(candidate: Router, champion: Router | None, min_agreement: float) -> tuple[bool, str]:
    """The refit's sanity gate: (passed, reason)."""
    if not np.isfinite(candidate.centroids).all():
        return False, "non-finite centroids"
    lost = [c for c in (champion.clusters if champion else ()) if c not in candidate.clusters]
    if lost:
        return False, f"clusters {lost} lost their centroid"
    if champion is None:
        return True, "no champion yet"
    agreement = candidate.metrics.get("agreement", 0.0)
    if agreement < min_agreement:
        return False, f"only {agreement:.2f} of the prompts keep their cluster (< {min_agreement})"
    return True, f"{agreement:.2f} of the prompts keep their cluster (>= {min_agreement})"


def refit_from_stream(
    stream_cfg: StreamConfig,
    registry: RegistryStore,
    tokenizer,
    embedder: Embedder,
    *,
    group: str = "router-refit",
    min_records: int = 50,
    k: int | None = None,
    **kw,
) -> RefitResult:
    """One refit now (``specops router fit``): consume, fit, gate, register, promote, commit."""
    refitter = RouterRefitter(
        stream_cfg, registry, tokenizer, embedder, RefitConfig(group=group, min_records=min_records, k=k, **kw)
    )
    try:
        return refitter.run_once()
    finally:
        refitter.close()
