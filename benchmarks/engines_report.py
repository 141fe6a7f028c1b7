"""The engines benchmark's summary, table and doc section, from its report alone (``--replot`` reuses them)."""

from __future__ import annotations

from benchmarks.common import fmt

SPECOPS_PREFIX = "specops_"


def summarise(report: dict) -> dict:
    arms, cfg = report["arms"], report["config"]
    conc = [str(c) for c in cfg["concurrency"]]
    by_c = {
        c: {
            a: {
                "tokens_per_s": arms[a][c]["tokens_per_s"],
                "p50_s": arms[a][c]["p50_s"],
                "p99_s": arms[a][c]["p99_s"],
                "alpha_token": arms[a][c].get("alpha_token"),
            }
            for a in arms
        }
        for c in conc
    }

    def ratio(a: str, b: str, c: str) -> float | None:
        x, y = by_c[c].get(a, {}).get("tokens_per_s"), by_c[c].get(b, {}).get("tokens_per_s")
        return x / y if x and y else None

    learned = {c: ratio("vllm_learned_draft", "vllm_bootstrap_draft", c) for c in conc}
    ours = [a for a in arms if a.startswith(SPECOPS_PREFIX)]
    best = {c: max(ours, key=lambda a: by_c[c][a]["tokens_per_s"] or 0.0) if ours else None for c in conc}
    env = report.get("environment", {})

    def p99_ratio(c: str) -> float | None:
        if c not in by_c:
            return None
        ours_p99 = by_c[c].get("specops_target", {}).get("p99_s")
        if best[c] and by_c[c][best[c]].get("p99_s"):  # the arm an operator would deploy: the fastest
            ours_p99 = by_c[c][best[c]]["p99_s"]
        base = by_c[c].get("vllm_target", {}).get("p99_s")
        return ours_p99 / base if ours_p99 and base else None

    profile_c = "4" if "4" in conc else (conc[-1] if conc else None)
    profile = {a: arms[a][profile_c].get("profile") for a in ours if profile_c and arms[a][profile_c].get("profile")}
    return {
        "vllm_version": report.get("vllm_version"),
        "cpu": f"{env.get('cpu_model', 'unknown')}, {env.get('cpu_count')} cores",
        "prompts": cfg["prompts"],
        "max_tokens": cfg["max_tokens"],
        "concurrency": cfg["concurrency"],
        "by_concurrency": by_c,
        "learned_vs_bootstrap_draft": learned,
        "learned_bar_met": all(v is not None and v >= 1.0 for v in learned.values()) if learned else None,
        "ours_vs_vllm_target": {c: ratio(best[c], "vllm_target", c) if best[c] else None for c in conc},
        "ours_best_arm": best,
        "ours_target_vs_vllm_target": {c: ratio("specops_target", "vllm_target", c) for c in conc},
        "ours_best_vs_vllm_ngram": {c: ratio(best[c], "vllm_ngram", c) if best[c] else None for c in conc},
        "p99_ratio_c8": p99_ratio("8"),
        "p99_ratios": {c: p99_ratio(c) for c in conc},
        "profile_concurrency": int(profile_c) if profile_c else None,
        "profile": profile,
        "identical_outputs": report["outputs"]["identical"],
        "learned_draft_promotions": report.get("learned_draft", {}).get("promotions"),
    }


