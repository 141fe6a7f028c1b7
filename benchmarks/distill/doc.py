"""The OSD benchmark's section of docs/benchmarks.md."""

from __future__ import annotations

import shlex

from benchmarks.distill.arms import shift_markdown
from benchmarks.distill.constants import (
    AUTO_STATIC_BAR,
    DOC_BEGIN,
    DOC_END,
    GAIN_BAR,
    GRID_BEGIN,
    GRID_END,
    OFFLINE_FRACTION_BAR,
    RECOVERY_BAR,
    RECOVERY_MARGIN,
    SHIFT_MARGIN,
    SHIFT_WINDOW,
)


def _flag(command: str | None, flag: str) -> str | None:
    """The value given to ``flag`` in a recorded command line (reports written before the config recorded it)."""
    words = shlex.split(command or "")
    return words[words.index(flag) + 1] if flag in words[:-1] else None


def offline_note(s: dict, c: dict) -> str:
    """How the offline bound was made, for the doc's header."""
    sw = s.get("offline_swept")
    if not sw:
        return f"{c['offline_epochs']} epochs"
    best = "; ".join(f"{d} lr {w['best']['lr']:g}, {w['best']['epochs']} epochs" for d, w in sw.items())
    return f"the best on the probe of {next(iter(sw.values()))['configs']} (lr, epochs) configurations ({best})"


