"""Teacher-forward training measured (``benchmarks/osd.py --teacher-forward``): does a draft learn
as much from requests an external engine (vLLM) served, which log no target distribution, as
from the same requests served by ours?

Our engine logs, for every finished request, the target's top-64 at each rejected position
(``native``). vLLM hands out no distribution: its requests are logged with no positions
(``MissRecord.engine = "vllm"``, ``scored`` False) and the trainer recomputes the target's
distribution by teacher forward (``specops.trainer.data.TargetTeacher``, batched per update). Per
domain and recipe, two ``OnlineTrainer`` arms learn from the SAME served requests (same
prompts, same outputs, same request ids, so the same held-out split), each serving with its
own newest draft as ``osd.py``'s ``ungated`` arm does:

- ``native``: the records as our engine logs them (the replayed engine's rejected positions,
  the target's top-64 there, from the continuation cache);
- ``teacher_forward``: the same requests as unscored records.

Recipes: ``positions=all`` (the trainer's default) trains every output position with the
teacher's distribution in both arms, so the two arms compute the same examples, up to the
float rounding of a batched forward against a one-at-a-time one: they should coincide, and the
report shows how closely (probe α and the largest weight difference). ``positions=rejected``
trains the native arm at the logged rejected positions and the teacher-forward arm at the
positions where its current draft would be rejected (``specops.trainer.data.rejected_example``: the
same positions, plus the disagreements the engine did not draft, after a full run of ``k``).

Reported per domain and recipe: per-token α on the held-out probe of the static draft and of
each arm's final draft, the gains and their gap (the bar: within 0.02), the teacher's seconds
per request batched (the teacher-forward arm of ``all``) and one at a time (the native arm of
``all``, which forwards each request alone), and the trainer's CPU per request.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shlex
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from tqdm import tqdm

from benchmarks import osd
from benchmarks.common import cpu_model, environment, target_name, write_doc_section
from specops.core.models import ModelPair
from specops.serving.engine.types import SamplingParams
from specops.serving.fleet.stream_logger import LoggerConfig, RequestMeta, StreamLogger
from specops.streams import StreamConfig
from specops.trainer.data import TargetTeacher
from specops.trainer.online.trainer import OnlineTrainer
from specops.workloads.chat_workload import DOMAINS, chat_workload

DOC_BEGIN = "<!-- BEGIN osd-teacher (written by benchmarks/osd.py --teacher-forward; edits inside are overwritten) -->"
DOC_END = "<!-- END osd-teacher -->"
RECIPES = ("all", "rejected")
ARMS = ("native", "teacher_forward")
GAP_BAR = 0.02
"""Teacher-forward's per-token α gain may differ from the native path's by at most this much."""


def workload(pair: ModelPair, args, model_dir: Path, domains: list[str]) -> tuple[dict, dict]:
    """Per domain: the served requests and the probe with the target's continuations (only
    ``domains`` are generated; ``osd.py``'s cache is shared)."""
    sizes = {"router": args.router_texts, "served": args.requests, "probe": args.probe}  # osd.py's prompts
    parts = chat_workload(pair.tokenizer, sizes, domains=tuple(domains), seed=args.seed)
    cache = model_dir / "cache" / "osd-chat"
    streams, probes = {}, {}
    for d in domains:
        served = osd.continuations(pair, parts[d]["served"] + parts[d]["probe"], args.max_new_tokens, cache, args.batch)
        streams[d], probes[d] = served[: args.requests], served[args.requests :]
    return streams, probes


