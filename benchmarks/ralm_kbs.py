"""The knowledge bases of ``benchmarks/ralm.py``, built once into ``--cache-dir`` and reused.

- **hash** KBs of any size: the KB sources (man pages and ``/usr/share/doc`` text, the
  bootstrap's held-out files excluded) cut into overlapping 100-word windows with the
  largest word step that yields the size asked for, embedded with the hashed TF-IDF embedder
  (cheap but real: MiniLM would take hours for 10^6 passages on 2 cores);
- **minilm** KBs: the same text in ``specops kb build``'s ~100-word chunks, MiniLM embeddings;
- **Milvus**: a built KB copied into a Milvus collection, served by Milvus Lite embedded in
  this process (``milvus-lite``) or by ``milvus-lite server`` in its own process over
  loopback gRPC (``milvus-server``), as a shared KB service would be.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from specops.core.passage import Passage, token_counter
from specops.serving.retrieval.kb import KnowledgeBase, build_kb

log = logging.getLogger("benchmarks.ralm")


class SourceText:
    """The KB sources read once per run (rendering every man page takes minutes)."""

    def __init__(self, args) -> None:
        self.args = args
        self._base: list[Passage] | None = None
        self.stats: dict = {}
        self.read_s = 0.0

    def base(self) -> list[Passage]:
        if self._base is None:
            from specops.trainer.kb_sources import default_sources, passages_from_sources

            t0 = time.perf_counter()
            cap = 20_000 if self.args.quick else None
            self._base, stats = passages_from_sources(
                self.args.source or default_sources(), model_dir=self.args.model_dir, max_passages=cap
            )
            self.stats, self.read_s = stats.to_dict(), time.perf_counter() - t0
        return self._base


def cached_kb(path: Path, recipe: dict) -> KnowledgeBase | None:
    """The KB at ``path`` when it was built by this script with the same recipe, else None (removed)."""
    if not (path / "kb.json").exists():
        return None
    kb = KnowledgeBase.load(path)
    if kb.meta.get("bench") == recipe:
        return kb
    log.info("%s was built with another recipe (%s); rebuilding", path, kb.meta.get("bench"))
    shutil.rmtree(path)
    return None


def windows(base: list[Passage], target: int, width: int = 100) -> tuple[list[Passage], int]:
    """Overlapping ``width``-word windows over each document of ``base`` (consecutive passages of
    one source): the largest word step giving at least ``target`` windows (1 if none does), then
    ``target`` of them evenly spaced. Returns the windows and the step."""
    docs: list[tuple[Passage, list[str]]] = []
    for p in base:
        if docs and docs[-1][0].source == p.source and docs[-1][0].title == p.title:
            docs[-1][1].extend(p.text.split())
        else:
            docs.append((p, p.text.split()))

    def starts(n_words: int, step: int) -> list[int]:
        last = max(n_words - width, 0)
        s = list(range(0, last + 1, step))
        return s + [last] if s[-1] != last else s

    count = lambda step: sum(len(starts(len(w), step)) for _, w in docs)  # noqa: E731
    step = next((s for s in range(width, 0, -1) if count(s) >= target), 1)
    spans = [(d, s) for d, (_, w) in enumerate(docs) for s in starts(len(w), step)]
    if len(spans) > target:
        spans = [spans[i * len(spans) // target] for i in range(target)]
    out = [
        Passage(i, docs[d][0].title, " ".join(docs[d][1][s : s + width]), docs[d][0].source)
        for i, (d, s) in enumerate(spans)
    ]
    return out, step


def hash_kb(text: SourceText, passages: int, args) -> tuple[KnowledgeBase, Path]:
    """A hashed-TF-IDF KB of ``passages`` overlapping windows (exact retriever only: it is the
    index whose cost grows with the KB, which is what the curve is about)."""
    path = Path(args.cache_dir) / f"kb-hash-{passages}"
    recipe = {"sources": args.source or "default", "windows": passages, "width": 100, "embedder": "hash"}
    if kb := cached_kb(path, recipe):
        return kb, path
    base = text.base()
    t0 = time.perf_counter()
    chunks, step = windows(base, passages)
    log.info("hash KB: %d windows of 100 words every %d words over %d passages", len(chunks), step, len(base))
    meta = {"bench": recipe, "sources": text.stats, "window_step": step, "read_s": round(text.read_s, 1)}
    kb = build_kb(f"hash-{passages}", chunks, embedder="hash", retrievers=["exact"], meta=meta)
    kb.meta["build_s"]["windows"] = round(time.perf_counter() - t0 - kb.meta["build_s"]["total"], 3)
    kb.save(path)
    return kb, path


def minilm_kb(passages: int, retrievers: list[str], tok, args) -> tuple[KnowledgeBase, Path]:
    """``specops kb build``'s chunks of the KB sources, MiniLM embeddings, ``retrievers`` built."""
    from specops.trainer.kb_sources import default_sources, passages_from_sources

    path = Path(args.cache_dir) / f"kb-minilm-{passages}"
    recipe = {"sources": args.source or "default", "max_passages": passages, "embedder": "minilm"}
    recipe["retrievers"] = sorted(retrievers)
    if kb := cached_kb(path, recipe):
        return kb, path
    t0 = time.perf_counter()
    chunks, stats = passages_from_sources(
        args.source or default_sources(),
        count_tokens=token_counter(tok),
        max_passages=passages,
        model_dir=args.model_dir,
    )
    meta = {"bench": recipe, "sources": stats.to_dict(), "read_s": round(time.perf_counter() - t0, 1)}
    kb = build_kb(f"minilm-{passages}", chunks, embedder="minilm", retrievers=retrievers, meta=meta)
    kb.save(path)
    return kb, path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MilvusService:
    """A Milvus Lite data directory and how this run reaches it: embedded in this process
    (``milvus-lite``: pymilvus starts a gRPC server thread for the path) or ``milvus-lite server``
    as a child process on a loopback port (``milvus-server``)."""

    def __init__(self, backend: str, data_dir: Path, cores: set[int] | None = None) -> None:
        self.backend, self.data_dir, self.cores = backend, Path(data_dir), cores
        self.proc: subprocess.Popen | None = None
        self.uri = ""

    def start(self) -> str:
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        if self.backend == "milvus-lite":
            self.uri = str(self.data_dir)
            return self.uri
        port = _free_port()
        exe = Path(sys.executable).with_name("milvus-lite")
        cmd = [str(exe), "server", "--data-dir", str(self.data_dir), "--host", "127.0.0.1", "--port", str(port)]
        self.log_path = self.data_dir.with_suffix(".log")
        with open(self.log_path, "ab") as log_file:  # a pipe nobody reads would block a chatty server
            pin = (lambda: os.sched_setaffinity(0, self.cores)) if self.cores else None
            self.proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=pin)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"milvus-lite server exited: {self.log_path.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError("milvus-lite server did not open its port in 120 s")
        self.uri = f"http://127.0.0.1:{port}"
        return self.uri

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None
        elif self.backend == "milvus-lite":
            from milvus_lite.server_manager import server_manager_instance

            server_manager_instance.release_server(str(self.data_dir))


def milvus_kb(kb: KnowledgeBase, service: MilvusService, retriever: str):
    """``kb`` in a collection of ``service`` (copied once: the collection is named by the KB's
    content, so a later run finds it), opened as a Milvus KB with ``retriever``; the same
    embedder, so the same vectors and passage ids as ``kb``."""
    from specops.serving.retrieval.milvus.build import build_milvus_kb

    t0 = time.perf_counter()
    passages = kb.passages(range(kb.num_passages))  # already unique: ids stay the same
    mkb = build_milvus_kb(kb.name, passages, uri=service.uri, embedder=kb.embedder, retriever=retriever, meta=kb.meta)
    log.info("%s in Milvus (%s, %s): ready in %.1f s", kb.name, service.backend, service.uri, time.perf_counter() - t0)
    return mkb
