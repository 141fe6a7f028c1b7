"""The engines benchmark's workload and its learned draft.

**Prompts.** Held-out text-to-SQL chat requests (``specops.workloads.chat_workload``, rendered with the
chat template as ``/v1/chat/completions`` renders them, as token ids). The workload's seeded
order is split into a held-out part of :data:`HELDOUT_RESERVE` prompts first and the learning
traffic after it, so the held-out prompts stay the same whatever ``--learn`` is, and are never
among the requests the draft learned from.

**The learned draft** is the product's learned champion for the sql domain, made the way
``benchmarks/osd.py`` makes it: ``--learn N`` distinct sql chat requests are served by replay
of the target's greedy continuation, logged as serving logs them, and consumed by the real
``OnlineTrainer``; each candidate goes through the promotion gate (``gate_decision``) and the
champion is what serving would run after the N-th request. It is saved as a Hugging Face
directory (float32 weights, the bootstrap draft's tokenizer and its other files, e.g.
``draft_vocab.json``) and cached beside the models (``<models>/../engines/learned-sql-N<N>``),
keyed by the settings in its ``learned.json``. ``--quick`` replaces learning by a randomly
perturbed copy of the tiny draft (the point there is the plumbing, not the α).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HELDOUT_RESERVE = 64
"""Prompts kept aside at the head of the workload's order; ``--prompts`` must not exceed it."""
DOMAIN = "sql"
LEARN_MAX_NEW = 48
"""Tokens per learning request (the OSD benchmark's default, so its continuation cache is shared)."""
WEIGHT_FILES = {"model.safetensors", "config.json", "generation_config.json", "learned.json"}


@dataclass(frozen=True)
class WorkloadPrompt:
    kind: str
    """``chat/<domain>`` or ``completion/<domain>``."""
    token_ids: list[int]


CHAT_DOMAINS = ("sql", "math", "api")
COMPLETION_DOMAINS = ("code", "prose")
COMPLETION_TOKENS = 96