def doc_section(report: dict, table: str, plot_rel: str) -> str:
    c, env, s = report["config"], report["environment"], report["summary"]
    checks = s["engine_checks"]
    bars = s["bars"]
    rec = s["recovery_requests"]
    sh = report.get("shift") or {}
    merged = report.get("merged_from") or []
    gc = next((m["config"] for m in merged if "generic" in m.get("parts", []) and m.get("config")), c)
    steps = gc.get("generic_steps") or _flag(
        next((m["command"] for m in merged if "generic" in m.get("parts", [])), ""), "--generic-steps"
    )
    gen_note = (
        f" Generic start (a draft of the bootstrap's shape trained on hard labels only"
        f"{f' for {steps} steps' if steps else ''}, never distilled from the target; "
        f"{gc.get('generic_requests')} requests per domain)."
        if report.get("generic")
        else ""
    )
    if merged:  # one process per share of the parts, merged: every command, and where and when each ran
        commands = [f"    {m['command']}" for m in merged] + [f"    {report.get('merge_command', '')}"]
        commands += [
            "",
            "Parts (each its own process, 1 torch thread, on the same prepared workload): "
            + "; ".join(
                f"{', '.join(m['parts'])} on {str(m.get('date'))[:10]}, {m.get('cpu_model') or '?'}, commit "
                f"{str(m.get('git_commit'))[:10]}, {(m.get('elapsed_s') or 0) / 60:.0f} min"
                for m in merged
            )
            + ".",
        ]
    else:
        commands = [f"    {report['command']}"]
    return "\n".join(
        [
            DOC_BEGIN,
            "## Online distillation on chat traffic (`benchmarks/osd.py`)",
            "",
            "Command:" if not merged else "Commands:",
            "",
            *commands,
            "",
            f"{'Main part: ' if merged else ''}Date {report['date'][:10]}; CPU {env.get('cpu_model', '?')}, {env['cpu_count']} cores, {env['threads']} torch "
            f"threads, no GPU; commit {str(env['git_commit'])[:10]}{' (dirty)' if env['git_dirty'] else ''}. Target "
            f"{c['target']}, bootstrap draft. Traffic: **chat** requests (system + user message, chat template) in "
            f"{len(s['clusters'])} domains the bootstrap never saw ({', '.join(s['clusters'])}), {c['requests']} "
            f"**distinct** requests per domain (`distinct_prompts: {str(s['distinct_prompts']).lower()}`), arriving "
            f"interleaved, routed by a MiniLM router fitted on {c['router_texts']} other prompts per domain (routing "
            f"accuracy {s['routing_accuracy']:.3f}; {s['routing_accuracy_user_only']:.3f} on the user message alone), up "
            f"to {c['max_new_tokens']} new tokens, greedy, k = {c['k']}. α is the paper's **per-token α** on a held-out "
            f"probe of {c['probe']} never-served requests per domain. Trainer: {c['recipe']}. Offline bound: the "
            f"bootstrap draft distilled on the same traffic at every position, {offline_note(s, c)}.{gen_note} "
            f"Run time {report['elapsed_s'] / 60:.0f} min.",
            "",
            f"![per-token α over requests]({plot_rel})",
            "",
            table,
            "",
            "| summary | value | bar |",
            "|---|---:|---:|",
            f"| `gain_gated_min` (gated − static, smallest over clusters) | {s['gain_gated_min']:+.3f} | ≥ +{GAIN_BAR:.2f} "
            f"{'met' if bars['gain_gated_min >= 0.10'] else '**not met**'} |",
            f"| `gain_ungated_min` | {s['gain_ungated_min']:+.3f} | |",
            f"| `offline_fraction_min` (gated gain ÷ offline gain) | {s['offline_fraction_min'] if s['offline_fraction_min'] is None else round(s['offline_fraction_min'], 3)} "
            f"| ≥ {OFFLINE_FRACTION_BAR} {'met' if bars['offline_fraction_min >= 0.8'] else '**not met**'} |",
            f"| `promotions` (per cluster) | {s['promotions']} ({', '.join(f'{d} {n}' for d, n in s['promotions_per_cluster'].items())}) "
            f"of {s['gate_candidates']} candidates | ≥ 1 per cluster {'met' if bars['>= 1 promotion per cluster'] else '**not met**'} |",
            f"| `worse_promotions` (audited on the next {c['audit_window']} requests) | {s['worse_promotions']} | 0 "
            f"{'met' if bars['0 worse promotions'] else '**not met**'} |",
            f"| `recovery_requests` ({' → '.join(sh.get('domains', []))}: back within {RECOVERY_MARGIN} of the level before "
            f"the switch) | {'not reached' if rec is None else rec} | ≤ {RECOVERY_BAR} "
            f"{'met' if bars['recovery <= 300 requests'] else '**not met**'} |",
            *(
                [
                    f"| `shift_gated_minus_ungated_min` (worst segment after the first, {SHIFT_WINDOW} requests "
                    f"ending at 150 of the new domain; gate window {s.get('gate_window')}, "
                    f"{s.get('gate_fresh', 0)} fresh) | "
                    f"{s['shift_gated_minus_ungated_min']:+.3f} | ≥ −{SHIFT_MARGIN} "
                    f"{'met' if bars['shift: gated >= ungated - 0.05 after 150'] else '**not met**'} |",
                    "| `shift_adapt_requests` (gated; ungated) | "
                    + ", ".join(
                        f"{k} {v if v is not None else 'not reached'}; {s['shift_ungated_adapt_requests'][k]}"
                        for k, v in s["shift_adapt_requests"].items()
                    )
                    + f" | ≤ 300 {'met' if bars['shift: adapted in <= 300 requests'] else '**not met**'} |",
                    f"| `shift_worse_promotions` (audited on the next {c['audit_window']} requests) | "
                    f"{s['shift_worse_promotions']} | 0 {'met' if bars['shift: 0 worse promotions'] else '**not met**'} |",
                ]
                if "shift_adapt_requests" in s
                else []
            ),
            *(
                [
                    "| `gain_template_disjoint_min` (gated − static on the template-disjoint probe, smallest over "
                    f"clusters) | {s['gain_template_disjoint_min']:+.3f} | ≥ +{GAIN_BAR:.2f} "
                    f"{'met' if bars['template-disjoint gain >= 0.10'] else '**not met**'} |",
                ]
                if "gain_template_disjoint_min" in s
                else []
            ),
            *(
                [
                    "| `auto_default_vs_static_min` (`auto` with the champion ÷ with the static draft, worst cluster) | "
                    f"{s['auto_default_vs_static_min']:.2f}x | ≥ {AUTO_STATIC_BAR}x "
                    f"{'met' if bars['auto: champion >= 1.1x static'] else '**not met**'} |",
                    "| `auto_default_vs_target_min` (`auto` with the champion ÷ target-only, worst cluster) | "
                    f"{s['auto_default_vs_target_min']:.2f}x | ≥ 1.0x "
                    f"{'met' if bars['auto: champion >= 1.0x target-only'] else '**not met**'} |",
                ]
                if "auto_default_vs_static_min" in s
                else []
            ),
            f"| `routing_accuracy` | {s['routing_accuracy']:.3f} | |",
            f"| `trainer_cpu_s_per_request` | {s['trainer_cpu_s_per_request']:.3f} | |",
            "",
            f"Engine check: every {c['check_every']}-th request was also decoded by `SpecEngine`; "
            f"{checks['identical']}/{checks['n']} outputs identical to the target's, the engine's per-token α equal to "
            f"the replayed one on {checks['alpha_equal']}/{checks['n']}.",
            *(["", "### The gate after a drift", "", shift_markdown(sh)] if sh.get("segments") else []),
            *real_text_markdown(s),
            *sampling_markdown(s),
            DOC_END,
        ]
    )


