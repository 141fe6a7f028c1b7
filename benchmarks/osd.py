"""OSD benchmark: does online distillation raise acceptance on prompts it has never seen?

Reproduces the experiments of Online Speculative Decoding (Liu et al., §5) on the
bootstrapped pair, on **distinct** held-out prompts: every request of a stream is a
different window of a held-out file, and no prompt contains the text that follows
another (``specops.prompts.distinct_prompts``). A draft that improves here has learned the
target's behaviour on the domain, not memorised answers. A *recurring* workload (prompts
drawn with replacement from a pool of 40, as the demo used to) is reported separately:
that measures memory.

How a request is served. Greedy speculative decoding accepts exactly the drafts the draft
proposes from the committed prefix, and that prefix is always the target's own output;
so a request's acceptance is fixed by the target's greedy continuation and the draft's
argmax at each position of it (teacher-forced). The benchmark therefore:

1. generates each prompt's greedy continuation with the target once (batched, cached on
   disk beside the models), with the target's top-64 distribution at every position;
2. serves a request to a draft by one forward of the draft over prompt + continuation and
   replays the engine's step rule on it (k drafted per step, never past max_new_tokens):
   accepted, drafted and the rejected positions come out exactly as the engine's;
3. logs the request as serving does (``StreamLogger``: MissRecord with the target's top-64
   at the rejected positions), to a local stream an ``OnlineTrainer`` consumes in the same
   process;
4. checks itself against the real engine: every ``--check-every``-th request of each
   online arm is also decoded by ``SpecEngine`` with the draft then serving; its output
   must equal the cached continuation and its acceptance the replayed one.

Arms, on the same request sequence per domain:

- ``static``: the bootstrap draft, never updated;
- ``offline_10pct``: distilled in advance on the first 10 % of the stream, then frozen
  (the paper's baseline);
- ``online``: OSD Algorithm 1 with the trainer's defaults, every new version going
  through the promotion gate (``trainer.promote.gate_decision``, as ``specops train``
  runs it); serving swaps only promoted versions;
- ``offline_upper``: distilled in advance on a disjoint stream of the same domain (the
  paper's offline setting: distil on the train split, then serve the test split).

Also: a distribution shift code -> prose -> code (static and online), the loss ablation
(forward KL, reverse KL, JSD[0.5]), the recurring workload, and an audit of every
promotion: the promoted version and the one it replaced both serve the next
``--audit-window`` requests (paired), and a promotion that serves worse beyond noise
(the 95 % interval of the paired difference below zero) is counted.

α of a request is accepted ÷ drafted tokens. Curves are moving averages over the last
``WINDOW`` requests. Writes JSON (``--json``, with ``summary``), a PNG plot and the osd
section of ``docs/benchmarks.md``.

    .venv/bin/python benchmarks/osd.py --json benchmarks/out/osd.json
    .venv/bin/python benchmarks/osd.py --quick
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import math
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make serving/, trainer/ importable
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.common import environment, target_name, write_doc_section  # noqa: E402
from serving.engine import draft_vocab  # noqa: E402
from serving.engine.spec import DEFAULT_K, SpecEngine  # noqa: E402
from serving.engine.models import ModelPair, load_model, load_model_dir  # noqa: E402
from serving.fleet.stream_logger import LoggerConfig, RequestMeta, StreamLogger  # noqa: E402
from serving.engine.types import GenerationResult, RejectedPosition, RequestStats, SamplingParams  # noqa: E402
from specops.paths import models_dir  # noqa: E402
from specops.prompts import Prompt, distinct_prompts  # noqa: E402
from streams import StreamConfig  # noqa: E402
from trainer.acceptance import evaluate_records  # noqa: E402
from trainer.data import Example, draft_logits  # noqa: E402
from trainer.losses import TargetDist, distill_loss  # noqa: E402
from trainer.online import OnlineConfig, OnlineTrainer  # noqa: E402
from trainer.promote import PromoteConfig, gate_decision  # noqa: E402

log = logging.getLogger("bench.osd")

DOC_BEGIN = "<!-- BEGIN osd (written by benchmarks/osd.py; edits inside are overwritten) -->"
DOC_END = "<!-- END osd -->"
DOMAINS = ("code", "prose")
WINDOW = 100
"""Requests in a moving average, and in the last-window summaries."""
TOPK = 64
"""Target log-probs kept per position (as serving logs them)."""
GAIN_BAR = 0.10
RECOVERY_MARGIN = 0.05
COLORS = {"static": "tab:blue", "offline_10pct": "tab:orange", "online": "tab:green", "offline_upper": "tab:red"}


# ---------------------------------------------------------------- 1. target continuations
@dataclass
class Served:
    """A prompt and the target's greedy continuation, with its top-k distribution per position."""

    prompt: Prompt
    output: list[int]
    topk_ids: torch.Tensor  # [n_out, TOPK] int64
    topk_logprobs: torch.Tensor  # [n_out, TOPK] float32


