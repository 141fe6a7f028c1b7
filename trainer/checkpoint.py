"""Durable per-cluster state of the online trainer: safetensors and JSON only.

Layout under the trainer's ``--out`` directory::

    <cluster>/v000003/model.safetensors, config.json   the draft (save_pretrained)
    <cluster>/v000003/optimizer.safetensors            optimiser tensors (AdamW moments, step)
    <cluster>/v000003/trained.safetensors              the trained weights, when the draft above is their
                                                       moving average (``OnlineConfig.average_decay``)
    <cluster>/v000003/state.json                       version, counters, metrics, lineage, optimiser layout
    <cluster>/LATEST                                   "v000003", replaced atomically
    <cluster>/buffer.msgpack                           replay buffer + held-out records (encoded records)
    <cluster>/updates.jsonl                            one line per update (history for people and tests)

A version directory is written under a temporary name, fsynced and renamed, then
``LATEST`` is replaced: a crash leaves either the old or the new version, never half of
one. Nothing is ever unpickled: optimiser state is split into tensors (safetensors) and
plain values (JSON).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack
import torch
from safetensors.torch import load_file, save_file

KEEP_VERSIONS = 3
TRAINED_FILE = "trained.safetensors"
"""The trained parameters of a version whose published weights are their moving average."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new one."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def optimizer_to_files(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split ``opt.state_dict()`` into tensors and a JSON-able layout."""
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, state in sd["state"].items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(idx), {})[name] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_files(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], layout: dict[str, Any]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    for idx, values in layout.get("scalars", {}).items():
        state.setdefault(int(idx), {}).update(values)
    opt.load_state_dict({"state": state, "param_groups": layout["param_groups"]})


def save_version(
    root: Path,
    cluster: str,
    version: int,
    model: Any,
    opt: torch.optim.Optimizer | tuple[dict[str, torch.Tensor], dict[str, Any]],
    state: dict,
    extra_files: dict[str, Path] | None = None,
    trained: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write draft + optimiser + state as version ``version`` of ``cluster`` and point LATEST at it.

    ``opt`` is the optimiser, or its state already split by ``optimizer_to_files`` (a
    DeepSpeed engine's, gathered from every rank by ``specops.trainer.ds_backend.optimizer_files``).

    ``extra_files`` (name -> source) are copied in beside the weights: files of the base
    draft that serving needs with every version (its ``draft_vocab.json``).

    ``trained`` (parameter name -> tensor): the weights the optimiser trains, when ``model`` is
    their moving average; kept beside the optimiser state so a restart resumes both."""
    cdir = root / cluster
    cdir.mkdir(parents=True, exist_ok=True)
    name = f"v{version:06d}"
    tmp = cdir / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
    model.save_pretrained(tmp, safe_serialization=True)
    for fname, src in (extra_files or {}).items():
        shutil.copyfile(src, tmp / fname)
    tensors, layout = opt if isinstance(opt, tuple) else optimizer_to_files(opt)
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    if trained is not None:
        save_file({k: v.detach().cpu().contiguous() for k, v in trained.items()}, str(tmp / TRAINED_FILE))
    (tmp / "state.json").write_text(json.dumps({**state, "version": version, "optimizer": layout}, indent=1))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    final = cdir / name
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(cdir)
    write_atomic(cdir / "LATEST", name.encode())
    for old in sorted(p for p in cdir.glob("v??????") if p.name != name)[: -(KEEP_VERSIONS - 1) or None]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_version(root: Path, cluster: str) -> Path | None:
    """The directory LATEST points to, or None when the cluster has no checkpoint."""
    pointer = root / cluster / "LATEST"
    if not pointer.exists():
        return None
    path = root / cluster / pointer.read_text().strip()
    return path if (path / "state.json").exists() else None


def load_state(path: Path) -> dict:
    return json.loads((path / "state.json").read_text())


def load_optimizer_files(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A version's optimiser state as (tensors, layout), for ``optimizer_from_files``."""
    return load_file(str(path / "optimizer.safetensors")), load_state(path)["optimizer"]


def load_trained(path: Path) -> dict[str, torch.Tensor] | None:
    """A version's trained weights (``TRAINED_FILE``), None when it published them as they were.
    Raises ``ValueError`` on a non-finite value: a corrupt file must not be trained on."""
    file = path / TRAINED_FILE
    if not file.is_file():
        return None
    tensors = load_file(str(file))
    bad = sorted(k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all()))
    if bad:
        raise ValueError(f"{file}: non-finite values in {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}")
    return tensors


def save_buffer(root: Path, cluster: str, payload: dict) -> None:
    """Persist a cluster's buffered records (``payload`` holds bytes and ints only)."""
    (root / cluster).mkdir(parents=True, exist_ok=True)
    write_atomic(root / cluster / "buffer.msgpack", msgpack.packb(payload, use_bin_type=True))


def load_buffer(root: Path, cluster: str) -> dict | None:
    path = root / cluster / "buffer.msgpack"
    if not path.exists():
        return None
    return msgpack.unpackb(path.read_bytes(), raw=False)


def append_history(root: Path, cluster: str, entry: dict) -> None:
    (root / cluster).mkdir(parents=True, exist_ok=True)
    with open(root / cluster / "updates.jsonl", "a") as f:
        f.write(json.dumps({"time": time.time(), **entry}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def history_version(root: Path, cluster: str) -> int:
    """The version of the cluster's last complete history line (0 without one). A line torn
    by a kill in mid-write is cut off here, so the next append starts on a line of its own."""
    path = root / cluster / "updates.jsonl"
    if not path.exists():
        return 0
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        write_atomic(path, data)
    lines = data.splitlines()
    return int(json.loads(lines[-1]).get("version", 0)) if lines else 0


def last_written(root: Path, cluster: str) -> float:
    """When the cluster's checkpoint or buffer was last written (mtime; 0.0 when neither exists)."""
    times = [p.stat().st_mtime for p in (root / cluster / "LATEST", root / cluster / "buffer.msgpack") if p.exists()]
    return max(times, default=0.0)


def clusters_in(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.exists() else []