def markdown(report: dict) -> str:
    s, arms = report["summary"], report["arms"]
    lines = [
        "| concurrency | arm | tokens/s | × vllm_target | p50 s | p99 s | per-token α | identical to vllm_target |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    detail = report["outputs"]["detail"]
    for c in map(str, report["config"]["concurrency"]):
        base = s["by_concurrency"][c].get("vllm_target", {}).get("tokens_per_s")
        for a in arms:
            row = s["by_concurrency"][c][a]
            same = _identical(a, c, arms, detail)
            rel = row["tokens_per_s"] / base if base and row["tokens_per_s"] else None
            alpha = fmt(row["alpha_token"], ".3f")
            if row["alpha_token"] is not None and (arms[a][c].get("alpha_basis") or "").startswith(
                "accepted / drafted"
            ):
                alpha += " (acc/drafted)"
            lines.append(
                f"| {c} | {a} | {fmt(row['tokens_per_s'], '.1f')} | {fmt(rel, '.2f', 'x')} | "
                f"{fmt(row['p50_s'], '.2f')} | {fmt(row['p99_s'], '.2f')} | {alpha} | {same} |"
            )
    lines += [
        "",
        "| concurrency | learned ÷ bootstrap draft (vLLM) | best ours ÷ vllm_target | best ours | "
        "ours target-only ÷ vllm_target | best ours ÷ vllm_ngram | p99 best ours ÷ vllm_target |",
    ]
    lines.append("|---:|---:|---:|---|---:|---:|---:|")
    for c in map(str, report["config"]["concurrency"]):
        lines.append(
            f"| {c} | {fmt(s['learned_vs_bootstrap_draft'][c], '.2f', 'x')} | {fmt(s['ours_vs_vllm_target'][c], '.2f', 'x')} | "
            f"{s['ours_best_arm'][c] or '–'} | {fmt(s['ours_target_vs_vllm_target'][c], '.2f', 'x')} | "
            f"{fmt((s.get('ours_best_vs_vllm_ngram') or {}).get(c), '.2f', 'x')} | "
            f"{fmt((s.get('p99_ratios') or {}).get(c), '.2f', 'x')} |"
        )
    if s.get("profile"):
        lines += [
            "",
            f"Where our time went at concurrency {s['profile_concurrency']} (shares of the requests' time; of the "
            "batcher thread's wall time):",
            "",
            "| arm | target pass | propose | other (Python, tokenizer, HTTP) | batcher: target passes | draft passes | "
            "gather | idle | rows/pass | tokens/pass | ms/pass |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for a, p in s["profile"].items():
            rq, bt = p["request_shares"], p["batcher_shares"]
            lines.append(
                f"| {a} | {fmt(rq['target_pass'], '.0%')} | {fmt(rq['propose'], '.0%')} | {fmt(rq['other'], '.0%')} | "
                f"{fmt(bt.get('forward'), '.0%')} | {fmt(bt.get('draft_forward'), '.0%')} | "
                f"{fmt(bt.get('gather'), '.0%')} | {fmt(bt.get('idle'), '.0%')} | "
                f"{fmt(p['mean_rows_per_pass'], '.2f')} | {fmt(p['mean_tokens_per_pass'], '.1f')} | "
                f"{fmt(p['ms_per_pass'], '.1f')} |"
            )
    return "\n".join(lines)


def _identical(arm: str, c: str, arms: dict, detail: dict) -> str:
    if arm == "vllm_target":
        return "(reference)"
    for label in (f"{arm} vs vllm_target (token ids)", f"{arm} vs vllm_target (text)"):
        if label in detail and c in detail[label]:
            m, t = detail[label][c]
            return f"{m}/{t}" + (" ids" if "token ids" in label else " text")
    return "–"


def reading(report: dict) -> list[str]:
    """A few sentences derived from the numbers (so they always agree with the table)."""
    s = report["summary"]
    out = []
    conc = list(map(str, report["config"]["concurrency"]))
    lv = s["learned_vs_bootstrap_draft"]
    if any(v is not None for v in lv.values()):
        verdict = "met" if s["learned_bar_met"] else "not met"
        out.append(
            "vLLM with the learned draft vs with the bootstrap draft (tokens/s): "
            + ", ".join(f"c={c} {fmt(lv[c], '.2f', 'x')}" for c in conc)
            + f"; the bar (>= 1.00x at every concurrency) is **{verdict}**."
        )
    ov = s["ours_vs_vllm_target"]
    if any(v is not None for v in ov.values()):
        out.append(
            "Our best arm vs vLLM target-only: "
            + ", ".join(f"c={c} {fmt(ov[c], '.2f', 'x')} ({s['ours_best_arm'][c]})" for c in conc)
            + "; our target-only vs vLLM's: "
            + ", ".join(f"c={c} {fmt(s['ours_target_vs_vllm_target'][c], '.2f', 'x')}" for c in conc)
            + "."
        )
    bars = load_bars(s)
    if bars:
        out.append(
            "Throughput under load (issue 42's bars): "
            + "; ".join(f"{name} {fmt(value, '.2f')} ({'met' if ok else '**not met**'})" for name, value, ok in bars)
            + "."
        )
    mism = report["outputs"]["mismatches"]
    if s["identical_outputs"]:
        out.append("Every greedy output was identical across arms, engines and concurrencies.")
    else:
        by: dict[str, int] = {}
        for m in mism:
            by[m["comparison"]] = by.get(m["comparison"], 0) + 1
        other = {
            k: v
            for k, v in report["outputs"]["detail"].items()
            if "at c vs" in k and any(a != b for a, b in v.values())
        }
        parts = [f"{k}: {v} mismatched" for k, v in by.items()] + [
            f"{k}: " + ", ".join(f"c={c} {a}/{b}" for c, (a, b) in v.items()) for k, v in other.items()
        ]
        out.append("Greedy outputs were **not** all identical: " + "; ".join(parts) + ".")
    return out


def load_bars(s: dict) -> list[tuple[str, float, bool]]:
    """(bar, value, met) for the bars the numbers cover: our target-only >= 0.8x vLLM target-only at
    c = 1, 4, 8; our best arm >= vLLM n-gram at c = 1 and 4; p99 at c = 8 <= 1.25x vLLM target-only's."""
    out = []
    for c in ("1", "4", "8"):
        v = (s.get("ours_target_vs_vllm_target") or {}).get(c)
        if v is not None:
            out.append((f"target-only ÷ vllm_target at c={c} (>= 0.80)", v, v >= 0.8))
    for c in ("1", "4"):
        v = (s.get("ours_best_vs_vllm_ngram") or {}).get(c)
        if v is not None:
            out.append((f"best ours ÷ vllm_ngram at c={c} (>= 1.00)", v, v >= 1.0))
    if s.get("p99_ratio_c8") is not None:
        out.append(("p99 best ours ÷ vllm_target at c=8 (<= 1.25)", s["p99_ratio_c8"], s["p99_ratio_c8"] <= 1.25))
    return out


def doc_section(report: dict, table: str, begin: str, end: str, title: str | None = None) -> str:
    cfg, env, s = report["config"], report["environment"], report["summary"]
    ld = report.get("learned_draft", {})
    if ld.get("kind") == "learned":
        learned = (
            f"the gated champion after {ld['requests']} distinct sql chat requests through the real `OnlineTrainer` "
            f"and promotion gate (version {ld.get('champion_version')}, {ld.get('promotions')} promotions of "
            f"{ld.get('candidates')} candidates; served per-token α {fmt(ld.get('served_alpha_token_first'), '.3f')} "
            f"over the first {ld.get('served_alpha_window')} requests, {fmt(ld.get('served_alpha_token_last'), '.3f')} "
            "over the last)"
        )
    else:
        path = str(ld.get("dir", ""))
        short = path.split("/.specops/", 1)[-1] if "/.specops/" in path else path
        learned = f"{ld.get('kind', 'given')} draft `{short}`" + (
            ", the bootstrap draft (no learning in this run)" if short.endswith("models/draft") else ""
        )
    idle = report["servers"]["idle_cpu_share"]
    idle_txt = ", ".join(f"{n} {v * 100:.1f} %" for n, v in idle.items()) if idle else "not measured"
    extra = {k: v for k, v in s.items() if k in ("swap_failed", "teacher_forward_alpha_gap")}
    loads = sorted(
        x[0]
        for by_c in report["arms"].values()
        for row in by_c.values()
        for x in row.get("load_1m_and_mem_available_gb_after_each_batch", [])
    )
    load_txt = (
        f" The machine's 1-minute load average after each batch: median {loads[len(loads) // 2]:.1f} "
        f"(range {loads[0]:.1f}–{loads[-1]:.1f}) on {env.get('cpu_count')} cores."
        if loads
        else ""
    )
    lines = [
        begin,
        f"## {title or 'Our engine next to vLLM' + chr(39) + 's CPU build'} (`benchmarks/engines.py`)",
        "",
        "Command:",
        "",
        f"    {report['command']}",
        "",
        f"Date {report['date'][:10]}; CPU {env.get('cpu_model')}, {env.get('cpu_count')} cores (shared with other "
        f"work; arms interleaved); vLLM {report.get('vllm_version')}; commit {str(env.get('git_commit'))[:10]}"
        f"{' (dirty)' if env.get('git_dirty') else ''}; run time {report['elapsed_s'] / 60:.0f} min.",
        "",
        f"Target {cfg['target']}, float32 in both engines. {cfg['prompts']} held-out sql chat prompts (never served "
        f"while learning), as token ids, greedy, max_tokens {cfg['max_tokens']}, concurrency "
        f"{', '.join(map(str, cfg['concurrency']))} (interleaved rounds: {_rounds(cfg['rounds'])}), k = {cfg['k']}. vLLM: "
        f"`{cfg['vllm_args']}`, CPU thread binding {cfg['vllm_omp_bind']}, {cfg['kv_cache_gb']:g} GiB KV cache. "
        f"specops serve: {cfg['specops_threads']} threads, draft in {cfg['specops_draft_dtype']}, the "
        f"{'learned' if ld.get('kind') == 'learned' else 'given'} draft as its draft, no session cache. "
        "Learned draft: " + learned + ". Idle CPU of each server while another "
        f"ran nothing (share of one core): {idle_txt}.{load_txt}",
        "",
        table,
        "",
        "α: ours from each response's `speculation` (Σ accepted ÷ (Σ accepted + steps ending in a rejection)); "
        "vLLM's from its Prometheus spec-decode counters around the arm's batches (drafts ending in a rejection = "
        "drafts − drafts whose last position was accepted; `acc/drafted` marks arms whose drafts varied in length, "
        "where only accepted ÷ drafted is known). vLLM runs a draft's full LM head (it ignores `draft_vocab.json`). "
        "Identical: vLLM arms by token ids, ours by text (our API returns text).",
        "",
        *(f"- {line}" for line in reading(report)),
    ]
    if extra:
        lines += ["", *(f"`{k}`: {v}" for k, v in extra.items())]
    lines.append(end)
    return "\n".join(lines)


def _rounds(rounds) -> str:
    return ", ".join(f"{v} at c={c}" for c, v in rounds.items()) if isinstance(rounds, dict) else str(rounds)
