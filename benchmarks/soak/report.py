"""The soak's report (``benchmarks/faults.py`` is the command): the invariants and kill-window tables
and the faults section of ``docs/benchmarks.md``."""

from __future__ import annotations

from rich.table import Table

from benchmarks.common import fmt
from benchmarks.soak.stack import TIE_TOL

DOC_BEGIN = "<!-- BEGIN faults (written by benchmarks/faults.py; edits inside are overwritten) -->"
DOC_END = "<!-- END faults -->"


# ---------------------------------------------------------------- report
def tables(report: dict) -> tuple[list[Table], str]:
    s, comp = report["summary"], report["components"]
    rows = [
        ("requests sent", s["requests"], ""),
        ("answered (200)", s["answered"], ""),
        ("failed outside the kill windows", s["failed_outside_kill_windows"], "0"),
        ("killed server's in-flight requests (failed)", s["failed_in_flight_at_server_kill"], "counted apart"),
        ("sent while the server was down (failed)", s["failed_sent_while_server_down"], "counted apart"),
        ("accepted records lost (misses + generations)", s["accepted_records_lost"], "0"),
        ("records of answered requests still queued at a kill", s["answered_unaccepted_at_kill"], "counted apart"),
        ("records the serving logger dropped (never accepted)", s["logger_dropped_records"], "0"),
        (
            "versions registered / duplicated",
            f"{s['versions_registered']} / {s['versions_duplicated']}",
            "0 duplicated",
        ),
        ("outputs equal to target-only, token for token", f"{s['outputs_identical']} / {s['outputs_checked']}", "all"),
        ("  … the others: the target's choice at an exact tie", s["outputs_tie_flips"], "counted apart"),
        ("outputs diverged from target-only", s["outputs_diverged"], "0"),
        ("requests naming a made-up cluster refused (400 `cluster`)", s.get("unknown_clusters_refused"), "all"),
        ("another tenant's LLMA probe: past-session hits", s.get("cross_tenant_session_hits"), "0"),
        ("another tenant's extraction: tokens recovered", s.get("cross_tenant_tokens_recovered"), "0"),
        ("  … the owner's own extraction (positive control)", s.get("own_tenant_tokens_recovered"), "> 0"),
    ]
    head = Table(title="Soak under kills: invariants")
    for col in ("measure", "value", "required"):
        head.add_column(col, justify="left" if col != "value" else "right")
    md = ["| measure | value | required |", "|---|---:|---|"]
    for r in rows:
        head.add_row(*map(str, r))
        md.append(f"| {' | '.join(map(str, r))} |")
    kt = Table(title="Kill windows (SIGKILL → back)")
    cols = ("component", "kills", "window median", "window max", "requests overlapping", "answered overlapping")
    for col in cols:
        kt.add_column(col, justify="left" if col == "component" else "right")
    md += [
        "",
        "| component | kills | window median | window max | requests overlapping | answered overlapping |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for c, v in comp.items():
        cells = (
            c,
            str(v["kills"]),
            fmt(v["window_s_median"], ".1f", " s"),
            fmt(v["window_s_max"], ".1f", " s"),
            str(v["requests_overlapping"]),
            str(v["answered_overlapping"]),
        )
        kt.add_row(*cells)
        md.append(f"| {' | '.join(cells)} |")
    return [head, kt], "\n".join(md)


def doc_section(report: dict, table: str) -> str:
    c, env, s = report["config"], report["environment"], report["summary"]
    kills = ", ".join(f"{w['component']} at {w['killed_at']:.0f} s" for w in report["kills"])
    return "\n".join(
        [
            DOC_BEGIN,
            "## Soak and faults (`benchmarks/faults.py`)",
            "",
            "Command:",
            "",
            f"    {report['command']}",
            "",
            f"Date {report['date'][:10]}; {env['cpu_count']} CPU cores, {c['threads']} torch thread(s) per process, no GPU; "
            f"commit {str(env['git_commit'])[:10]}{' (dirty)' if env['git_dirty'] else ''}. Models: {c['models']}. "
            f"`mlflow server` (SQLite store, served artifacts), `specops serve` (local stream log, registry over HTTP) "
            f"and `specops train` (`--gate-margin -1`: every update is registered and promoted) as separate processes; "
            f"{c['clients']} clients sending distinct greedy requests ({c['max_tokens']} new tokens, draft method) for "
            f"{report['load_s']:.0f} s; {sum(s['kills'].values())} SIGKILLs at seeded random points (seed {c['seed']}): "
            f"{kills}. Each killed process was restarted after a random 0-5 s on the same port, store, stream and "
            f"checkpoints; at the end the server got SIGTERM (exit {s['server_exit_on_sigterm']}) and the trainer SIGINT "
            f"(exit {s['trainer_exit_on_sigint']}). Run time {report['elapsed_s']:.0f} s. The clients take turns "
            f"between two API keys; after the load the driver checks tenant isolation and cluster bounds on the last "
            f"server (requests naming made-up clusters; the extraction replay of one key's output through LLMA's past "
            f"sessions by a third key that sends nothing else, with the owner's own probe as the positive control).",
            "",
            table,
            "",
            f"The trainer registered {s['versions_registered']} versions and promoted {s['promotions']}; requests were "
            f"served by {len(s['draft_versions_served'])} draft versions (base included). Logger drops: "
            f"{s['logger_dropped'] or 'none'}; duplicate records in the stream: {s['duplicate_records']}. Invariants: "
            f"{'all hold' if s['invariants_hold'] else 'VIOLATED: ' + '; '.join(s['violations'])}.",
            "",
            "A *kill window* runs from the SIGKILL to the restarted process being back (`/readyz` 200 for the server, "
            "`/health` 200 for MLflow, the restarted trainer's startup line in its log); windows of different components "
            "may overlap, and a component is killed again only once it is back. *Answered overlapping* a server window "
            "are requests the restarted server answered before the driver's next `/readyz` poll. Only the server's "
            "windows excuse a failed request: a failure overlapping one is an *in-flight* request of the killed server "
            "(sent before the kill) or was *sent while it was down*; the trainer and the registry are off the request path, so a request "
            "that failed anywhere else counts as *failed outside the kill windows*. A record is *accepted* once the "
            "serving stream logger's publish returned; *lost* counts, for the server stopped with SIGTERM, every "
            "answered request's missing record, and for each killed server the larger of its last scraped "
            "`specops_stream_logger_published_total` minus its records in the stream and the records missing before "
            "a later record of the same server (one cluster is one partition, published in order). Answered requests "
            "whose records were still queued in a killed server's memory are the documented limit and are counted "
            "apart. A version is *duplicated* when its `source_id` (trainer / cluster / checkpoint) or its training "
            "window (`lineage_offsets`) repeats an earlier version's. Outputs are compared with target-only greedy "
            f"decoding of every answered prompt in the benchmark's process ({s['output_tokens_checked']} of them also "
            "token for token with their GenerationRecord); an output that differs only where the target's top two "
            f"logits tie (every served token within {TIE_TOL:g} of the target's float64 maximum given the served "
            "prefix) is the target's output with a float32 tie broken the other way by a batched verification "
            "(`serving/engine/batching.py`), counted apart; any other difference is *diverged*.",
            DOC_END,
        ]
    )
