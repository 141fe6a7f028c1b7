"""The engines benchmark's summary, table and doc section, from its report alone (``--replot`` reuses them)."""

from __future__ import annotations

from benchmarks.common import fmt

SPECOPS_PREFIX = "specops_"
VLLM_BEST = {  # vLLM's arms an operator would pick the best of, by CPU binding
    "all": ("vllm_target", "vllm_ngram"),
    "default": ("vllm_target_default", "vllm_ngram_default"),
}


def summarise(report: dict) -> dict:
    arms, cfg = report["arms"], report["config"]
    conc = [str(c) for c in cfg["concurrency"]]
    by_c = {
        c: {
            a: {
                "tokens_per_s": arms[a][c]["tokens_per_s"],
                "p50_s": arms[a][c]["p50_s"],
                "p99_s": arms[a][c]["p99_s"],
                "ttft_s": arms[a][c].get("ttft_s"),
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

    def best_of(names: tuple[str, ...], c: str) -> str | None:
        have = [a for a in names if by_c[c].get(a, {}).get("tokens_per_s")]
        return max(have, key=lambda a: by_c[c][a]["tokens_per_s"]) if have else None

    vllm_best = {binding: {c: best_of(VLLM_BEST[binding], c) for c in conc} for binding in ("all", "default")}

    def p99_vs(binding: str, c: str) -> float | None:
        theirs = vllm_best[binding].get(c)
        if c not in by_c or not best[c] or not theirs:
            return None
        ours_p99, their_p99 = by_c[c][best[c]].get("p99_s"), by_c[c][theirs].get("p99_s")
        return ours_p99 / their_p99 if ours_p99 and their_p99 else None

    def p99_target(theirs: str, c: str) -> float | None:
        ours_p99 = by_c.get(c, {}).get("specops_target", {}).get("p99_s")
        their_p99 = by_c.get(c, {}).get(theirs, {}).get("p99_s")
        return ours_p99 / their_p99 if ours_p99 and their_p99 else None

    fair = {
        "isolated": bool(cfg.get("isolated")),
        "vllm_every_core": any(
            a in arms and str(v) != "vLLM's default" for a, v in (cfg.get("vllm_omp_bind") or {}).items()
        )
        if isinstance(cfg.get("vllm_omp_bind"), dict)
        else cfg.get("vllm_omp_bind") not in (None, "auto"),
        "cpu_model": env.get("cpu_model"),
        "ours_target_vs_vllm_target_all": {c: ratio("specops_target", "vllm_target", c) for c in conc},
        "ours_best_vs_vllm_best_all": {
            c: ratio(best[c], vllm_best["all"][c], c) if best[c] and vllm_best["all"][c] else None for c in conc
        },
        "vllm_best_arm_all": vllm_best["all"],
        "p99_ratio_c8_all": p99_vs("all", "8"),
        "p99_ratio_c8_target_all": p99_target("vllm_target", "8"),
        "p99_ratio_c8_target_default": p99_target("vllm_target_default", "8"),
        "p99_ratios_all": {c: p99_vs("all", c) for c in conc},
        "ours_target_vs_vllm_target_default": {c: ratio("specops_target", "vllm_target_default", c) for c in conc},
        "ours_best_vs_vllm_best_default": {
            c: ratio(best[c], vllm_best["default"][c], c) if best[c] and vllm_best["default"][c] else None for c in conc
        },
        "p99_ratio_c8_default": p99_vs("default", "8"),
        "auto_vs_target": {c: ratio("specops_auto", "specops_target", c) for c in conc},
        "greedy_mismatches": len(report["outputs"]["mismatches"]),
    }
    profile_c = "8" if "8" in conc else ("4" if "4" in conc else (conc[-1] if conc else None))
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
        **fair,
    }


def markdown(report: dict) -> str:
    s, arms = report["summary"], report["arms"]
    lines = [
        "| concurrency | arm | tokens/s | × vllm_target | p50 s | p99 s | TTFT p50 s | per-token α | identical to vllm_target |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
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
                f"{fmt(row['p50_s'], '.2f')} | {fmt(row['p99_s'], '.2f')} | {fmt(row.get('ttft_s'), '.3f')} | "
                f"{alpha} | {same} |"
            )
    learned = any(v is not None for v in (s.get("learned_vs_bootstrap_draft") or {}).values())
    lines += [
        "",
        "| concurrency | ours target-only ÷ vLLM target-only (every core) | best ours ÷ vLLM's best (every core) | "
        "best ours | vLLM's best | p99 best ÷ best (every core) | ours target-only ÷ vLLM target-only (default "
        "binding) | best ours ÷ vLLM's best (default binding) | auto ÷ our target-only |"
        + (" learned ÷ bootstrap draft (vLLM) |" if learned else ""),
        "|---:|---:|---:|---|---|---:|---:|---:|---:|" + ("---:|" if learned else ""),
    ]
    for c in map(str, report["config"]["concurrency"]):
        g = lambda key: (s.get(key) or {}).get(c)  # noqa: E731
        lines.append(
            f"| {c} | {fmt(g('ours_target_vs_vllm_target_all'), '.2f', 'x')} | "
            f"{fmt(g('ours_best_vs_vllm_best_all'), '.2f', 'x')} | {s['ours_best_arm'][c] or '–'} | "
            f"{g('vllm_best_arm_all') or '–'} | {fmt(g('p99_ratios_all'), '.2f', 'x')} | "
            f"{fmt(g('ours_target_vs_vllm_target_default'), '.2f', 'x')} | "
            f"{fmt(g('ours_best_vs_vllm_best_default'), '.2f', 'x')} | {fmt(g('auto_vs_target'), '.2f', 'x')} |"
            + (f" {fmt(s['learned_vs_bootstrap_draft'][c], '.2f', 'x')} |" if learned else "")
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
            "Throughput under load (issue 54's bars, one engine on the machine at a time): "
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
    """(bar, value, met) for issue 54's bars that the numbers cover: our target-only >= 0.8x vLLM
    target-only (every core) at c = 4, 8, 16; our best arm >= vLLM's best arm (every core) at c = 1
    and 4; p99 at c = 8 <= 1.25x vLLM's (best arms, every core); no greedy mismatch."""
    out = []
    for c in ("4", "8", "16"):
        v = (s.get("ours_target_vs_vllm_target_all") or {}).get(c)
        if v is not None:
            out.append((f"target-only ÷ vLLM target-only (every core) at c={c} (>= 0.80)", v, v >= 0.8))
    for c in ("1", "4"):
        v = (s.get("ours_best_vs_vllm_best_all") or {}).get(c)
        if v is not None:
            out.append((f"best ours ÷ vLLM's best (every core) at c={c} (>= 1.00)", v, v >= 1.0))
    if s.get("p99_ratio_c8_all") is not None:
        v = s["p99_ratio_c8_all"]
        out.append(("p99 best ours ÷ vLLM's best (every core) at c=8 (<= 1.25)", v, v <= 1.25))
    if s.get("p99_ratio_c8_target_all") is not None:
        v = s["p99_ratio_c8_target_all"]
        out.append(("p99 target-only ÷ vLLM target-only (every core) at c=8 (<= 1.25)", v, v <= 1.25))
    v = (s.get("auto_vs_target") or {}).get("8")
    if v is not None:
        out.append(("auto ÷ our target-only at c=8 (>= 1.00)", v, v >= 1.0))
    if s.get("greedy_mismatches") is not None and out:
        out.append(("greedy mismatches (0)", s["greedy_mismatches"], s["greedy_mismatches"] == 0))
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
    extra = {k: v for k, v in s.items() if k in ("swap_failed", "teacher_forward_alpha_gap")}
    binds = cfg.get("vllm_omp_bind")
    bind_txt = (
        "; ".join(f"{a} `{v}`" for a, v in binds.items()) if isinstance(binds, dict) else f"`{binds}` for every arm"
    )
    kinds = cfg.get("prompt_kinds") or []
    kind_txt = ", ".join(f"{kinds.count(k)} {k}" for k in sorted(set(kinds))) if kinds else "sql chat"
    protocol = (
        f"**One engine on the machine at a time**: each server group (a vLLM server per vLLM arm, one `specops serve` "
        f"for our arms) started, warmed up, run at every concurrency and stopped before the next starts; the prompts "
        f"in {cfg.get('repeats')} slices, one per repeat, the groups' order rotated each repeat "
        f"(orders: {report['servers'].get('group_order')})."
        if cfg.get("isolated")
        else "Servers up at once, arms interleaved (the protocol before issue 54)."
    )
    lines = [
        begin,
        f"## {title or 'Our engine next to vLLM' + chr(39) + 's CPU build'} (`benchmarks/engines.py`)",
        "",
        "Command:",
        "",
        f"    {report['command']}",
        "",
        f"Date {report['date'][:10]}; CPU {env.get('cpu_model')}, {env.get('cpu_count')} cores; vLLM "
        f"{report.get('vllm_version')}; commit {str(env.get('git_commit'))[:10]}"
        f"{' (dirty)' if env.get('git_dirty') else ''}; run time {report['elapsed_s'] / 60:.0f} min. {protocol}",
        "",
        f"Target {cfg['target']}, float32 in both engines. {cfg['prompts']} held-out prompts never served while "
        f"learning ({kind_txt}), as token ids, streamed, greedy, max_tokens {cfg['max_tokens']}, concurrency "
        f"{', '.join(map(str, cfg['concurrency']))}, k = {cfg['k']}. vLLM: `{cfg['vllm_args']}`, "
        f"`VLLM_CPU_OMP_THREADS_BIND`: {bind_txt}; {cfg['kv_cache_gb']:g} GiB KV cache. "
        f"specops serve: {cfg['specops_threads']} threads, draft in {cfg['specops_draft_dtype']}, linear route "
        f"{cfg.get('specops_cpu_linear', 'auto')}, the {ld.get('kind', 'given')} draft as its draft, no session "
        f"cache. Draft: {learned}.{load_txt}",
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
