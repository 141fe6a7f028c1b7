"""The OSD benchmark's run: a measurement, a ``--replot`` or a ``--merge``, and the end of each
(summary, plot, table, JSON, doc section)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from benchmarks.common import cpu_model, environment, target_name, write_doc_section
from benchmarks.distill import scope
from benchmarks.distill.arms import arm_key, moving, recovery, shift_segments
from benchmarks.distill.cli import parse_args
from benchmarks.distill.constants import DOC_BEGIN, DOC_END, GRID_BEGIN, GRID_END, PARTS, WINDOW
from benchmarks.distill.doc import doc_section, grid_doc_section
from benchmarks.distill.grid import _recipe, grid, grid_markdown
from benchmarks.distill.learning import learning_run, offline_bound, offline_distill, online_config
from benchmarks.distill.scope import report_domains, set_domains
from benchmarks.distill.served import build_workload, interleave, pooled, probe, route
from benchmarks.distill.speed import speed
from benchmarks.distill.summary import summarise
from benchmarks.distill.tables import markdown, plot
from specops.core.models import load_model, load_model_dir
from specops.trainer.promote import PromoteConfig
from specops.workloads.chat_workload import ALL_DOMAINS


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_domains(d.strip() for d in args.domains.split(",") if d.strip())
    if args.replot:
        report = json.loads(args.replot.read_text())
        set_domains(report_domains(report) or scope.DOMAINS)
        args.json = args.json or args.replot
        if report.get("mode") == "teacher_forward":
            from benchmarks import osd_teacher

            return osd_teacher.finish(report, args)
        if "rows" in report and "requests_per_domain" in report:  # a --grid run
            set_domains([d for d in ALL_DOMAINS if d in report["static"]])
            return grid_finish(report, args)
        return finish(report, args)
    if args.merge:
        if json.loads(args.merge[0].read_text()).get("mode") == "teacher_forward":
            from benchmarks import osd_teacher

            return osd_teacher.merge(args.merge, args, argv)
        report = {}
        for path in args.merge:
            part = json.loads(path.read_text())
            if "rows" in part and "requests_per_domain" in part:  # a --grid run: its rows, kept beside the arms
                report["grid"] = {**part, "file": str(path)}
                continue
            if report and not set(report_domains(part)) & set(report_domains(report)):
                # a run of other domains (--domains docs): its summary, reported beside the main run's clusters
                report.setdefault("other_domains", []).append(
                    {"file": str(path), "command": part.get("command"), "summary": part.get("summary") or {}}
                )
                continue
            taken = [k for k in PARTS if k in part and k not in report]  # the first file holding a part gives it
            for key, value in part.items():
                if key == "disjoint" and key in report:  # each part measured its own arms on the disjoint probe
                    for d, arms in value.items():
                        report[key].setdefault(d, {}).update({a: v for a, v in arms.items() if a not in report[key][d]})
                report.setdefault(key, value)
            env = part.get("environment") or {}
            report.setdefault("merged_from", []).append(
                {
                    "file": str(path),
                    "command": part.get("command"),
                    "elapsed_s": part.get("elapsed_s"),
                    "date": part.get("date"),
                    "cpu_model": env.get("cpu_model"),
                    "git_commit": env.get("git_commit"),
                    "parts": taken,
                    "config": part.get("config"),
                }
            )
        report["merge_command"] = " ".join(
            [".venv/bin/python", "benchmarks/osd.py", *map(shlex.quote, argv if argv is not None else sys.argv[1:])]
        )
        report["elapsed_s"] = max(m["elapsed_s"] or 0 for m in report["merged_from"])
        set_domains(report_domains(report))
        return finish(report, args)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model_dir = Path(args.model_dir)
    # Learning is measured in float32, the precision the trainer trains and evaluates in.
    pair = load_model_dir(model_dir, draft_dtype="float32")
    if args.teacher_forward:
        from benchmarks import osd_teacher

        return osd_teacher.run(pair, args, model_dir, argv)
    base_dir = model_dir / "draft"
    streams, probes, routers, distinct, disjoint = build_workload(pair, args, model_dir)
    if args.prepare:
        print(
            f"cached the target's continuations of {sum(len(v) for v in streams.values())} served, "
            f"{sum(len(v) for v in probes.values())} probe and {sum(len(v) for v in disjoint.values())} "
            f"template-disjoint probe requests under {model_dir / 'cache' / 'osd-chat'}"
        )
        return 0
    command = " ".join(
        [".venv/bin/python", "benchmarks/osd.py", *map(shlex.quote, argv if argv is not None else sys.argv[1:])]
    )
    env = {**environment(), "cpu_model": cpu_model()}
    with tempfile.TemporaryDirectory(prefix="specops-osd-") as tmp_s:
        tmp = Path(tmp_s)
        if args.grid:
            g = grid(pair, base_dir, streams, probes, args, tmp, model_dir)
            g.update(
                {
                    "command": command,
                    "date": datetime.now(UTC).isoformat(timespec="seconds"),
                    "environment": env,
                    "distinct_prompts": distinct,
                    "elapsed_s": time.perf_counter() - started,
                }
            )
            return grid_finish(g, args)
        report: dict = {"distinct_prompts": distinct}
        parts = set(args.parts.split(","))
        ocfg = online_config(args)
        report["static"] = {d: probe(pair.draft, probes[d], args).to_dict() for d in scope.DOMAINS}
        if any(disjoint.values()):  # the template-disjoint probe: families served traffic never had
            report["disjoint"] = {d: {"static": probe(pair.draft, disjoint[d], args).to_dict()} for d in scope.DOMAINS}
        drafts: dict = {}
        if "main" in parts:
            # routing: every served and probe request by serving's router; the user message alone as a harder check
            texts = [
                (pair.tokenizer.decode(s.prompt.token_ids), s.prompt.domain)
                for d in scope.DOMAINS
                for s in streams[d] + probes[d]
            ]
            routed = route(routers, [t for t, _ in texts], args)
            user_only = route(routers, [s.prompt.text for d in scope.DOMAINS for s in probes[d]], args)
            truth_user = [d for d in scope.DOMAINS for _ in probes[d]]
            report["routing"] = {
                "accuracy": statistics.fmean(r == d for r, (_, d) in zip(routed, texts)),
                "accuracy_user_only": statistics.fmean(r == d for r, d in zip(user_only, truth_user)),
                "requests": len(texts),
            }
            cluster_of = {
                tuple(s.prompt.token_ids): r
                for (s, r) in zip([s for d in scope.DOMAINS for s in streams[d] + probes[d]], routed)
            }
            traffic = [(s, cluster_of[tuple(s.prompt.token_ids)]) for s in interleave(streams, args.seed)]
            main_run = learning_run(
                pair,
                base_dir,
                pair.draft,
                traffic,
                probes,
                args,
                tmp,
                label="main",
                ocfg=ocfg,
                probe_every=args.probe_every,
                windows=tuple(w.strip() for w in args.main_windows.split(",") if w.strip()),
            )
            report["main"] = {k: v for k, v in main_run.items() if k != "drafts"}
            report["engine_checks"] = main_run["checks"]
            drafts = {
                d: {"gated": main_run["drafts"]["gated"][d], "ungated": main_run["drafts"]["ungated"][d]}
                for d in main_run["drafts"]["gated"]
            }
            for d in report.get("disjoint", {}):
                if d in drafts:
                    for arm in ("gated", "ungated"):
                        report["disjoint"][d][arm] = probe(drafts[d][arm], disjoint[d], args).to_dict()
            if args.json:  # kept even if a later part fails: the main part is most of the run's time
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.with_suffix(".main-part.json").write_text(
                    json.dumps({**report, "command": " ".join(sys.argv)}, indent=1)
                )
        offline = {}
        if "offline" in parts:
            offline = {}
            report["offline"], report["offline_sweep"], report["baseline_10pct"] = {}, {}, {}
            for d in scope.DOMAINS:
                offline[d], bound, report["offline_sweep"][d] = offline_bound(
                    pair.draft, streams[d], probes[d], args, d
                )
                report["offline"][d] = bound.to_dict()
                if args.baseline_fraction:  # the paper's baseline: offline distillation on a tenth of the domain's data
                    part = streams[d][: max(1, int(len(streams[d]) * args.baseline_fraction))]
                    small = offline_distill(pair.draft, part, args, f"{d}/{args.baseline_fraction:.0%} of the data")
                    report["baseline_10pct"][d] = {
                        **probe(small, probes[d], args).to_dict(),
                        "requests": len(part),
                        **({"disjoint": probe(small, disjoint[d], args).to_dict()} if report.get("disjoint") else {}),
                    }
            for d in report.get("disjoint", {}):
                report["disjoint"][d]["offline"] = probe(offline[d], disjoint[d], args).to_dict()
        if args.speed_prompts and "speed" in parts and (drafts or offline):  # offline,speed: the bound's draft alone
            if args.speed_threads:
                torch.set_num_threads(args.speed_threads)
            report["speed_threads"] = torch.get_num_threads()
            report["speed"] = {
                d: speed(
                    pair,
                    {"static": pair.draft, **drafts.get(d, {}), **({"offline": offline[d]} if d in offline else {})},
                    probes[d][: args.speed_prompts],
                    args,
                    cluster=d,
                    champion_alpha=(report.get("main") or {}).get("champion_scores", {}).get(d),
                    offline_alpha=(report.get("offline") or {}).get(d, {}).get("alpha_token"),
                    warm=probes[d][args.speed_prompts : args.speed_prompts + args.auto_warm],
                )
                for d in scope.DOMAINS
                if d in drafts or d in offline
            }
        if args.generic and "generic" in parts:
            from specops.trainer.bootstrap.generic import build_generic_draft

            gdir = build_generic_draft(model_dir, steps=args.generic_steps)
            gdraft = load_model(gdir)
            gtraffic = [
                (s, s.prompt.domain)
                for s in interleave({d: v[: args.generic_requests] for d, v in streams.items()}, args.seed)
            ]
            grun = learning_run(
                pair,
                gdir,
                gdraft,
                gtraffic,
                probes,
                args,
                tmp,
                label="generic",
                ocfg=ocfg,
                probe_every=args.probe_every,
                audit=False,
            )
            report["generic"] = {
                "static": {d: probe(gdraft, probes[d], args).alpha_token for d in scope.DOMAINS},
                "gated": {d: grun["final"][d]["gated"]["alpha_token"] for d in scope.DOMAINS},
                "ungated": {d: grun["final"][d]["ungated"]["alpha_token"] for d in scope.DOMAINS},
                "promotions": len(grun["gates"]) and sum(g["promoted"] for g in grun["gates"]),
                "curves": grun["curves"],
            }
        if args.shift_requests and "shift" in parts and len(scope.DOMAINS) >= 2:
            n = min(args.shift_requests, args.requests // 2)
            windows = tuple(w.strip() for w in args.gate_windows.split(",") if w.strip())
            a, b = scope.DOMAINS[0], scope.DOMAINS[1]
            seq = streams[a][:n] + streams[b][:n] + streams[a][n : 2 * n]
            srun = learning_run(
                pair,
                base_dir,
                pair.draft,
                [(s, "shift") for s in seq],
                {},
                args,
                tmp,
                label="shift",
                ocfg=ocfg,
                windows=windows,
            )
            rows = srun["rows"]
            before = rows[max(0, n - WINDOW) : n]
            ref = pooled(before)
            arms = {"gated": "", "ungated": "u_", **{f"w{arm_key(w)}": f"w{arm_key(w)}_" for w in windows}}
            report["shift"] = {
                "domains": [a, b, a],
                "boundaries": [n, 2 * n],
                "window": PromoteConfig().window,
                "fresh": PromoteConfig().fresh,
                "segments": shift_segments(rows, [a, b, a], n, arms),
                "windows": srun["windows"],
                "audits": srun["promotions"],
                "worse_promotions": sum(p["worse_beyond_noise"] for p in srun["promotions"]),
                "window_curves": {f"w{arm_key(w)}": moving(rows, f"w{arm_key(w)}_") for w in windows},
                "reference": ref,
                "gated_curve": moving(rows),
                "ungated_curve": moving(rows, "u_"),
                "recovery": {
                    "requests": recovery(rows, 2 * n, 3 * n, ref),
                    "reference": ref,
                    "ungated_requests": recovery(
                        rows,
                        2 * n,
                        3 * n,
                        pooled([{"accepted": r["u_accepted"], "rejected": r["u_rejected"]} for r in before]),
                        prefix="u_",
                    ),
                },
                "promotions": sum(g["promoted"] for g in srun["gates"]),
            }
    report.update(
        {
            "command": command,
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "config": {
                "target": target_name(model_dir),
                "requests": args.requests,
                "probe": args.probe,
                "router_texts": args.router_texts,
                "max_new_tokens": args.max_new_tokens,
                "k": args.k,
                "recipe": ", ".join(f"{k} {v}" for k, v in _recipe(ocfg).items()),
                "offline_epochs": args.offline_epochs,
                "offline_lr": args.offline_lr,
                "generic_requests": args.generic_requests if args.generic else None,
                "generic_steps": args.generic_steps if args.generic else None,
                "shift_requests": args.shift_requests,
                "audit_window": args.audit_window,
                "check_every": args.check_every,
                "window": WINDOW,
                "gate_metric": PromoteConfig().metric,
                "gate_window": PromoteConfig().window,
                "gate_fresh": PromoteConfig().fresh,
                "gate_windows": args.gate_windows,
                "main_windows": args.main_windows,
            },
            "environment": env,
            "elapsed_s": time.perf_counter() - started,
        }
    )
    return finish(report, args)


def grid_finish(g: dict, args: argparse.Namespace) -> int:
    """Table, JSON and doc section of a finished (or reloaded) ``--grid`` run."""
    text = grid_markdown(g)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(g, indent=1))
    if not args.no_doc:
        write_doc_section(args.doc, GRID_BEGIN, GRID_END, grid_doc_section(g, text))
    return 0


def finish(report: dict, args: argparse.Namespace) -> int:
    """Summary, plot, table, JSON and doc section of a finished (or reloaded) run."""
    if "main" not in report or "offline" not in report:  # one process's share of --parts: merged later
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1))
        print(f"partial run (parts {sorted(k for k in report if k in PARTS)}): combine the reports with --merge")
        return 0
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