def workload_prompts(tokenizer, model_dir: Path, n: int, seed: int, workload: str = "mixed") -> list[WorkloadPrompt]:
    """The engines benchmark's ``n`` held-out prompts (``benchmarks/engines.py``'s docstring).

    ``sql``: the first ``n`` held-out sql chat prompts. ``mixed``: half chat prompts, round robin
    over :data:`CHAT_DOMAINS` (each domain's held-out head, never learned from), and half plain
    completions, round robin over :data:`COMPLETION_DOMAINS` (windows of the bootstrap's held-out
    files), interleaved chat, completion, chat, ..."""
    if workload == "sql":
        return [WorkloadPrompt(f"chat/{DOMAIN}", ids) for ids in heldout_prompts(tokenizer, n, seed)]
    from specops.workloads.chat_workload import chat_workload
    from specops.workloads.prompts import heldout_prompts as completion_prompts

    n_chat = (n + 1) // 2
    per = -(-n_chat // len(CHAT_DOMAINS))
    parts = chat_workload(tokenizer, {"heldout": max(per, HELDOUT_RESERVE)}, domains=CHAT_DOMAINS, seed=seed)
    chat = [WorkloadPrompt(f"chat/{d}", parts[d]["heldout"][i].token_ids) for i in range(per) for d in CHAT_DOMAINS][
        :n_chat
    ]
    per = -(-(n - n_chat) // len(COMPLETION_DOMAINS))
    by_domain = {
        d: completion_prompts(model_dir, tokenizer, d, per, num_tokens=COMPLETION_TOKENS, seed=seed)
        for d in COMPLETION_DOMAINS
    }
    completion = [
        WorkloadPrompt(f"completion/{d}", by_domain[d][i].token_ids)
        for i in range(per)
        for d in COMPLETION_DOMAINS
        if i < len(by_domain[d])
    ][: n - n_chat]
    if len(completion) < n - n_chat:
        raise ValueError(
            f"the bootstrap's held-out files give {len(completion)} completion prompts, {n - n_chat} asked for"
        )
    out = []
    for i in range(max(len(chat), len(completion))):
        out += ([chat[i]] if i < len(chat) else []) + ([completion[i]] if i < len(completion) else [])
    return out


def heldout_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    """The first ``n`` held-out sql chat prompts as token ids."""
    from specops.workloads.chat_workload import chat_workload

    if n > HELDOUT_RESERVE:
        raise ValueError(f"at most {HELDOUT_RESERVE} held-out prompts, {n} asked for")
    parts = chat_workload(tokenizer, {"heldout": HELDOUT_RESERVE}, domains=(DOMAIN,), seed=seed)
    return [p.token_ids for p in parts[DOMAIN]["heldout"][:n]]


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def save_draft_dir(model: torch.nn.Module, base_dir: Path, out: Path, meta: dict) -> Path:
    """``model`` as a float32 HF directory at ``out`` with every other file of ``base_dir`` (tokenizer,
    draft vocabulary) and ``learned.json`` (``meta``); written beside and renamed into place."""
    import copy

    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    copy.deepcopy(model).float().save_pretrained(tmp, safe_serialization=True)
    for f in Path(base_dir).iterdir():
        if f.is_file() and f.name not in WEIGHT_FILES and not (tmp / f.name).exists():
            shutil.copy2(f, tmp / f.name)
    (tmp / "learned.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def cached(out: Path, key: dict) -> bool:
    try:
        return json.loads((out / "learned.json").read_text()).get("key") == key
    except (OSError, ValueError):
        return False


def perturbed_draft(model_dir: Path, out: Path, seed: int = 0, scale: float = 0.05) -> tuple[Path, dict]:
    """``--quick``'s stand-in for learning: the draft with seeded Gaussian noise (``scale`` × each
    tensor's std) added to every weight."""
    from specops.core.models import load_model

    base = model_dir / "draft"
    model = load_model(base)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * float(p.float().std()))
    info = {"kind": "perturbed", "scale": scale, "seed": seed}
    return save_draft_dir(model, base, out, {"key": info, **info}), info


def learn(model_dir: Path, n: int, *, seed: int, threads: int, out: Path | None = None) -> tuple[Path, dict]:
    """The gated champion after ``n`` sql chat requests (see the module docstring); cached."""
    from benchmarks import osd
    from specops.core.models import load_model_dir
    from specops.serving.proposers.catalogue import DEFAULT_K
    from specops.workloads.chat_workload import chat_workload

    model_dir = Path(model_dir)
    base = model_dir / "draft"
    out = out or model_dir.parent / "engines" / f"learned-{DOMAIN}-n{n}"
    ns = argparse.Namespace(
        k=DEFAULT_K["draft"],
        max_new_tokens=LEARN_MAX_NEW,
        check_every=0,
        audit_window=0,
        interval=None,
        lr=None,
        steps=None,
        loss=None,
        positions=None,
        replay=None,
        capacity=None,
    )
    ocfg = osd.online_config(ns)
    key = {
        "kind": "learned",
        "domain": DOMAIN,
        "requests": n,
        "seed": seed,
        "heldout_reserve": HELDOUT_RESERVE,
        "max_new_tokens": LEARN_MAX_NEW,
        "k": ns.k,
        "base_draft": file_digest(base / "model.safetensors"),
        "target": file_digest(model_dir / "target" / "model.safetensors"),
        "recipe": osd._recipe(ocfg),
    }
    if cached(out, key):
        info = json.loads((out / "learned.json").read_text())
        return out, {**info, "cached": True}
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    pair = load_model_dir(model_dir, draft_dtype="float32")  # the trainer trains and evaluates in float32
    parts = chat_workload(pair.tokenizer, {"heldout": HELDOUT_RESERVE, "served": n}, domains=(DOMAIN,), seed=seed)
    served = osd.continuations(pair, parts[DOMAIN]["served"], LEARN_MAX_NEW, model_dir / "cache" / "osd-chat", 16)
    with tempfile.TemporaryDirectory(prefix="specops-engines-learn-") as tmp:
        run = osd.learning_run(
            pair,
            base,
            pair.draft,
            [(s, DOMAIN) for s in served],
            {},
            ns,
            Path(tmp),
            label="learn",
            ocfg=ocfg,
            audit=False,
        )
    promoted = [g for g in run["gates"] if g["promoted"]]
    rows = run["rows"]
    window = min(50, max(1, len(rows) // 4))
    info = {
        "key": key,
        **key,
        "champion_version": promoted[-1]["candidate"] if promoted else 0,
        "candidates": len(run["gates"]),
        "promotions": len(promoted),
        "served_alpha_token_first": osd.pooled(rows[:window]),
        "served_alpha_token_last": osd.pooled(rows[-window:]),
        "served_alpha_window": window,
        "learn_s": time.perf_counter() - t0,
    }
    save_draft_dir(run["drafts"]["gated"][DOMAIN], base, out, info)
    return out, {**info, "cached": False}