def real_text_markdown(s: dict) -> list[str]:
    """The doc's lines for the real-text domains' own runs (``summary.real_text``)."""
    out: list[str] = []
    for o in s.get("real_text", []):
        out += [
            "",
            f"### Real text, not templates: {', '.join(o['clusters'])} (`{o['file']}`)",
            "",
            *([f"    {o['command']}", ""] if o.get("command") else []),
            "Documentation paragraphs of pinned packages (transformers, torch, sympy, mlflow, ...; read from "
            "site-packages, which the bootstrap corpus never lists), each asked to be rewritten in plain words: "
            f"{o.get('requests_per_cluster')} distinct requests per cluster; its template-disjoint probe is the "
            "packages served traffic never had (flask, jinja2, rich, click). Per-token α:",
            "",
            "| cluster | static | gated | ungated | offline bound | gated gain | gain, disjoint packages "
            "| of offline gain | promotions (worse) | auto: champion ÷ static, ÷ target-only |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for d in o["clusters"]:
            dj = (o.get("gain_template_disjoint") or {}).get("gated", {}).get(d)
            fr = (o.get("offline_fraction") or {}).get(d)
            vs = (o.get("auto_default_vs_static") or {}).get(d)
            vt = (o.get("auto_default_vs_target") or {}).get(d)
            out.append(
                f"| {d} | {o['alpha_token_static'][d]:.3f} | {o['alpha_token_gated'][d]:.3f} | "
                f"{o['alpha_token_ungated'][d]:.3f} | {o['alpha_token_offline'][d]:.3f} | {o['gain_gated'][d]:+.3f} | "
                + ("-" if dj is None else f"{dj:+.3f}")
                + " | "
                + ("-" if fr is None else f"{fr:.2f}")
                + f" | {o.get('promotions')} ({o.get('worse_promotions')}) | "
                + ("-" if vs is None else f"{vs:.2f}x, {vt:.2f}x")
                + " |"
            )
    return out


def sampling_markdown(s: dict) -> list[str]:
    """The doc's line for the grid's sampling comparison (``summary.sampling_grid``)."""
    g = s.get("sampling_grid")
    if not g:
        return []
    levels = [lv for lv in ("teacher", "student", "mixed") if lv in g]
    return [
        "",
        *([f"    {g['command']}", ""] if g.get("command") else []),
        f"Sampling (OSD Table 1, from the recipe grid's center recipe, {g['requests_per_domain']} requests per "
        "domain, ungated, per-token α on the probe, mean over domains): "
        + "; ".join(
            f"{lv}{' (λ = ' + str(g[lv]['mix']) + ')' if 'mix' in g[lv] else ''} {g[lv]['mean']:.3f} "
            f"({g[lv]['gain_vs_static']:+.3f}), {g[lv]['trainer_cpu_s_per_request']:.2f} trainer CPU s / request"
            for lv in levels
        )
        + ".",
    ]


def grid_doc_section(g: dict, text: str) -> str:
    """The recipe grid's section of docs/benchmarks.md (markers included): ``g`` a ``--grid`` report,
    ``text`` its ``grid_markdown``."""
    env = g["environment"]
    return "\n".join(
        [
            GRID_BEGIN,
            "### The recipe grid (`benchmarks/osd.py --grid`)",
            "",
            "Command:",
            "",
            f"    {g['command']}",
            "",
            f"Date {g['date'][:10]}; CPU {env['cpu_model']}, {env['cpu_count']} cores.",
            "",
            text,
            GRID_END,
        ]
    )
