"""The OSD benchmark's learning: the offline baseline (distilled on the same served traffic) and
the online run (a trainer per cluster consuming the logged stream, the gate, the arms)."""

from __future__ import annotations

import copy
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.distill.arms import WindowArm, arm_config, arm_key, audit_promotion
from benchmarks.distill.constants import WINDOW
from benchmarks.distill.served import (
    CachedTeacher,
    ProbeResult,
    Served,
    logged_result,
    pooled,
    probe,
    serve,
    served_example,
)
from specops.core import draft_vocab
from specops.core.models import ModelPair
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.fleet.stream_logger import LoggerConfig, RequestMeta, StreamLogger
from specops.serving.plan import plain_generate
from specops.streams import StreamConfig
from specops.trainer.acceptance import evaluate_records
from specops.trainer.data import draft_logits
from specops.trainer.losses import distill_loss
from specops.trainer.online.trainer import OnlineConfig, OnlineTrainer
from specops.trainer.promote import PromoteConfig, fresh_window, gate_window, judge
from specops.trainer.replay import ReplayConfig


def offline_distill(
    draft: torch.nn.Module,
    stream: list[Served],
    args,
    label: str,
    *,
    lr: float | None = None,
    at: tuple[int, ...] = (),
) -> torch.nn.Module | dict[int, torch.nn.Module]:
    """Forward KL to the target's top-k distribution at every output position of ``stream``,
    ``--offline-epochs`` passes at ``--offline-lr`` (the paper's offline distillation on the
    served traffic). With ``at``: one run of ``max(at)`` epochs (at ``lr``), and the draft after
    each epoch in ``at`` ({epochs: draft}), so a sweep over epochs costs the longest run only."""
    model = copy.deepcopy(draft).train()
    vocab = draft_vocab.of(draft)
    model.get_input_embeddings().weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.offline_lr if lr is None else lr, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(0)
    kept: dict[int, torch.nn.Module] = {}

    def snapshot() -> torch.nn.Module:
        served = copy.deepcopy(draft)
        served.load_state_dict(model.state_dict())
        return served.eval()

    for epoch in range(1, (max(at) if at else args.offline_epochs) + 1):
        order = torch.randperm(len(stream), generator=g).tolist()
        for start in tqdm(
            range(0, len(order), args.offline_batch), desc=f"{label} e{epoch}", unit="batch", leave=False
        ):
            opt.zero_grad(set_to_none=True)
            total, count = None, 0
            for j in order[start : start + args.offline_batch]:
                s = stream[j]
                ex = served_example(s, vocab, f"offline-{j}")
                loss = distill_loss(draft_logits(model, ex, vocab), ex.target, "fkl")
                total = loss * len(s.output) if total is None else total + loss * len(s.output)
                count += len(s.output)
            (total / count).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        if epoch in at:
            kept[epoch] = snapshot()
    return kept if at else snapshot()


def parse_sweep(spec: str) -> dict[float, set[int]]:
    """``--offline-sweep``: ``LR:E,E;LR:E`` -> {lr: {epochs}} (``1e-3:1,3;3e-3:2``)."""
    out: dict[float, set[int]] = {}
    for item in filter(None, (x.strip() for x in spec.split(";"))):
        lr, _, eps = item.partition(":")
        out.setdefault(float(lr), set()).update(int(e) for e in eps.split(",") if e.strip())
        if not out[float(lr)] or min(out[float(lr)]) < 1:
            raise ValueError(f"--offline-sweep {item!r}: give LR:EPOCHS[,EPOCHS...], epochs >= 1")
    return out


def offline_bound(draft: torch.nn.Module, stream: list[Served], probe_set: list[Served], args, domain: str):
    """The offline arm: ``--offline-epochs`` at ``--offline-lr``, and every (lr, epochs) of
    ``--offline-sweep``, each epoch count of one lr read off one run. Returns the draft with the
    best per-token α on ``probe_set`` (the bound: chosen on the probe itself, a generous one) and
    every configuration's α: (draft, its probe result, rows)."""
    sweep = parse_sweep(args.offline_sweep)
    sweep.setdefault(args.offline_lr, set()).add(args.offline_epochs)
    rows, best = [], None
    for lr, epochs in sorted(sweep.items()):
        snaps = offline_distill(draft, stream, args, f"{domain}/offline lr {lr:g}", lr=lr, at=tuple(sorted(epochs)))
        for e, model in sorted(snaps.items()):
            r = probe(model, probe_set, args)
            default = lr == args.offline_lr and e == args.offline_epochs
            rows.append({"lr": lr, "epochs": e, "alpha_token": r.alpha_token, "default": default})
            if best is None or r.alpha_token > best[0].alpha_token:
                best = (r, model)
    return best[1], best[0], rows


