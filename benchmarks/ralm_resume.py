"""``benchmarks/ralm.py --resume PATH``: a run at the benchmark's defaults (30 questions, 3 runs,
seven points, the ablations, kNN-LM at two sizes) takes longer than one working session, so it
checkpoints after every wave and every kNN-LM datastore size, and a later run with the same
``--resume PATH`` (on this machine or another, the file committed in between) goes on from there.

What makes a resumed run one run: the settings that shape the measurement (:data:`RESUME_KEYS`)
must equal the checkpoint's, or the run stops and says which differs (points may be added after
the checkpoint's: the finished ones stand); the questions come from the
checkpoint, not from re-reading this machine's sources; a point half done keeps its waves only if
its knowledge base describes itself the same (passages, sources, chunking, retrievers), and every
point records the CPU it ran on. Waves finished are never rerun; the wave in flight when a session
ended is. The file is written atomically (a crash mid-write leaves the previous checkpoint).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from benchmarks.common import cpu_model

RESUME_KEYS = (
    "points",
    "questions",
    "max_new_tokens",
    "runs",
    "ablations",
    "ablate_at",
    "no_knnlm",
    "no_curve",
    "knnlm_sizes",
    "knnlm_k",
    "knnlm_prompts",
    "knnlm_new_tokens",
    "kb_cores",
)
"""Arguments a resumed run must share with the checkpoint."""


def _extends(saved, now) -> bool:
    """Whether the run's points (``str`` of their list) are the checkpoint's with more after them."""
    if not isinstance(saved, str) or not isinstance(now, str) or not saved.endswith("]"):
        return False
    head = saved[:-1]
    return now == saved or (now.startswith(head) and now[len(head) : len(head) + 2] == ", ")


def _ablated_in_scope(saved: dict) -> bool:
    """Whether a checkpoint written before ``ablate_at`` existed (when ``--ablations`` meant every
    point) measured only points that the narrower scope ablates too: the in-memory exact points.
    Then the points it finished keep their ablation arms and the run goes on under the new scope."""
    partial = (saved.get("partial") or {}).get("so_far") or {}
    done = [*saved.get("points", []), *([partial] if partial else [])]
    return not saved["settings"].get("ablations") or all(
        p.get("backend") == "memory" and p.get("retriever") == "exact" for p in done
    )


def kb_fingerprint(kb) -> dict:
    """What a resumed point's KB must match: its description without its build time."""
    return _comparable(kb.describe())


def _comparable(described: dict) -> dict:
    """A KB description without what does not shape the passages: build time, version, and which file
    the held-out list was read from (a bootstrap manifest, or the same split recomputed from the seed
    where the model dir has none); the list's effect (``heldout_excluded``, ``passages``) stays."""
    out = {k: v for k, v in described.items() if k not in ("build_s", "version")}
    if isinstance(out.get("sources"), dict):
        out["sources"] = {k: v for k, v in out["sources"].items() if k != "heldout_origin"}
    return out


def cpus_of(rows: list[dict]) -> str:
    """The CPU(s) that measured a point's waves: one model, or each with its count of waves
    when a resumed point ran on more than one machine (every wave's arms ran on one CPU, so each
    wave's ratios are like for like; the pooled times mix machines)."""
    counts: dict[str, int] = {}
    for row in rows:
        cpu = row.get("cpu") or cpu_model()
        counts[cpu] = counts.get(cpu, 0) + 1
    if len(counts) <= 1:
        return next(iter(counts), cpu_model())
    return ", ".join(f"{cpu} ({n} wave{'s' if n > 1 else ''})" for cpu, n in counts.items())


class Checkpoint:
    """The run so far; every method is a no-op without a path (no ``--resume``)."""

    def __init__(self, path: Path | None, settings: dict) -> None:
        self.path, self.t0 = path, time.perf_counter()
        self.data: dict = {"settings": settings, "points": [], "partial": None, "question_list": None, "knnlm": {}}
        self.data["sessions"] = []
        if path is not None and path.exists():
            saved = json.loads(path.read_text())
            for key in RESUME_KEYS:
                if key == "points" and _extends(saved["settings"].get(key), settings.get(key)):
                    continue  # points added after the checkpoint's run: the finished ones stand
                if key == "ablate_at" and key not in saved["settings"] and _ablated_in_scope(saved):
                    saved["settings"][key] = settings.get(key)  # a checkpoint from before the option
                    continue
                if saved["settings"].get(key) != settings.get(key):
                    raise SystemExit(
                        f"--resume {path}: it was run with {key}={saved['settings'].get(key)!r}, this run has "
                        f"{settings.get(key)!r}; run with the checkpoint's settings or another --resume file"
                    )
            self.data = saved
        self.data["sessions"].append(
            {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpu": cpu_model()}
        )
        self._base_wall = sum(s.get("wall_s", 0.0) for s in self.data["sessions"][:-1])

    @property
    def wall_s(self) -> float:
        """Wall time over every session of the run."""
        return self._base_wall + time.perf_counter() - self.t0

    def resumed(self) -> bool:
        return len(self.data["sessions"]) > 1

    # ------------------------------------------------------------------ the curve
    def point(self, i: int) -> dict | None:
        """Point ``i``'s summary when an earlier session finished it."""
        return self.data["points"][i] if i < len(self.data["points"]) else None

    def rows(self, i: int, fingerprint: dict) -> list[dict]:
        """Point ``i``'s waves measured before; [] when none (or a different KB: then it starts over)."""
        part = self.data.get("partial")
        if not part or part["index"] != i:
            return []
        if _comparable(part["kb"]) != _comparable(fingerprint):
            raise SystemExit(
                f"--resume {self.path}: point {i}'s knowledge base differs from the checkpoint's "
                f"({part['kb']} there, {fingerprint} here); its waves cannot be continued"
            )
        return part["rows"]

    def save_rows(self, i: int, fingerprint: dict, rows: list[dict], so_far: dict | None = None) -> None:
        """Point ``i``'s waves so far; ``so_far``: their summary (what a partial reading quotes)."""
        for row in rows:  # each wave says which CPU measured it (a point can span machines)
            row.setdefault("cpu", cpu_model())
        self.data["partial"] = {"index": i, "kb": fingerprint, "rows": rows, "cpu": cpu_model()}
        if so_far is not None:
            self.data["partial"]["so_far"] = so_far
        self._write()

    def save_point(self, i: int, point: dict) -> None:
        assert i == len(self.data["points"]), (i, len(self.data["points"]))
        self.data["points"].append({**point, "cpu": point.get("cpu") or cpu_model()})
        self.data["partial"] = None
        self._write()

    def questions(self) -> list[dict] | None:
        return self.data.get("question_list")

    def save_questions(self, questions: list[dict]) -> None:
        self.data["question_list"] = questions
        self._write()

    # ------------------------------------------------------------------ kNN-LM
    def knnlm(self, entries: int) -> dict | None:
        return self.data["knnlm"].get(str(entries))

    def save_knnlm(self, entries: int, section: dict) -> None:
        self.data["knnlm"][str(entries)] = {**section, "cpu": cpu_model()}
        self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        self.data["sessions"][-1]["wall_s"] = round(time.perf_counter() - self.t0, 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)