def arm_run(
    pair: ModelPair, base_dir: Path, traffic: list[osd.Served], args, tmp: Path, *, label: str, recipe: str, arm: str
) -> dict:
    """One trainer learning from ``traffic`` as ``arm`` logs it; serving with its newest draft."""
    cfg = StreamConfig(url=f"local://{tmp}/{label}/log", fsync=False, num_partitions=1)
    logger = StreamLogger(cfg, LoggerConfig(), vocab_size=pair.vocab_size)
    ocfg = osd.online_config(args, positions=recipe)
    trainer = OnlineTrainer(cfg, base_dir, tmp / label / "trainer", ocfg, target=pair.target)
    teacher = trainer.teacher
    assert isinstance(teacher, TargetTeacher)
    latest, version = copy.deepcopy(pair.draft), 0
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    engine = "" if arm == "native" else "vllm"
    cpu, served_rows = 0.0, []
    try:
        for i, s in enumerate(tqdm(traffic, desc=label, unit="req", leave=False)):
            out = osd.serve(latest, s, args.k, args.max_new_tokens)
            served_rows.append({"accepted": out.accepted, "rejected": len(out.rejected)})
            result = osd.logged_result(s, out, pair.vocab_size)
            if engine:  # an external engine: the same request, no distribution logged
                result = dataclasses.replace(result, rejections=[])
            # the same request id in both arms: the same held-out split (by hash of the id)
            meta = RequestMeta(request_id=f"{s.prompt.domain}-{i}", cluster=s.prompt.domain, engine=engine)
            logger.log(s.prompt.token_ids, result, params, meta)
            logger.flush(30)
            c0 = time.process_time()
            while trainer.step():
                pass
            cpu += time.process_time() - c0
            st = trainer.clusters.get(s.prompt.domain)
            if st is not None and st.version != version:
                version = st.version
                latest.load_state_dict(st.published.state_dict())
    finally:
        logger.close()
        trainer.close()
    st = trainer.clusters[traffic[0].prompt.domain]
    return {
        "draft": latest,
        "version": version,
        "records_trained": st.records_trained,
        "positions_trained": st.positions_trained,
        "teacher_forwards": teacher.forwards,
        "teacher_batches": teacher.batches,
        "teacher_s": teacher.seconds,
        "teacher_s_per_request": teacher.seconds / teacher.forwards if teacher.forwards else None,
        "trainer_cpu_s_per_request": cpu / len(traffic),
        "served_alpha_token": osd.pooled(served_rows),
    }


def run(pair: ModelPair, args, model_dir: Path, argv: list[str] | None) -> int:
    """The ``--teacher-forward`` mode of ``benchmarks/osd.py``: runs the arms, prints the table,
    writes ``--json`` and the doc section."""
    started = time.perf_counter()
    domains = [d.strip() for d in args.tf_domains.split(",") if d.strip()]
    unknown = [d for d in domains if d not in DOMAINS]
    if unknown or not domains:
        raise SystemExit(f"--tf-domains: unknown domain(s) {unknown}; choose from {', '.join(DOMAINS)}")
    streams, probes = workload(pair, args, model_dir, domains)
    base_dir = model_dir / "draft"
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="specops-osd-tf-") as tmp_s:
        tmp = Path(tmp_s)
        for d in domains:
            static = osd.probe(pair.draft, probes[d], args)
            rows[d] = {"static": static.to_dict(), "recipes": {}}
            for recipe in RECIPES:
                arms, probed, drafts = {}, {}, {}
                for arm in ARMS:
                    r = arm_run(
                        pair, base_dir, streams[d], args, tmp, label=f"{d}-{recipe}-{arm}", recipe=recipe, arm=arm
                    )
                    drafts[arm] = r.pop("draft")
                    probed[arm] = osd.probe(drafts[arm], probes[d], args)
                    arms[arm] = {
                        **r,
                        "probe": probed[arm].to_dict(),
                        "gain": probed[arm].alpha_token - static.alpha_token,
                    }
                native, tf = probed["native"].per_request, probed["teacher_forward"].per_request
                entry = {
                    "arms": arms,
                    "gap": abs(arms["native"]["gain"] - arms["teacher_forward"]["gain"]),
                    "probe_requests_identical": sum(a == b for a, b in zip(native, tf)),
                    "probe_requests": len(native),
                    "max_abs_weight_diff": max(
                        float((a - b).abs().max())
                        for a, b in zip(
                            drafts["native"].state_dict().values(), drafts["teacher_forward"].state_dict().values()
                        )
                    ),
                }
                rows[d]["recipes"][recipe] = entry
    command = " ".join(
        [".venv/bin/python", "benchmarks/osd.py", *map(shlex.quote, argv if argv is not None else sys.argv[1:])]
    )
    report = {
        "mode": "teacher_forward",
        "domains": rows,
        "command": command,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": {
            "target": target_name(model_dir),
            "domains": domains,
            "requests": args.requests,
            "probe": args.probe,
            "max_new_tokens": args.max_new_tokens,
            "k": args.k,
            "recipe": ", ".join(
                f"{k} {v}" for k, v in osd._recipe(osd.online_config(args)).items() if k != "positions"
            ),
            "threads": args.threads,
        },
        "environment": {**environment(), "cpu_model": cpu_model()},
        "elapsed_s": time.perf_counter() - started,
    }
    return finish(report, args)


