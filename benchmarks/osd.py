"""OSD benchmark: does online distillation raise the acceptance rate on live traffic?

Reproduces the core experiments of Online Speculative Decoding (Liu et al., §5) on the
bootstrapped target/draft pair. Held-out prompts of each domain are replayed through our
engine (greedy, draft method, k=4), one request at a time. For the online arms, every
request is logged to a local stream (``StreamLogger``) and an ``OnlineTrainer`` consumes
it in the same process. When the trainer produces a new draft version, serving swaps
its weights in between requests.

- **Single domain** (per domain), the same request sequence for each arm:
  - ``static``: the bootstrap draft, never updated;
  - ``offline_10pct``: distilled in advance on the first 10 % of the stream (the paper's
    baseline), then frozen;
  - ``online_fkl``: online distillation (OSD Algorithm 1, I=8, forward KL);
  - ``offline_upper``: distilled in advance on a whole stream of the same size and domain,
    disjoint from the served one (the paper's offline setting: train split, then test);
  - ``offline_same``: distilled in advance on the very requests it then serves. No online
    method can reach it (it has seen each answer before serving it); it is reported to show
    how much of α is memorisation.
  Offline distillation has the target at hand: forward KL against the target's full
  distribution at every output position, 2 epochs (as in the paper's §5.1).
- **Distribution shift**: code → prose → code, with one draft (the paper's Fig. 4):
  ``static`` and ``online_fkl``.
- **Loss ablation** (Table 1 style): online with forward KL, reverse KL and JSD[0.5].

α of a request is accepted ÷ drafted tokens. Curves plot the moving average over the
last 50 requests. Writes JSON (``--json``) and a PNG plot (``--plot``), and replaces the
osd section of ``docs/benchmarks.md``.

    .venv/bin/python benchmarks/osd.py --json benchmarks/out/osd.json
    .venv/bin/python benchmarks/osd.py --quick
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make serving/, trainer/ importable
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.common import environment, write_doc_section  # noqa: E402
from serving.engine import SpecEngine  # noqa: E402
from serving.models import ModelPair, load_model, load_model_dir  # noqa: E402
from serving.stream_logger import LoggerConfig, RequestMeta, StreamLogger  # noqa: E402
from serving.types import SamplingParams  # noqa: E402
from specops.paths import models_dir  # noqa: E402
from specops.prompts import heldout_prompts  # noqa: E402
from streams import StreamConfig  # noqa: E402
from trainer.bootstrap.generic import build_generic_draft  # noqa: E402
from trainer.online import OnlineConfig, OnlineTrainer  # noqa: E402
from trainer.replay import ReplayConfig  # noqa: E402

log = logging.getLogger("bench.osd")

DOC_BEGIN = "<!-- BEGIN osd (written by benchmarks/osd.py; edits inside are overwritten) -->"
DOC_END = "<!-- END osd -->"
DOMAINS = ("code", "prose")
WINDOW = 50
RECOVERY_MARGIN = 0.05
COLORS = {"static": "tab:blue", "offline_10pct": "tab:orange", "online_fkl": "tab:green", "offline_upper": "tab:red",
          "offline_same": "tab:purple"}  # fmt: skip


# ---------------------------------------------------------------- serving a request sequence
def serve(pair: ModelPair, prompts: list, args, *, label: str, trainer: OnlineTrainer | None = None,
          logger: StreamLogger | None = None, cluster: str = "default") -> list[dict]:  # fmt: skip
    """Replay ``prompts`` in order; with a trainer, swap in each new draft version between requests."""
    engine = SpecEngine(pair, logger=logger)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    version = 0
    out = []
    cpu = 0.0
    for i, prompt in enumerate(tqdm(prompts, desc=label, unit="req", leave=False)):
        res = engine.generate(prompt.token_ids, params, method="draft", k=args.k,
                              meta=RequestMeta(request_id=f"{label}-{i}", cluster=cluster))  # fmt: skip
        s = res.stats
        out.append({"alpha": s.num_accepted / s.num_drafted if s.num_drafted else 0.0, "domain": prompt.domain,
                    "draft_version": version, "output": res.token_ids})  # fmt: skip
        if trainer is not None:
            assert logger is not None
            logger.flush(30)
            c0 = time.process_time()
            while trainer.step():
                pass
            cpu += time.process_time() - c0
            out[-1]["trainer_cpu_s"] = cpu
            st = trainer.clusters.get(cluster)
            if st is not None and st.version != version:
                pair.draft.load_state_dict(st.model.state_dict())  # the hot-swap, between requests
                version = st.version
    return out


def online_arm(pair: ModelPair, prompts: list, args, tmp: Path, *, label: str, loss: str) -> list[dict]:
    base = tmp / "base_draft"
    if not base.exists():
        pair.draft.save_pretrained(base, safe_serialization=True)
    served = ModelPair(target=pair.target, draft=copy.deepcopy(pair.draft), tokenizer=pair.tokenizer)
    cfg = StreamConfig(url=f"local://{tmp}/{label}/log", fsync=False, num_partitions=1)
    logger = StreamLogger(cfg, LoggerConfig(), vocab_size=pair.vocab_size)
    ocfg = OnlineConfig(interval=args.interval, loss=loss, lr=args.lr, steps_per_update=args.steps, poll_timeout_s=0.01,
                        replay=ReplayConfig(policy=args.replay, capacity=args.capacity))  # fmt: skip
    trainer = OnlineTrainer(cfg, base, tmp / label / "trainer", ocfg)
    try:
        return serve(served, prompts, args, label=label, trainer=trainer, logger=logger)
    finally:
        logger.close()
        trainer.close()


# ---------------------------------------------------------------- offline distillation
def offline_distill(pair: ModelPair, sequences: list[tuple[list[int], list[int]]], args, label: str) -> torch.nn.Module:
    """Forward KL to the target's full distribution at every output position, ``epochs`` passes."""
    draft = copy.deepcopy(pair.draft).train()
    opt = torch.optim.AdamW(draft.parameters(), lr=args.offline_lr, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(0)
    for _ in range(args.offline_epochs):
        order = torch.randperm(len(sequences), generator=g).tolist()
        for start in tqdm(range(0, len(order), args.offline_batch), desc=label, unit="batch", leave=False):
            opt.zero_grad(set_to_none=True)
            total, count = 0.0, 0
            for j in order[start:start + args.offline_batch]:
                prompt, output = sequences[j]
                ids = torch.tensor([prompt + output])
                with torch.no_grad():
                    target_logp = torch.log_softmax(pair.target(ids).logits[0].float(), -1)
                draft_logp = torch.log_softmax(draft(ids).logits[0].float(), -1)
                sl = slice(len(prompt) - 1, ids.shape[1] - 1)  # predictions of the output tokens
                p = target_logp[sl].exp()
                kl = (p * (target_logp[sl] - draft_logp[sl])).sum(-1)
                total = total + kl.sum()
                count += kl.numel()
            (total / max(count, 1)).backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            opt.step()
    return draft.eval()


def static_pair(pair: ModelPair, draft: torch.nn.Module | None = None) -> ModelPair:
    return ModelPair(target=pair.target, draft=draft if draft is not None else pair.draft, tokenizer=pair.tokenizer)


# ---------------------------------------------------------------- metrics
def moving(alphas: list[float], window: int = WINDOW) -> list[float]:
    return [statistics.fmean(alphas[max(0, i + 1 - window): i + 1]) for i in range(len(alphas))]


def recovery(alphas: list[float], start: int, end: int, reference: float, *, margin: float = RECOVERY_MARGIN,
             min_seen: int = 10) -> int | None:  # fmt: skip
    """Requests after the shift at ``start`` until α is back within ``margin`` of ``reference``.

    α after the shift is the mean over the trailing ``WINDOW`` requests *since the shift*
    (fewer while fewer have been served, at least ``min_seen``), so pre-shift requests
    never flatter it. Only the segment ``[start, end)`` counts: None when it never recovers
    before the next shift.
    """
    for n in range(start + min_seen, end + 1):
        if statistics.fmean(alphas[max(start, n - WINDOW):n]) >= reference - margin:
            return n - start
    return None


def shift_recoveries(report: dict) -> list[dict]:
    """Recovery after each shift of the online arm, against the level it held on the new domain.

    The reference for a domain the arm has served before (code, when it comes back) is its
    α over the last ``WINDOW`` requests before it left that domain. For a domain it has not
    served yet (prose, at the first shift) there is no such level; the reference is the α
    the online draft reached on that domain in its single-domain run (last ``WINDOW``).
    """
    sh = report["shift"]
    alphas, bounds, domains = sh["online_fkl"]["alphas"], sh["boundaries"], sh["domains"]
    edges = [0, *bounds, len(alphas)]
    held: dict[str, float] = {}
    out = []
    for i, d in enumerate(domains):
        start, end = edges[i], edges[i + 1]
        if i > 0:
            ref, kind = (held[d], "pre-shift level on this domain") if d in held else (
                report["single_domain"][d]["online_fkl"]["summary"]["alpha_last_50"], "single-domain online level")
            out.append({"shift_at": start, "to": d, "reference": ref, "reference_kind": kind,
                        "requests": recovery(alphas, start, end, ref)})  # fmt: skip
        held[d] = statistics.fmean(alphas[max(start, end - WINDOW):end])
    return out


def summary_of(rows: list[dict]) -> dict:
    a = [r["alpha"] for r in rows]
    return {"alpha_mean": statistics.fmean(a), "alpha_first_50": statistics.fmean(a[:WINDOW]),
            "alpha_last_50": statistics.fmean(a[-WINDOW:]), "requests": len(a),
            "draft_versions": max((r["draft_version"] for r in rows), default=0),
            "trainer_cpu_s": rows[-1].get("trainer_cpu_s", 0.0) if rows else 0.0}  # fmt: skip


# ---------------------------------------------------------------- report
def _arms(arms: dict) -> list[tuple[str, dict]]:
    """The arms of a panel (entries with a curve), without its annotations."""
    return [(k, v) for k, v in arms.items() if isinstance(v, dict) and "curve" in v]


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(d, report["single_domain"][d]) for d in DOMAINS] + [("shift: code → prose → code", report["shift"])]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), sharey=True)
    for ax, (title, arms) in zip(axes, panels):
        for name, arm in _arms(arms):
            ax.plot(range(1, len(arm["curve"]) + 1), arm["curve"], label=name, lw=1.6, color=COLORS.get(name))
        for x in arms.get("boundaries", []):
            ax.axvline(x, color="grey", ls=":", lw=1)
        ax.set_title(title)
        ax.set_xlabel("requests processed")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"α (moving average, last {WINDOW} requests)")
    axes[0].legend(fontsize=8, loc="lower right")
    axes[-1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(report: dict) -> str:
    lines = ["| domain | arm | α mean | α first 50 | α last 50 | draft versions |", "|---|---|---:|---:|---:|---:|"]
    for d in DOMAINS:
        for name, arm in report["single_domain"][d].items():
            s = arm["summary"]
            lines.append(f"| {d} | {name} | {s['alpha_mean']:.3f} | {s['alpha_first_50']:.3f} | {s['alpha_last_50']:.3f} "
                         f"| {s['draft_versions']} |")  # fmt: skip
    for name, arm in _arms(report["shift"]):
        s = arm["summary"]
        lines.append(f"| shift | {name} | {s['alpha_mean']:.3f} | {s['alpha_first_50']:.3f} | {s['alpha_last_50']:.3f} "
                     f"| {s['draft_versions']} |")  # fmt: skip
    lines += ["", "Loss ablation (online, α over the last 50 requests; Table 1 style):", "",
              "| domain | static | online KL | online RKL | online JSD[0.5] | offline upper bound |",
              "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for d in DOMAINS:
        arms = report["single_domain"][d]
        abl = report["ablation"][d]
        cells = [arms["static"], arms["online_fkl"], abl["online_rkl"], abl["online_jsd"], arms["offline_upper"]]
        lines.append(f"| {d} | " + " | ".join(f"{a['summary']['alpha_last_50']:.3f}" for a in cells) + " |")
    return "\n".join(lines)


def _rec(n: int | None) -> str:
    return "not recovered" if n is None else str(n)


def doc_section(report: dict, table: str, plot_rel: str) -> str:
    c, env, s = report["config"], report["environment"], report["summary"]
    return "\n".join([
        DOC_BEGIN,
        "## Online distillation (`benchmarks/osd.py`)",
        "",
        "Command:",
        "",
        f"    {report['command']}",
        "",
        f"Date {report['date'][:10]}; {env['cpu_count']} CPU cores, {env['threads']} torch threads, no GPU; commit "
        f"{str(env['git_commit'])[:10]}{' (dirty)' if env['git_dirty'] else ''}. {c['requests']} held-out requests "
        f"per domain, starting draft `{c['base']}` ({c['prompt_tokens']}-token prompts, {c['max_new_tokens']} new tokens, greedy, draft k={c['k']}); "
        f"online: I={c['interval']}, {c['steps']} AdamW steps per update at lr {c['lr']}, replay `{c['replay']}` with "
        f"capacity {c['capacity']} requests, trainer in the serving process, swapping in each new version between "
        "requests; offline: forward KL on "
        f"the target's full distributions, {c['offline_epochs']} epochs. Run time {report['elapsed_s'] / 60:.0f} min.",
        "",
        f"![α over requests]({plot_rel})",
        "",
        table,
        "",
        f"Online distillation moves α over the last 50 requests from {s['code_static']:.3f} to "
        f"{s['code_online']:.3f} on code and from {s['prose_static']:.3f} to {s['prose_online']:.3f} on prose "
        f"(offline upper bound, distilled on a disjoint stream of the same domain: {s['code_upper']:.3f} / "
        f"{s['prose_upper']:.3f}; distilled on the served requests themselves: {s['code_same']:.3f} / "
        f"{s['prose_same']:.3f}). The paper reports gains of 0.1–0.65 in α for 7B/3B targets with 160M/80M drafts.",
        "",
        "| summary | value | bar |",
        "|---|---:|---:|",
        f"| `alpha_gain_vs_static` (smallest over domains) | {s['alpha_gain_vs_static']:+.3f} | ≥ +0.10 |",
        f"| `gap_to_offline_bound` (largest over domains) | {s['gap_to_offline_bound']:+.3f} | ≤ 0.05 |",
        f"| `recovery_requests` (largest over the two shifts) | {_rec(s['recovery_requests'])} | ≤ 300 |",
        f"| `trainer_cpu_s_per_request` | {s['trainer_cpu_s_per_request']:.3f} | |",
        "",
        "Recovery after each shift: requests until the online arm's α, averaged over the trailing 50 requests "
        "since the shift, is back within 0.05 of its reference level on the new domain (for a domain it served "
        "before, the α it held there before leaving; for a new one, the α online distillation reached on it in the "
        "single-domain run): " + "; ".join(
            f"{r['to']} at request {r['shift_at']}: reference {r['reference']:.3f} ({r['reference_kind']}), "
            f"{_rec(r['requests'])}" for r in report["shift"]["recovery"]) + ".",
        "",
        f"Every output stayed identical to target-only greedy decoding across arms: {'yes' if report['lossless'] else 'NO'}.",
        DOC_END,
    ])  # fmt: skip


# ---------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-dir", default=str(models_dir()), help="bootstrap dir with target/, draft/, manifest.json")
    p.add_argument("--requests", type=int, default=None, help="requests per domain (default 300; 72 with --quick)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="tokens per prompt")
    p.add_argument("--max-new-tokens", type=int, default=None, help="new tokens per request (default 64; 32 with --quick)")
    p.add_argument("--base", choices=("generic", "bootstrap"), default="generic",
                   help="starting draft: generic = the draft shape trained on hard labels only, never distilled from "
                   "the target (the paper's setting; built once into <model-dir>/draft-generic); bootstrap = the "
                   "bootstrap's draft/, already distilled from the target on both domains")  # fmt: skip
    p.add_argument("--generic-steps", type=int, default=400, help="hard-label training steps of the generic draft")
    p.add_argument("--per-doc", type=int, default=12, help="most prompts cut from one held-out document")
    p.add_argument("--k", type=int, default=4, help="draft tokens per step")
    p.add_argument("--interval", type=int, default=8, help="online update interval I (the paper's 8)")
    p.add_argument("--steps", type=int, default=4, help="AdamW steps per online update")
    p.add_argument("--lr", type=float, default=1e-3, help="online learning rate")
    p.add_argument("--replay", choices=("clear", "recent", "reservoir"), default="recent",
                   help="online replay policy (clear is the paper's; recent reuses each request in several updates)")  # fmt: skip
    p.add_argument("--capacity", type=int, default=32, help="online replay buffer capacity (requests)")
    p.add_argument("--offline-epochs", type=int, default=2, help="offline distillation epochs (the paper's 2)")
    p.add_argument("--offline-lr", type=float, default=1e-3, help="offline learning rate")
    p.add_argument("--offline-batch", type=int, default=8, help="sequences per offline step")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--no-ablation", action="store_true", help="skip the RKL / JSD online arms")
    p.add_argument("--quick", action="store_true", help="72 requests per domain, 32 new tokens (about 6 minutes)")
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
        report["shift"].setdefault("domains", ["code", "prose", "code"])  # reports written before it was recorded
        args.json = args.json or args.replot
        return finish(report, args)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.requests = args.requests or (72 if args.quick else 300)
    args.max_new_tokens = args.max_new_tokens or (32 if args.quick else 64)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    pair = load_model_dir(Path(args.model_dir))
    pair.target.eval()
    if args.base == "generic":  # OSD's setting: a draft never distilled from the target
        generic = load_model(build_generic_draft(Path(args.model_dir), steps=args.generic_steps))  # same tokenizer files
        pair = ModelPair(target=pair.target, draft=generic, tokenizer=pair.tokenizer)
    streams, twins = {}, {}
    for d in DOMAINS:  # a shuffled pool split in two: the served stream and its disjoint twin
        pool = heldout_prompts(Path(args.model_dir), pair.tokenizer, d, 2 * args.requests, num_tokens=args.prompt_tokens,
                               seed=7, per_doc=args.per_doc)  # fmt: skip
        random.Random(11).shuffle(pool)
        n = len(pool) // 2
        if n < args.requests:
            log.warning("%s: only %d held-out prompts, so %d requests instead of %d (raise --per-doc)", d, len(pool), n,
                        args.requests)  # fmt: skip
        streams[d], twins[d] = pool[:n], pool[n:2 * n]
    args.requests = min(len(v) for v in streams.values())
    streams = {d: v[:args.requests] for d, v in streams.items()}
    twins = {d: v[:args.requests] for d, v in twins.items()}
    report: dict = {"single_domain": {}, "ablation": {}, "shift": {}}
    outputs: dict[str, list] = {}
    arm_stats = lambda rows: {"summary": summary_of(rows), "curve": moving([r["alpha"] for r in rows]),  # noqa: E731
                              "alphas": [round(r["alpha"], 4) for r in rows]}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="specops-osd-") as tmp_s:
        tmp = Path(tmp_s)
        for d in DOMAINS:
            prompts = streams[d]
            arms: dict[str, list[dict]] = {}
            arms["static"] = serve(static_pair(pair), prompts, args, label=f"{d}/static")
            seqs = [(p.token_ids, r["output"]) for p, r in zip(prompts, arms["static"])]
            tenth = max(1, len(seqs) // 10)
            arms["offline_10pct"] = serve(static_pair(pair, offline_distill(pair, seqs[:tenth], args, f"{d}/offline 10%")),
                                          prompts, args, label=f"{d}/offline_10pct")  # fmt: skip
            arms["online_fkl"] = online_arm(pair, prompts, args, tmp, label=f"{d}-online_fkl", loss="fkl")
            twin = serve(static_pair(pair), twins[d], args, label=f"{d}/twin stream")  # the target's outputs
            twin_seqs = [(p.token_ids, r["output"]) for p, r in zip(twins[d], twin)]
            arms["offline_upper"] = serve(static_pair(pair, offline_distill(pair, twin_seqs, args, f"{d}/offline twin")),
                                          prompts, args, label=f"{d}/offline_upper")  # fmt: skip
            arms["offline_same"] = serve(static_pair(pair, offline_distill(pair, seqs, args, f"{d}/offline same")),
                                         prompts, args, label=f"{d}/offline_same")  # fmt: skip
            report["single_domain"][d] = {k: arm_stats(v) for k, v in arms.items()}
            outputs.update({f"{d}/{k}": [r["output"] for r in v] for k, v in arms.items()})
            if not args.no_ablation:
                abl = {f"online_{loss}": online_arm(pair, prompts, args, tmp, label=f"{d}-online_{loss}", loss=loss)
                       for loss in ("rkl", "jsd")}  # fmt: skip
                report["ablation"][d] = {k: arm_stats(v) for k, v in abl.items()}
                outputs.update({f"{d}/{k}": [r["output"] for r in v] for k, v in abl.items()})
        # code -> prose -> code, one draft; the two code segments use different prompts
        seg = args.requests // 2
        shifted = streams["code"][:seg] + streams["prose"][:seg] + streams["code"][seg:2 * seg]
        shift = {"static": serve(static_pair(pair), shifted, args, label="shift/static"),
                 "online_fkl": online_arm(pair, shifted, args, tmp, label="shift-online_fkl", loss="fkl")}  # fmt: skip
        report["shift"] = {k: arm_stats(v) for k, v in shift.items()}
        report["shift"]["boundaries"] = [seg, 2 * seg]
        report["shift"]["domains"] = ["code", "prose", "code"]
        outputs.update({f"shift/{k}": [r["output"] for r in v] for k, v in shift.items()})
    # lossless: every arm of one request sequence emitted the same tokens
    lossless = all(outputs[f"{d}/{k}"] == outputs[f"{d}/static"] for d in DOMAINS for k in
                   [*report["single_domain"][d], *report["ablation"].get(d, {})])  # fmt: skip
    lossless &= outputs["shift/online_fkl"] == outputs["shift/static"]
    report.update({
        "command": " ".join([".venv/bin/python", "benchmarks/osd.py", *map(shlex.quote, argv if argv is not None else sys.argv[1:])]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": {"base": args.base, "requests": args.requests, "prompt_tokens": args.prompt_tokens,
                   "max_new_tokens": args.max_new_tokens, "k": args.k, "interval": args.interval, "steps": args.steps,
                   "lr": args.lr, "replay": args.replay, "capacity": args.capacity,
                   "offline_epochs": args.offline_epochs, "offline_lr": args.offline_lr, "window": WINDOW},
        "lossless": lossless,
        "environment": environment(),
        "elapsed_s": time.perf_counter() - started,
    })  # fmt: skip
    if args.no_ablation:
        sd = report["single_domain"]
        report["ablation"] = {d: {k: sd[d]["online_fkl"] for k in ("online_rkl", "online_jsd")} for d in DOMAINS}
    return finish(report, args)


def summarise(report: dict) -> dict:
    """The headline numbers, derived from the per-request α of each arm (also for ``--replot``)."""
    sd = report["single_domain"]
    report["shift"]["recovery"] = recoveries = shift_recoveries(report)
    rec_n = [r["requests"] for r in recoveries]
    last = lambda d, arm: sd[d][arm]["summary"]["alpha_last_50"]  # noqa: E731
    cpu = sum(sd[d]["online_fkl"]["summary"]["trainer_cpu_s"] for d in DOMAINS)
    n = sum(sd[d]["online_fkl"]["summary"]["requests"] for d in DOMAINS)
    return {
        "alpha_gain_vs_static": min(last(d, "online_fkl") - last(d, "static") for d in DOMAINS),
        "gap_to_offline_bound": max(last(d, "offline_upper") - last(d, "online_fkl") for d in DOMAINS),
        "gap_to_offline_same": max(last(d, "offline_same") - last(d, "online_fkl") for d in DOMAINS),
        "recovery_requests": None if None in rec_n else max(rec_n),
        "trainer_cpu_s_per_request": cpu / n,
        **{f"{d}_{name}": last(d, arm) for d in DOMAINS for name, arm in
           (("static", "static"), ("online", "online_fkl"), ("offline10", "offline_10pct"), ("upper", "offline_upper"),
            ("same", "offline_same"))},
        "shift_static": report["shift"]["static"]["summary"]["alpha_mean"],
        "shift_online": report["shift"]["online_fkl"]["summary"]["alpha_mean"],
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
    return 0 if report["lossless"] else 1

if __name__ == "__main__":
    sys.exit(main())
