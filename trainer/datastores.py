"""DReSD datastores on the trainer side: their documents, their offline evaluation, their build.

- :func:`corpus_documents`: the out-of-distribution documents, snippets of the bootstrap's
  training text (code and prose; never its held-out files), tokenized;
- :func:`offline_mar`: a datastore's mean acceptance rate (MAR, DReSD §4.3: accepted / drafted
  per document, averaged over documents) replayed on held-out target generations;
- :func:`build_and_register`: build, describe and register ``datastore-<cluster>`` with lineage.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from serving.retrieval.datastore import Datastore, DatastoreConfig
from serving.retrieval.keys import target_hidden_states

log = logging.getLogger(__name__)


def corpus_documents(model_dir: Path, tokenizer, *, per_domain: int = 400, chars: int = 2000,
                     seed: int = 0) -> list[list[int]]:  # fmt: skip
    """Token ids of up to ``per_domain`` snippets of ``chars`` characters per bootstrap domain."""
    from trainer.router_fit import bootstrap_texts

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


def offline_mar(store: Datastore, target, docs: Sequence[Sequence[int]], starts: Sequence[int], *, n_drafts: int = 3,
                k: int = 10, batch_tokens: int = 4096) -> MarResult:  # fmt: skip
    """Replay greedy DReSD over each document's output (positions ``starts[i]`` on): at each
    step the drafts come from the hidden state before the step's first token, the accepted
    length is the longest prefix of any row that matches the document, and the step emits
    accepted + 1 tokens. For greedy target outputs this is exactly what serving would accept."""
    per_doc, steps, accepted_total = [], 0, 0
    for i, hidden in target_hidden_states(target, docs, batch_tokens=batch_tokens):
        doc = list(docs[i])
        t = max(1, int(starts[i]))  # position of the first output token; its hidden state is at t - 1
        drafted = accepted = 0
        first = True
        while t < len(doc) - 1:
            if first:  # the first step is the prefill: nothing drafted
                first, t = False, t + 1
                continue
            rows = store.drafts(hidden[t - 1], doc[t], n_drafts=n_drafts, length=min(k, len(doc) - t - 1))
            best = 0
            for row in rows:
                n = 0
                while n < len(row) and t + 1 + n < len(doc) and row[n] == doc[t + 1 + n]:
                    n += 1
                best = max(best, n)
            drafted += max((len(r) for r in rows), default=0)
            accepted += best
            steps += 1
            t += best + 1
        accepted_total += accepted
        if drafted:
            per_doc.append(accepted / drafted)
        else:
            per_doc.append(0.0)
    return MarResult(float(np.mean(per_doc)) if per_doc else 0.0, accepted_total / steps if steps else 0.0,
                     len(per_doc), steps)  # fmt: skip


def build_and_register(registry, cluster: str, target, docs: Sequence[Sequence[int]], cfg: DatastoreConfig, *,
                       tokenizer_sha256: str = "", lineage: dict | None = None, metrics: dict | None = None,
                       source_id: str | None = None, alias: str | None = "challenger", progress=None):  # fmt: skip
    """Build a datastore over ``docs`` and register it as a version of ``datastore-<cluster>``."""
    store, stats = Datastore.build(target, docs, cfg, meta={"tokenizer_sha256": tokenizer_sha256,
                                                            "cluster": cluster}, progress=progress)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="specops-datastore-") as tmp:
        store.save(Path(tmp) / "ds")
        version = registry.artifact("datastore").register(
            cluster, Path(tmp) / "ds", meta={"config_hash": cfg.hash()},
            tags={"config_hash": cfg.hash(), "tokenizer_sha256": tokenizer_sha256,
                  "num_entries": str(store.num_entries), "bytes_per_entry": f"{store.bytes_per_entry:.1f}"},
            metrics={"num_entries": float(store.num_entries), "bytes_per_entry": store.bytes_per_entry,
                     "embed_tokens_per_s": stats.embed_tokens_per_s, **(metrics or {})},
            lineage=lineage, source_id=source_id, alias=alias)  # fmt: skip
    log.info("datastore-%s: registered version %s (%d entries from %d documents, %.0f bytes/entry; keys at %.0f "
             "tokens/s)", cluster, version.version, store.num_entries, stats.num_docs, store.bytes_per_entry,
             stats.embed_tokens_per_s)  # fmt: skip
    return store, stats, version