def finish(report: dict, args) -> int:
    """Summary, table, JSON and doc section of a finished run (or of a saved one: ``--replot``)."""
    report["summary"] = summarise(report)
    table = markdown(report)
    print(table)
    print(json.dumps(report["summary"], indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    if not args.no_doc:
        write_doc_section(args.doc, DOC_BEGIN, DOC_END, doc_section(report, table))
    return 0


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarise(report: dict) -> dict:
    rows = report["domains"]
    gap = max(e["gap"] for r in rows.values() for e in r["recipes"].values())
    arm = lambda recipe, name: [r["recipes"][recipe]["arms"][name] for r in rows.values()]  # noqa: E731
    return {
        "domains": list(rows),
        "alpha_token_static": {d: r["static"]["alpha_token"] for d, r in rows.items()},
        "alpha_token": {
            recipe: {
                name: {d: r["recipes"][recipe]["arms"][name]["probe"]["alpha_token"] for d, r in rows.items()}
                for name in ARMS
            }
            for recipe in RECIPES
        },
        "gain": {
            recipe: {name: {d: r["recipes"][recipe]["arms"][name]["gain"] for d, r in rows.items()} for name in ARMS}
            for recipe in RECIPES
        },
        "teacher_forward_alpha_gap": gap,
        "gap_bar": GAP_BAR,
        "gap_bar_met": gap <= GAP_BAR,
        "teacher_s_per_request": {
            # the all-positions recipe runs the teacher on every request in both arms: batched for
            # the unscored records, one request at a time for the logged ones
            "batched": _mean([a["teacher_s_per_request"] for a in arm("all", "teacher_forward")]),
            "one_at_a_time": _mean([a["teacher_s_per_request"] for a in arm("all", "native")]),
            "batched_rejected_recipe": _mean([a["teacher_s_per_request"] for a in arm("rejected", "teacher_forward")]),
        },
        "trainer_cpu_s_per_request": {
            recipe: {name: _mean([a["trainer_cpu_s_per_request"] for a in arm(recipe, name)]) for name in ARMS}
            for recipe in RECIPES
        },
        "all_positions_max_abs_weight_diff": {d: r["recipes"]["all"]["max_abs_weight_diff"] for d, r in rows.items()},
        "all_positions_probe_requests_identical": {
            d: f"{r['recipes']['all']['probe_requests_identical']}/{r['recipes']['all']['probe_requests']}"
            for d, r in rows.items()
        },
    }


def _f(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    s = report["summary"]
    lines = [
        "| domain | recipe | static | native | teacher-forward | native gain | teacher-forward gain | gap "
        "| positions trained (native / teacher-forward) | teacher s / request | trainer CPU s / request "
        "(native / teacher-forward) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for d, r in report["domains"].items():
        for recipe, e in r["recipes"].items():
            n, t = e["arms"]["native"], e["arms"]["teacher_forward"]
            teacher = (
                f"{_f(t['teacher_s_per_request'])} batched, {_f(n['teacher_s_per_request'])} one at a time"
                if recipe == "all"
                else f"{_f(t['teacher_s_per_request'])} batched"
            )
            lines.append(
                f"| {d} | {recipe} | {r['static']['alpha_token']:.3f} | {n['probe']['alpha_token']:.3f} "
                f"| {t['probe']['alpha_token']:.3f} | {n['gain']:+.3f} | {t['gain']:+.3f} | {e['gap']:.3f} "
                f"| {n['positions_trained']} / {t['positions_trained']} | {teacher} "
                f"| {_f(n['trainer_cpu_s_per_request'], '.2f')} / {_f(t['trainer_cpu_s_per_request'], '.2f')} |"
            )
    lines += [
        "",
        f"`teacher_forward_alpha_gap` (largest |native gain − teacher-forward gain|): "
        f"{s['teacher_forward_alpha_gap']:.3f} (bar ≤ {GAP_BAR}: {'met' if s['gap_bar_met'] else 'missed'}); "
        f"`teacher_s_per_request`: {_f(s['teacher_s_per_request']['batched'])} s batched, "
        f"{_f(s['teacher_s_per_request']['one_at_a_time'])} s one at a time.",
    ]
    return "\n".join(lines)


def merge(paths: list[Path], args, argv: list[str] | None) -> int:
    """``--merge`` of ``--teacher-forward`` reports of different ``--tf-domains`` (each run kept short):
    one report with every domain; the first run's config leads."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    report = copy.deepcopy(parts[0])
    for part in parts[1:]:
        if part.get("mode") != "teacher_forward":
            raise SystemExit(f"--merge: {part.get('command')} is not a --teacher-forward report")
        report["domains"].update(part["domains"])
    report["config"]["domains"] = list(report["domains"])
    report["merged_from"] = [
        {
            "file": str(path),
            "command": part["command"],
            "elapsed_s": part["elapsed_s"],
            "date": part["date"],
            "cpu_model": part["environment"].get("cpu_model"),
            "domains": list(part["domains"]),
        }
        for path, part in zip(paths, parts)
    ]
    report["merge_command"] = " ".join(
        [".venv/bin/python", "benchmarks/osd.py", *map(shlex.quote, argv if argv is not None else sys.argv[1:])]
    )
    report["elapsed_s"] = sum(m["elapsed_s"] for m in report["merged_from"])
    return finish(report, args)


def doc_section(report: dict, table: str) -> str:
    c, env = report["config"], report["environment"]
    same = ", ".join(f"{d} {v}" for d, v in report["summary"]["all_positions_probe_requests_identical"].items())
    runs = report.get("merged_from") or [
        {"command": report["command"], "elapsed_s": report["elapsed_s"], "date": report["date"]}
    ]
    commands = [f"    {m['command']}" for m in runs] + (
        [f"    {report['merge_command']}"] if report.get("merge_command") else []
    )
    return "\n".join(
        [
            DOC_BEGIN,
            "### Teacher-forward training: requests served by an external engine (`benchmarks/osd.py --teacher-forward`)",
            "",
            "Commands:" if len(commands) > 1 else "Command:",
            "",
            *commands,
            "",
            f"Date {report['date'][:10]}; CPU {env['cpu_model']}, {env.get('cpu_count', '?')} cores, "
            f"{c['threads']} torch threads; run time "
            + " + ".join(f"{m['elapsed_s'] / 60:.0f} min" for m in runs)
            + f". Target {c['target']}, "
            f"bootstrap draft; {c['requests']} chat requests per domain ({', '.join(c['domains'])}), up to "
            f"{c['max_new_tokens']} new tokens, greedy, k = {c['k']}; per-token α on a held-out probe of "
            f"{c['probe']} requests. Trainer: {c['recipe']}. Each row: two trainers fed the same served "
            "requests, `native` as our engine logs them (rejected positions, the target's top-64 there), "
            "`teacher-forward` as vLLM's are logged (no positions: the trainer recomputes the target's "
            "distribution, batched per update).",
            "",
            table,
            "",
            "At every position (`all`) the two arms train on the same distributions, up to the rounding of "
            f"a batched forward: probe requests served identically by the two final drafts: {same}; largest "
            "difference of a weight between them: "
            + ", ".join(f"{d} {v:.1e}" for d, v in report["summary"]["all_positions_max_abs_weight_diff"].items())
            + ".",
            DOC_END,
        ]
    )