def _cache_key(pair: ModelPair, prompts: list[Prompt], max_new: int) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"target": pair.target.config.to_dict(), "tokenizer": pair.tokenizer_sha256,
                         "eos": pair.eos_token_ids, "max_new": max_new, "topk": TOPK}, sort_keys=True,
                        default=str).encode())  # fmt: skip
    h.update(next(iter(pair.target.state_dict().values())).flatten()[:64].numpy().tobytes())
    for p in prompts:
        h.update(json.dumps(p.token_ids).encode())
    return h.hexdigest()[:20]


@torch.no_grad()  # not inference_mode: the offline arms train on these tensors
def continuations(pair: ModelPair, prompts: list[Prompt], max_new: int, cache_dir: Path, batch: int) -> list[Served]:
    """Each prompt's greedy continuation (to EOS or ``max_new``) and the target's top-k there.

    Prompts of equal length run ``batch`` at a time through ``target.generate`` (no padding,
    so each row is the same computation as alone); results are cached by content."""
    out: list[Served] = []
    eos = set(pair.eos_token_ids)
    for start in tqdm(range(0, len(prompts), batch), desc="target continuations", unit="batch", leave=False):
        chunk = prompts[start:start + batch]
        path = cache_dir / f"{_cache_key(pair, chunk, max_new)}.safetensors"
        if path.exists():
            t = load_file(str(path))
        else:
            ids = torch.tensor([p.token_ids for p in chunk])  # [b, P] (all prompts have P tokens)
            gen = pair.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                                       output_logits=True, return_dict_in_generate=True, top_k=None, top_p=None,
                                       temperature=None, pad_token_id=pair.eos_token_ids[0] if eos else 0)  # fmt: skip
            tokens = gen.sequences[:, ids.shape[1]:]  # [b, n]
            logp = torch.log_softmax(torch.stack(gen.logits, 1).float(), -1)  # [b, n, V]
            vals, tids = logp.topk(TOPK, dim=-1)
            lengths = []
            for row in tokens.tolist():
                n = len(row)
                for i, tok in enumerate(row):
                    if tok in eos:
                        n = i + 1
                        break
                lengths.append(n)
            t = {"tokens": tokens.to(torch.int32), "lengths": torch.tensor(lengths, dtype=torch.int32),
                 "topk_ids": tids.to(torch.int32), "topk_logprobs": vals.contiguous()}  # fmt: skip
            cache_dir.mkdir(parents=True, exist_ok=True)
            save_file(t, str(path))
        for i, p in enumerate(chunk):
            n = int(t["lengths"][i])
            out.append(Served(p, t["tokens"][i, :n].long().tolist(), t["topk_ids"][i, :n].long(),
                              t["topk_logprobs"][i, :n].float()))  # fmt: skip
    return out