def online_config(args, **over) -> OnlineConfig:
    """The trainer's defaults, with this run's overrides (``--lr`` ...) and then ``over``."""
    base = OnlineConfig()
    fields = {
        "interval": args.interval,
        "lr": args.lr,
        "steps_per_update": args.steps,
        "average_decay": args.average_decay,
        "loss": args.loss,
        "positions": args.positions,
    }
    cfg = replace(base, poll_timeout_s=0.01, **{k: v for k, v in fields.items() if v is not None})
    if args.replay or args.capacity:
        cfg = replace(
            cfg,
            replay=ReplayConfig(
                policy=args.replay or base.replay.policy, capacity=args.capacity or base.replay.capacity
            ),
        )
    return replace(cfg, **over)


def learning_run(
    pair: ModelPair,
    base_dir: Path,
    base: torch.nn.Module,
    traffic: list[tuple[Served, str]],
    probes: dict[str, list[Served]],
    args,
    tmp: Path,
    *,
    label: str,
    ocfg: OnlineConfig,
    gate: bool = True,
    audit: bool = True,
    probe_every: int | None = None,
    windows: tuple[str, ...] = (),
) -> dict:
    """Serve ``traffic`` ((request, cluster) in order) while one OnlineTrainer learns from it.

    Per cluster, ``gated`` serves the champion (promoted through the gate) and logs the
    request; ``ungated`` is the trainer's newest version, measured on the same request.
    Each cluster's probe is measured every ``probe_every`` of its requests and at the end.

    ``windows``: more gated arms, one per gate window W (``PromoteConfig.window``; 0 = the whole
    held-out set), each with its own champion, judged on the same candidates and measured on the
    same requests (row keys ``w{W}_accepted`` ...). The trainer learns the same whatever serves:
    it trains at every output position of the target's own output (``positions = "all"``), which
    no draft changes; only the primary arm's records are logged."""
    cfg = StreamConfig(url=f"local://{tmp}/{label}/log", fsync=False, num_partitions=1)
    logger = StreamLogger(cfg, LoggerConfig(), vocab_size=pair.vocab_size)
    teacher = CachedTeacher()
    pcfg = PromoteConfig()
    arm_cfgs = {w: arm_config(pcfg, w) for w in windows}
    trainer = OnlineTrainer(
        cfg,
        base_dir,
        tmp / label / "trainer",
        ocfg,
        teacher=teacher if ocfg.positions == "all" else None,
        target=pair.target if ocfg.sampling != "teacher" else None,  # student/mixed sampling queries it
        fresh=max([pcfg.fresh, *(a.fresh for a in arm_cfgs.values())]) if gate else 0,
    )
    clusters = sorted({c for _, c in traffic})
    extra = {w: WindowArm(a, clusters, base, w) for w, a in arm_cfgs.items()}
    gated = {c: copy.deepcopy(base) for c in clusters}
    latest = {c: copy.deepcopy(base) for c in clusters}
    version = {c: 0 for c in clusters}  # the champion's
    latest_v = {c: 0 for c in clusters}
    rows: list[dict] = []
    promotions, gates, checks = [], [], []
    curves: dict[str, list[dict]] = {c: [] for c in clusters}
    probe_cache: dict[tuple[str, str, int], ProbeResult] = {}
    served_n = {c: 0 for c in clusters}
    future: dict[str, list[int]] = {c: [i for i, (_, cc) in enumerate(traffic) if cc == c] for c in clusters}
    ref_cache: dict[str, tuple] = {}
    fresh_cache: dict[str, dict] = {c: {} for c in clusters}  # the champion's fresh scores, until a swap
    champion_scores: dict[str, float | None] = {}  # the gate's served score of each cluster's champion
    cpu = 0.0
    params = SamplingParams(max_new_tokens=args.max_new_tokens)

    def measure(c: str, arm: str, model: torch.nn.Module, v: int) -> ProbeResult:
        key = (c, "v", v)  # gated and ungated share versions: one measurement per version
        if key not in probe_cache:
            probe_cache[key] = probe(model, probes[c], args)
        return probe_cache[key]

    def checkpoint(c: str) -> None:
        if c not in probes:
            return
        g, u = measure(c, "gated", gated[c], version[c]), measure(c, "ungated", latest[c], latest_v[c])
        curves[c].append(
            {
                "requests": served_n[c],
                "gated": g.alpha_token,
                "ungated": u.alpha_token,
                "gated_version": version[c],
                "ungated_version": latest_v[c],
            }
        )

    for c in clusters:
        checkpoint(c)
    try:
        for i, (s, c) in enumerate(tqdm(traffic, desc=label, unit="req", leave=False)):
            out = serve(gated[c], s, args.k, args.max_new_tokens)
            out_u = out if latest_v[c] == version[c] else serve(latest[c], s, args.k, args.max_new_tokens)
            rows.append(
                {
                    "cluster": c,
                    "domain": s.prompt.domain,
                    "accepted": out.accepted,
                    "rejected": len(out.rejected),
                    "drafted": out.drafted,
                    "version": version[c],
                    "u_accepted": out_u.accepted,
                    "u_rejected": len(out_u.rejected),
                    "u_drafted": out_u.drafted,
                    "u_version": latest_v[c],
                    **{k: v for w, arm in extra.items() for k, v in arm.serve_row(c, s, out, args).items()},
                }
            )
            if args.check_every and i % args.check_every == args.check_every - 1:  # the real engine agrees
                engine = SpecEngine(
                    ModelPair(
                        target=pair.target,
                        draft=gated[c],
                        tokenizer=pair.tokenizer,
                        tokenizer_sha256=pair.tokenizer_sha256,
                    )
                )
                res = plain_generate(engine, s.prompt.token_ids, params, method="draft", k=args.k)
                checks.append(
                    {
                        "request": i,
                        "identical": res.token_ids == s.output,
                        "alpha_engine": res.stats.alpha_token,
                        "alpha_replayed": out.alpha_token,
                    }
                )
            rid = f"{label}-{i}"
            teacher.by_request[rid] = s
            logger.log(
                s.prompt.token_ids,
                logged_result(s, out, pair.vocab_size),
                params,
                RequestMeta(request_id=rid, cluster=c, draft_version=str(version[c])),
            )
            logger.flush(30)
            c0 = time.process_time()
            while trainer.step():
                pass
            st = trainer.clusters.get(c)
            if st is not None and st.version != latest_v[c]:  # a new candidate
                latest_v[c] = st.version
                # what the trainer publishes (with averaging: the average, not the trained weights)
                latest[c].load_state_dict(st.published.state_dict())
                if gate:
                    held = list(st.holdout)
                    for arm in extra.values():
                        arm.judge(c, st, held, trainer.vocab, i)
                    holdout = gate_window([h.record for h in held], pcfg)
                    key = (version[c], tuple(h.source for h in held[len(held) - len(holdout) :]))
                    if c not in ref_cache or ref_cache[c][0] != key:  # the champion on this held-out set
                        ref_cache[c] = (key, evaluate_records(gated[c], holdout, vocab=trainer.vocab))
                    result = judge(
                        str(st.version),
                        str(version[c]),
                        st.published,
                        gated[c],
                        holdout,
                        fresh_window(st.fresh, pcfg, version[c]),
                        pcfg,
                        trainer.vocab,
                        reference_acc=ref_cache[c][1],
                        fresh_cache=fresh_cache[c],
                    )
                    gates.append(
                        {
                            "request": i,
                            "cluster": c,
                            "candidate": st.version,
                            "promoted": result.promoted,
                            "reason": result.reason,
                            "window_requests": len(holdout),
                            "fresh_requests": int(result.extra.get("fresh_requests", 0)),
                        }
                    )
                    if result.promoted:
                        if audit:
                            nxt = [traffic[j][0] for j in future[c] if j > i][: args.audit_window]
                            promotions.append(
                                audit_promotion(
                                    gated[c],
                                    latest[c],
                                    nxt,
                                    args,
                                    request=i,
                                    cluster=c,
                                    old_version=version[c],
                                    new_version=st.version,
                                )
                            )
                        gated[c].load_state_dict(st.published.state_dict())  # the hot-swap, between requests
                        version[c] = st.version
                        fresh_cache[c] = {}
                        champion_scores[c] = result.candidate_score if result.metric == "served" else None
            cpu += time.process_time() - c0
            served_n[c] += 1
            if probe_every and served_n[c] % probe_every == 0:
                checkpoint(c)
    finally:
        logger.close()
        trainer.close()
    for c in clusters:
        if not curves[c] or curves[c][-1]["requests"] != served_n[c]:
            checkpoint(c)
    final = {
        c: {
            "gated": measure(c, "gated", gated[c], version[c]).to_dict(),
            "ungated": measure(c, "ungated", latest[c], latest_v[c]).to_dict(),
            "gated_version": version[c],
            "ungated_version": latest_v[c],
        }
        for c in clusters
        if c in probes
    }
    return {
        "rows": rows,
        "curves": curves,
        "final": final,
        "promotions": promotions,
        "gates": gates,
        "checks": checks,
        "trainer_cpu_s": cpu,
        "champion_scores": champion_scores,
        "windows": {
            arm_key(w): {
                **arm.summary(),
                "served_alpha_last": {  # per cluster, pooled over its last WINDOW requests, beside the primary's
                    c: {
                        "window": pooled(
                            [
                                {"accepted": r[f"{arm.prefix}accepted"], "rejected": r[f"{arm.prefix}rejected"]}
                                for r in tail
                            ]
                        ),
                        "gated": pooled(tail),
                        "ungated": pooled([{"accepted": r["u_accepted"], "rejected": r["u_rejected"]} for r in tail]),
                    }
                    for c in clusters
                    for tail in [[r for r in rows if r["cluster"] == c][-WINDOW:]]
                },
            }
            for w, arm in extra.items()
        },
        "drafts": {"gated": gated, "ungated": latest},
        "teacher_forwards": getattr(trainer.teacher, "forwards", 0),
    }