# ---------------------------------------------------------------- 2. serving a request (replayed exactly)
@dataclass
class Outcome:
    drafted: int
    accepted: int
    steps: int
    rejected: list[tuple[int, int, int]]  # (index into the output, drafted token, emitted token)

    @property
    def alpha(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@torch.inference_mode()
def draft_argmax(draft: torch.nn.Module, served: Served) -> list[int]:
    """The draft's argmax at every output position, teacher-forced on prompt + output, as
    serving scores it (its draft vocabulary included)."""
    ids = torch.tensor([served.prompt.token_ids + served.output[:-1]])
    first = len(served.prompt.token_ids) - 1
    vocab = draft_vocab.of(draft)
    if vocab is not None:
        hidden = draft.base_model(input_ids=ids).last_hidden_state[0, first:]  # [n_out, h]
        logits = vocab.logits(draft.get_output_embeddings(), hidden)
    else:
        logits = draft(input_ids=ids).logits[0, first:]
    return logits.argmax(-1).tolist()


def replay(pred: list[int], output: list[int], k: int, max_new: int) -> Outcome:
    """The engine's greedy step rule on a known continuation (``SpecEngine.generate``): each
    step drafts ``min(k, remaining - 1)`` tokens, accepts the longest run of agreements and
    emits one more; nothing after the continuation's end (EOS or ``max_new``) counts."""
    n, j = len(output), 0
    drafted = accepted = steps = 0
    rejected = []
    while j < n:
        k_step = min(k, max_new - j - 1)
        a = 0
        while a < k_step and j + a < n and pred[j + a] == output[j + a]:
            a += 1
        drafted += max(k_step, 0)
        accepted += min(a, n - j)
        if a < k_step and j + a < n:
            rejected.append((j + a, pred[j + a], output[j + a]))
        steps += 1
        j += a + 1
    return Outcome(drafted, accepted, steps, rejected)


def serve(draft: torch.nn.Module, served: Served, k: int, max_new: int) -> Outcome:
    return replay(draft_argmax(draft, served), served.output, k, max_new)


def logged_result(served: Served, outcome: Outcome, vocab_size: int) -> GenerationResult:
    """The finished request as the engine hands it to the stream logger."""
    P = len(served.prompt.token_ids)
    rejections = []
    for idx, drafted, emitted in outcome.rejected:
        lp, ids = served.topk_logprobs[idx], served.topk_ids[idx]
        rest = max(1e-12, 1.0 - float(lp.double().exp().sum()))
        logits = torch.full((vocab_size,), math.log(rest / max(1, vocab_size - TOPK)))  # the residual, spread
        logits[ids] = lp
        rejections.append(RejectedPosition(index=P + idx, drafted_token=drafted, emitted_token=emitted,
                                           target_logits=logits))  # fmt: skip
    stats = RequestStats(method="draft", num_prompt_tokens=P, num_generated=len(served.output),
                         num_drafted=outcome.drafted, num_accepted=outcome.accepted, num_verify_steps=outcome.steps,
                         num_rejected_steps=len(rejections), finish_reason="length")  # fmt: skip
    return GenerationResult(token_ids=list(served.output), stats=stats, rejections=rejections)


# ---------------------------------------------------------------- 3. arms
def static_arm(draft: torch.nn.Module, stream: list[Served], args, label: str) -> list[dict]:
    return [{"alpha": serve(draft, s, args.k, args.max_new_tokens).alpha, "version": 0}
            for s in tqdm(stream, desc=label, unit="req", leave=False)]  # fmt: skip


def offline_distill(draft: torch.nn.Module, stream: list[Served], args, label: str) -> torch.nn.Module:
    """Forward KL to the target's top-k distribution at every output position, ``--offline-epochs`` passes
    (the trainer's loss, on every position instead of the rejected ones)."""
    model = copy.deepcopy(draft).train()
    vocab = draft_vocab.of(draft)
    model.get_input_embeddings().weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.offline_lr, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(0)
    for _ in range(args.offline_epochs):
        order = torch.randperm(len(stream), generator=g).tolist()
        for start in tqdm(range(0, len(order), args.offline_batch), desc=label, unit="batch", leave=False):
            opt.zero_grad(set_to_none=True)
            total, count = None, 0
            for j in order[start:start + args.offline_batch]:
                s = stream[j]
                P = len(s.prompt.token_ids)
                ids = torch.tensor(s.prompt.token_ids + s.output[:-1])
                rest = (1 - s.topk_logprobs.double().exp().sum(-1)).clamp_min(0).float()
                target = TargetDist.topk(s.topk_ids, s.topk_logprobs, rest)
                if vocab is not None:  # as the trainer: the target restricted to the draft vocabulary
                    target = target.restrict(vocab.token_ids)
                ex = Example(ids, torch.arange(P, len(ids) + 1), target, f"offline-{j}")
                loss = distill_loss(draft_logits(model, ex, vocab), ex.target, "fkl")  # [n_out, V or S]
                total = loss * len(s.output) if total is None else total + loss * len(s.output)
                count += len(s.output)
            (total / count).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
    model.eval()
    for p in model.parameters():
        p.requires_grad_(True)
    served = copy.deepcopy(draft)
    served.load_state_dict(model.state_dict())
    return served


def online_arm(pair: ModelPair, base_dir: Path, stream: list[Served], args, tmp: Path, *, label: str, loss: str,
               audit: bool = True, cluster: str | None = None) -> dict:  # fmt: skip
    """Serve ``stream`` while an OnlineTrainer learns from it; promoted versions swap in between
    requests. Requests go to ``cluster`` (default: their domain), one draft for the whole stream."""
    served_draft = copy.deepcopy(pair.draft)  # what serving runs (prepared, draft vocabulary attached)
    cfg = StreamConfig(url=f"local://{tmp}/{label}/log", fsync=False, num_partitions=1)
    logger = StreamLogger(cfg, LoggerConfig(), vocab_size=pair.vocab_size)
    ocfg = OnlineConfig(loss=loss, poll_timeout_s=0.01, **({"lr": args.lr} if args.lr else {}),
                        **({"interval": args.interval} if args.interval else {}))  # fmt: skip
    pcfg = PromoteConfig()
    trainer = OnlineTrainer(cfg, base_dir, tmp / label / "trainer", ocfg)
    rows, promotions, gates, checks = [], [], [], []
    version, seen_version, cpu, ref_cache = 0, 0, 0.0, None
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    engine = SpecEngine(ModelPair(target=pair.target, draft=served_draft, tokenizer=pair.tokenizer,
                                  tokenizer_sha256=pair.tokenizer_sha256))  # fmt: skip
    try:
        for i, s in enumerate(tqdm(stream, desc=label, unit="req", leave=False)):
            out = serve(served_draft, s, args.k, args.max_new_tokens)
            rows.append({"alpha": out.alpha, "version": version})
            if args.check_every and i % args.check_every == args.check_every - 1:  # 4. the real engine agrees
                res = engine.generate(s.prompt.token_ids, params, method="draft", k=args.k)
                checks.append({"request": i, "identical": res.token_ids == s.output,
                               "alpha_engine": res.stats.num_accepted / max(1, res.stats.num_drafted),
                               "alpha_replayed": out.alpha})  # fmt: skip
            name = cluster or s.prompt.domain
            meta = RequestMeta(request_id=f"{label}-{i}", cluster=name, draft_version=str(version))
            logger.log(s.prompt.token_ids, logged_result(s, out, pair.vocab_size), params, meta)
            logger.flush(30)
            c0 = time.process_time()
            while trainer.step():
                pass
            st = trainer.clusters.get(name)
            if st is not None and st.version != seen_version:  # a new candidate: the gate decides
                seen_version = st.version
                holdout = [h.record for h in st.holdout]
                cand = trainer.evaluate(name)
                key = (version, tuple(h.source for h in st.holdout))
                if ref_cache is None or ref_cache[0] != key:  # the served draft on this held-out set
                    ref_cache = (key, evaluate_records(served_draft, holdout, vocab=trainer.vocab))
                ref = ref_cache[1]
                result = gate_decision(str(st.version), str(version), cand, ref, pcfg)
                gates.append({"request": i, "candidate": st.version, "promoted": result.promoted, "reason": result.reason})
                if result.promoted:
                    if audit:
                        promotions.append(audit_promotion(served_draft, st.model, stream[i + 1:i + 1 + args.audit_window],
                                                          args, request=i, old_version=version, new_version=st.version))  # fmt: skip
                    served_draft.load_state_dict(st.model.state_dict())  # the hot-swap, between requests
                    version = st.version
            cpu += time.process_time() - c0
    finally:
        logger.close()
        trainer.close()
    return {"rows": rows, "promotions": promotions, "gates": gates, "checks": checks, "trainer_cpu_s": cpu}


def audit_promotion(served_draft: torch.nn.Module, candidate: torch.nn.Module, future: list[Served], args, *,
                    request: int, old_version: int, new_version: int) -> dict:  # fmt: skip
    """The promoted version and the one it replaces, both serving the next requests (paired)."""
    new = copy.deepcopy(served_draft)
    new.load_state_dict(candidate.state_dict())
    d = [serve(new, s, args.k, args.max_new_tokens).alpha - serve(served_draft, s, args.k, args.max_new_tokens).alpha
         for s in future]  # fmt: skip
    mean = statistics.fmean(d) if d else 0.0
    half = 1.96 * statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("inf")
    return {"request": request, "from": old_version, "to": new_version, "requests": len(d), "delta_alpha": mean,
            "ci95": half, "worse_beyond_noise": bool(d) and mean + half < 0}  # fmt: skip


# ---------------------------------------------------------------- 4. metrics
def moving(alphas: list[float], window: int = WINDOW) -> list[float]:
    return [statistics.fmean(alphas[max(0, i + 1 - window): i + 1]) for i in range(len(alphas))]


def arm_stats(rows: list[dict], **extra) -> dict:
    a = [r["alpha"] for r in rows]
    w = min(WINDOW, len(a))
    return {"summary": {"alpha_mean": statistics.fmean(a), "alpha_first": statistics.fmean(a[:w]),
                        "alpha_last": statistics.fmean(a[-w:]), "requests": len(a),
                        "versions_served": len({r["version"] for r in rows})},
            "curve": moving(a), "alphas": [round(x, 4) for x in a], **extra}  # fmt: skip


def requests_to_gain(online: list[float], static: list[float], gain: float = GAIN_BAR) -> int | None:
    """First request count n at which online α over requests (n - WINDOW, n] beats static α on the same requests by ``gain``."""
    for n in range(WINDOW, len(online) + 1):
        if statistics.fmean(online[n - WINDOW:n]) - statistics.fmean(static[n - WINDOW:n]) >= gain:
            return n
    return None


def recovery(alphas: list[float], start: int, end: int, reference: float, *, margin: float = RECOVERY_MARGIN,
             min_seen: int = 10) -> int | None:  # fmt: skip
    """Requests after the shift at ``start`` until α (mean over the trailing WINDOW requests since the
    shift) is back within ``margin`` of ``reference``; None when it never is before ``end``."""
    for n in range(start + min_seen, end + 1):
        if statistics.fmean(alphas[max(start, n - WINDOW):n]) >= reference - margin:
            return n - start
    return None


# ---------------------------------------------------------------- 5. report
def _arms(panel: dict) -> list[tuple[str, dict]]:
    return [(k, v) for k, v in panel.items() if isinstance(v, dict) and "curve" in v]


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(f"{d} (distinct prompts)", report["single_domain"][d]) for d in DOMAINS]
    panels.append(("shift: code → prose → code", report["shift"]))
    if report.get("recurring"):
        panels.append(("recurring prompts (memory), code", report["recurring"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.0 * len(panels), 3.8), sharey=True)
    for ax, (title, arms) in zip(axes, panels):
        for name, arm in _arms(arms):
            ax.plot(range(1, len(arm["curve"]) + 1), arm["curve"], label=name, lw=1.6, color=COLORS.get(name))
            for p in arm.get("promotions", []):
                ax.axvline(p["request"] + 1, color=COLORS.get(name, "grey"), alpha=0.15, lw=0.8)
        for x in arms.get("boundaries", []):
            ax.axvline(x, color="grey", ls=":", lw=1)
        ax.set_title(title)
        ax.set_xlabel("requests served")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"α (accepted / drafted, mean of last {WINDOW} requests)")
    for ax in axes:
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(report: dict) -> str:
    w = WINDOW
    lines = [f"| domain | arm | α mean | α first {w} | α last {w} | versions served | promotions (worse beyond noise) |",
             "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip

    def row(domain: str, name: str, arm: dict) -> str:
        s = arm["summary"]
        promo = arm.get("promotions")
        cell = "–" if promo is None else f"{len(promo)} ({sum(p['worse_beyond_noise'] for p in promo)})"
        return (f"| {domain} | {name} | {s['alpha_mean']:.3f} | {s['alpha_first']:.3f} | {s['alpha_last']:.3f} "
                f"| {s['versions_served']} | {cell} |")  # fmt: skip

    for d in DOMAINS:
        lines += [row(d, name, arm) for name, arm in _arms(report["single_domain"][d])]
    lines += [row("shift", name, arm) for name, arm in _arms(report["shift"])]
    if report.get("recurring"):
        lines += [row("recurring (code)", name, arm) for name, arm in _arms(report["recurring"])]
    if report.get("ablation"):
        n = report["config"]["ablation_requests"]
        lines += ["", f"Loss ablation (online, first {n} requests of each domain's stream, α over the last "
                  f"{min(w, n)}; Table 1 style):", "", "| domain | static | online FKL | online RKL | online JSD[0.5] |",
                  "|---|---:|---:|---:|---:|"]  # fmt: skip
        for d in DOMAINS:
            abl = report["ablation"][d]
            lines.append(f"| {d} | " + " | ".join(f"{abl[k]['summary']['alpha_last']:.3f}"
                                                  for k in ("static", "fkl", "rkl", "jsd")) + " |")  # fmt: skip
    return "\n".join(lines)


def _n(x: int | None) -> str:
    return "not reached" if x is None else str(x)


def doc_section(report: dict, table: str, plot_rel: str) -> str:
    c, env, s = report["config"], report["environment"], report["summary"]
    checks = s["engine_checks"]
    return "\n".join([
        DOC_BEGIN,
        "## Online distillation (`benchmarks/osd.py`)",
        "",
        "Command:",
        "",
        f"    {report['command']}",
        "",
        f"Date {report['date'][:10]}; {env['cpu_count']} CPU cores, {env['threads']} torch threads, no GPU; commit "
        f"{str(env['git_commit'])[:10]}{' (dirty)' if env['git_dirty'] else ''}. Target {c['target']}, draft "
        f"`{c['base']}`. {c['requests']} **distinct** held-out prompts per domain, never served before "
        f"(`distinct_prompts: {str(s['distinct_prompts']).lower()}`), {c['prompt_tokens']}-token prompts, up to "
        f"{c['max_new_tokens']} new tokens, greedy, k = {c['k']}. Online: the trainer's defaults (I = {c['interval']}, "
        f"{c['steps']} AdamW steps per update at lr {c['lr']}, replay `{c['replay']}` of {c['capacity']} requests, "
        f"loss FKL), every version through the promotion gate (metric `{c['gate_metric']}`), promoted versions "
        f"swapped in between requests; offline: forward KL on the target's top-{TOPK} at every output position, "
        f"{c['offline_epochs']} epochs. Run time {report['elapsed_s'] / 60:.0f} min.",
        "",
        f"![α over requests]({plot_rel})",
        "",
        table,
        "",
        f"On prompts never served before, online distillation moves α over the last {WINDOW} requests from "
        f"{s['code_static']:.3f} to {s['code_online']:.3f} on code and from {s['prose_static']:.3f} to "
        f"{s['prose_online']:.3f} on prose (offline upper bound, distilled on a disjoint stream of the same domain: "
        f"{s['code_upper']:.3f} / {s['prose_upper']:.3f}). The paper reports gains of 0.1–0.65 in α for 7B/3B targets "
        "with 160M/80M drafts.",
        "",
        "| summary | value | bar |",
        "|---|---:|---:|",
        f"| `alpha_gain_vs_static` (smallest over domains, last {WINDOW} requests, same requests) | "
        f"{s['alpha_gain_vs_static']:+.3f} | ≥ +{GAIN_BAR:.2f} |",
        f"| `requests_to_gain` (largest over domains: requests until the last {WINDOW} gain {GAIN_BAR:.2f}) | "
        f"{_n(s['requests_to_gain'])} | ≤ 1000 |",
        f"| `promotions` / `promotions_worse_beyond_noise` | {s['promotions']} / {s['promotions_worse_beyond_noise']} "
        "| – / 0 |",
        f"| `gap_to_offline_bound` (largest over domains) | {s['gap_to_offline_bound']:+.3f} | |",
        f"| `recovery_requests` (largest over the two shifts) | {_n(s['recovery_requests'])} | |",
        f"| `recurring_alpha_gain` (memory: 40 prompts served again and again) | "
        f"{s['recurring_alpha_gain']:+.3f} | |" if s.get("recurring_alpha_gain") is not None else "| recurring | not run | |",
        f"| `trainer_cpu_s_per_request` | {s['trainer_cpu_s_per_request']:.3f} | |",
        "",
        f"Promotion audit: after each promotion, the promoted version and the one it replaced both served the next "
        f"{c['audit_window']} requests of the stream (the same requests, paired); a promotion counts as *worse beyond "
        "noise* when the 95 % interval of its α difference lies below zero. Engine check: every "
        f"{c['check_every']}-th request of each online arm was also decoded by `SpecEngine`; "
        f"{checks['identical']}/{checks['n']} outputs were identical to the target's, and the engine's α equalled the "
        f"replayed one on {checks['alpha_equal']}/{checks['n']}.",
        DOC_END,
    ])  # fmt: skip


# ---------------------------------------------------------------- 6. main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-dir", default=str(models_dir()), help="bootstrap dir with target/, draft/, manifest.json")
    p.add_argument("--requests", type=int, default=None, help="distinct requests per domain (default 1000; 120 with --quick)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="tokens per prompt")
    p.add_argument("--max-new-tokens", type=int, default=None, help="new tokens per request (default 48; 32 with --quick)")
    p.add_argument("--base", choices=("bootstrap", "generic"), default="bootstrap",
                   help="starting draft: bootstrap = the bootstrap's draft/ (distilled on both domains, what serving "
                   "ships); generic = the toy pair's draft shape on hard labels only (the paper's undistilled start)")  # fmt: skip
    p.add_argument("--generic-steps", type=int, default=400, help="hard-label training steps of the generic draft")
    p.add_argument("--k", type=int, default=DEFAULT_K["draft"], help="draft tokens per step (the engine's default)")
    p.add_argument("--interval", type=int, default=None, help="online update interval I (default: the trainer's)")
    p.add_argument("--lr", type=float, default=None, help="online learning rate (default: the trainer's)")
    p.add_argument("--offline-epochs", type=int, default=2, help="offline distillation epochs (the paper's 2)")
    p.add_argument("--offline-lr", type=float, default=1e-3, help="offline learning rate")
    p.add_argument("--offline-batch", type=int, default=8, help="sequences per offline step")
    p.add_argument("--ablation-requests", type=int, default=None,
                   help="requests per domain of the loss ablation (default 300; 0 with --quick; 0 skips it)")
    p.add_argument("--recurring", type=int, default=None,
                   help="requests of the recurring-prompts run, 40 code prompts drawn with replacement (default 300; "
                   "60 with --quick; 0 skips it)")  # fmt: skip
    p.add_argument("--audit-window", type=int, default=50, help="requests each promotion is audited on")
    p.add_argument("--check-every", type=int, default=100, help="decode every N-th online request with the real engine too")
    p.add_argument("--batch", type=int, default=16, help="prompts per batched target generation")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--quick", action="store_true", help="120 requests per domain, 32 new tokens, no ablation")
    p.add_argument("--json", type=Path, default=None, help="write the full results here")
    p.add_argument("--plot", type=Path, default=REPO_ROOT / "docs" / "img" / "osd.png", help="PNG plot of α over requests")
    p.add_argument("--doc", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md", help="markdown doc to update")
    p.add_argument("--no-doc", action="store_true", help="do not write the doc")
    p.add_argument("--replot", type=Path, default=None, metavar="JSON",
                   help="re-derive the summary, plot, table and doc section from a saved --json report; runs nothing")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        report = json.loads(args.replot.read_text())
        args.json = args.json or args.replot
        return finish(report, args)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.requests = args.requests or (120 if args.quick else 1000)
    args.max_new_tokens = args.max_new_tokens or (32 if args.quick else 48)
    args.ablation_requests = (0 if args.quick else 300) if args.ablation_requests is None else args.ablation_requests
    args.recurring = (60 if args.quick else 300) if args.recurring is None else args.recurring
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model_dir = Path(args.model_dir)
    # Learning is measured in float32, the precision the trainer trains and evaluates in (serving's
    # bfloat16 draft, serving.engine.models, moves acceptance by less than this benchmark's noise).
    pair = load_model_dir(model_dir, draft_dtype="float32")
    base_dir = model_dir / "draft"
    if args.base == "generic":  # the paper's setting: a draft never distilled from the target
        from trainer.bootstrap.generic import build_generic_draft

        base_dir = build_generic_draft(model_dir, steps=args.generic_steps)
        pair = ModelPair(target=pair.target, draft=load_model(base_dir), tokenizer=pair.tokenizer,
                         tokenizer_sha256=pair.tokenizer_sha256)  # fmt: skip
    cache = model_dir / "cache" / "osd"

    # 1. distinct prompts: the served stream, a disjoint twin stream, a recurring pool
    n, twin_n = args.requests, max(1, args.requests // 2)
    streams, twins, pools = {}, {}, {}
    for d in DOMAINS:
        prompts = distinct_prompts(model_dir, pair.tokenizer, d, n + twin_n + 40, num_tokens=args.prompt_tokens, seed=7)
        if len(prompts) < n + twin_n + 40:
            log.warning("%s: only %d distinct held-out prompts; the streams are shorter", d, len(prompts))
        k_served = max(1, (len(prompts) - 40) * n // (n + twin_n))
        served = continuations(pair, prompts, args.max_new_tokens, cache, args.batch)
        streams[d], twins[d], pools[d] = served[:k_served], served[k_served:len(prompts) - 40], served[len(prompts) - 40:]
    n = min(len(v) for v in streams.values())
    streams = {d: v[:n] for d, v in streams.items()}
    everything = [s for d in DOMAINS for s in (*streams[d], *twins[d], *pools[d])]
    distinct = len({tuple(s.prompt.token_ids) for s in everything}) == len(everything)

    report: dict = {"single_domain": {}, "ablation": {}, "shift": {}, "recurring": {}}
    checks: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="specops-osd-") as tmp_s:
        tmp = Path(tmp_s)
        for d in DOMAINS:  # 2. single domain
            stream = streams[d]
            arms: dict[str, dict] = {}
            static = static_arm(pair.draft, stream, args, f"{d}/static")
            arms["static"] = arm_stats(static)
            tenth = stream[:max(1, len(stream) // 10)]
            arms["offline_10pct"] = arm_stats(static_arm(offline_distill(pair.draft, tenth, args, f"{d}/offline 10%"),
                                                         stream, args, f"{d}/offline_10pct"))  # fmt: skip
            on = online_arm(pair, base_dir, stream, args, tmp, label=f"{d}-online", loss="fkl")
            checks += on["checks"]
            arms["online"] = arm_stats(on["rows"], promotions=on["promotions"], gates=on["gates"],
                                       trainer_cpu_s=on["trainer_cpu_s"])  # fmt: skip
            arms["offline_upper"] = arm_stats(static_arm(offline_distill(pair.draft, twins[d], args, f"{d}/offline twin"),
                                                         stream, args, f"{d}/offline_upper"))  # fmt: skip
            report["single_domain"][d] = arms
            report["single_domain"][d]["requests_to_gain"] = requests_to_gain(
                [r["alpha"] for r in on["rows"]], [r["alpha"] for r in static])
            if args.ablation_requests:  # loss ablation on the first requests of the stream
                sub = stream[:args.ablation_requests]
                abl = {"static": arm_stats(static[:len(sub)]), "fkl": arm_stats(on["rows"][:len(sub)])}
                for loss in ("rkl", "jsd"):
                    run = online_arm(pair, base_dir, sub, args, tmp, label=f"{d}-online_{loss}", loss=loss, audit=False)
                    abl[loss] = arm_stats(run["rows"])
                report["ablation"][d] = abl
        # 3. code -> prose -> code: one draft, the second code segment on other prompts
        seg = n // 2
        shifted = streams["code"][:seg] + streams["prose"][:seg] + streams["code"][seg:2 * seg]
        on = online_arm(pair, base_dir, shifted, args, tmp, label="shift-online", loss="fkl", cluster="shift")
        checks += on["checks"]
        report["shift"] = {"static": arm_stats(static_arm(pair.draft, shifted, args, "shift/static")),
                           "online": arm_stats(on["rows"], promotions=on["promotions"], gates=on["gates"]),
                           "boundaries": [seg, 2 * seg], "domains": ["code", "prose", "code"]}  # fmt: skip
        if args.recurring:  # 4. memory: 40 code prompts drawn with replacement
            rng = random.Random(3)
            rec = [rng.choice(pools["code"]) for _ in range(args.recurring)]
            on = online_arm(pair, base_dir, rec, args, tmp, label="recurring-online", loss="fkl", audit=False,
                            cluster="recurring")  # fmt: skip
            report["recurring"] = {"static": arm_stats(static_arm(pair.draft, rec, args, "recurring/static")),
                                   "online": arm_stats(on["rows"])}  # fmt: skip
    report.update({
        "command": " ".join([".venv/bin/python", "benchmarks/osd.py", *map(shlex.quote, argv if argv is not None else sys.argv[1:])]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": {"target": target_name(model_dir), "base": args.base, "requests": n, "twin_requests": twin_n,
                   "prompt_tokens": args.prompt_tokens, "max_new_tokens": args.max_new_tokens, "k": args.k,
                   **_trainer_defaults(args), "offline_epochs": args.offline_epochs, "offline_lr": args.offline_lr,
                   "ablation_requests": args.ablation_requests, "recurring_requests": args.recurring,
                   "audit_window": args.audit_window, "check_every": args.check_every, "window": WINDOW,
                   "gate_metric": PromoteConfig().metric},
        "distinct_prompts": distinct,
        "engine_checks": checks,
        "environment": environment(),
        "elapsed_s": time.perf_counter() - started,
    })  # fmt: skip
    return finish(report, args)


def _trainer_defaults(args) -> dict:
    c = OnlineConfig(**({"lr": args.lr} if args.lr else {}), **({"interval": args.interval} if args.interval else {}))
    return {"interval": c.interval, "steps": c.steps_per_update, "lr": c.lr, "replay": c.replay.policy,
            "capacity": c.replay.capacity}  # fmt: skip


def summarise(report: dict) -> dict:
    """The headline numbers, derived from the per-request α of each arm (also for ``--replot``)."""
    sd, w = report["single_domain"], WINDOW
    last = lambda d, arm: sd[d][arm]["summary"]["alpha_last"]  # noqa: E731

    def paired_gain(d: str) -> float:
        on, st = sd[d]["online"]["alphas"], sd[d]["static"]["alphas"]
        return statistics.fmean(on[-w:]) - statistics.fmean(st[-w:])

    sh = report["shift"]
    alphas, (b1, b2) = sh["online"]["alphas"], sh["boundaries"]
    single = {d: sd[d]["online"]["summary"]["alpha_last"] for d in DOMAINS}
    code_before = statistics.fmean(alphas[max(0, b1 - w):b1]) if b1 else None
    rec = [recovery(alphas, b1, b2, single["prose"]), recovery(alphas, b2, len(alphas), code_before or single["code"])]
    sh["recovery"] = [{"shift_at": b1, "to": "prose", "reference": single["prose"], "requests": rec[0]},
                      {"shift_at": b2, "to": "code", "reference": code_before, "requests": rec[1]}]  # fmt: skip
    promos = [p for d in DOMAINS for p in sd[d]["online"].get("promotions", [])] + sh["online"].get("promotions", [])
    to_gain = [sd[d].get("requests_to_gain") for d in DOMAINS]
    checks = report.get("engine_checks", [])
    cpu = sum(sd[d]["online"].get("trainer_cpu_s", 0.0) for d in DOMAINS)
    reqs = sum(sd[d]["online"]["summary"]["requests"] for d in DOMAINS)
    recurring = report.get("recurring") or {}
    return {
        "distinct_prompts": bool(report.get("distinct_prompts")),
        "alpha_gain_vs_static": min(paired_gain(d) for d in DOMAINS),
        "requests_to_gain": None if None in to_gain else max(to_gain),
        "gain_bar_met": min(paired_gain(d) for d in DOMAINS) >= GAIN_BAR and None not in to_gain,
        "promotions": len(promos),
        "promotions_worse_beyond_noise": sum(p["worse_beyond_noise"] for p in promos),
        "gap_to_offline_bound": max(last(d, "offline_upper") - last(d, "online") for d in DOMAINS),
        "recovery_requests": None if None in rec else max(rec),
        "recurring_alpha_gain": (recurring["online"]["summary"]["alpha_last"] - recurring["static"]["summary"]["alpha_last"]
                                 if recurring else None),
        "trainer_cpu_s_per_request": cpu / reqs if reqs else 0.0,
        "engine_checks": {"n": len(checks), "identical": sum(c["identical"] for c in checks),
                          "alpha_equal": sum(abs(c["alpha_engine"] - c["alpha_replayed"]) < 1e-9 for c in checks)},
        **{f"{d}_{name}": last(d, arm) for d in DOMAINS for name, arm in
           (("static", "static"), ("online", "online"), ("offline10", "offline_10pct"), ("upper", "offline_upper"))},
        "shift_static": sh["static"]["summary"]["alpha_mean"],
        "shift_online": sh["online"]["summary"]["alpha_mean"],
    }  # fmt: skip


def finish(report: dict, args: argparse.Namespace) -> int:
    """Summary, plot, table, JSON and doc section of a finished (or reloaded) run."""
    report["summary"] = summarise(report)
    plot(report, args.plot)
    table = markdown(report)
    print(table)
    print(json.dumps(report["summary"], indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    if not args.no_doc:
        rel = os.path.relpath(args.plot, args.doc.parent)
        write_doc_section(args.doc, DOC_BEGIN, DOC_END, doc_section(report, table, rel))
    checks = report["summary"]["engine_checks"]
    return 0 if checks["identical"] == checks["n"] else 1


if __name__ == "__main__":
    sys.exit(main())
