"""Summary, bars, markdown table and plots of ``benchmarks/ralm.py`` (also re-derived from a
saved JSON by ``--replot``)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.common import fmt, save_png
from benchmarks.ralm_curve import ABLATIONS, AUTO, PAPER, PSA, SEQ, SPEC_ARMS, SYNC, headline, model_ceiling

DOC_BEGIN = "<!-- BEGIN ralm (written by benchmarks/ralm.py; edits inside are overwritten) -->"
DOC_END = "<!-- END ralm -->"
KNN_BEGIN = "<!-- BEGIN ralm-knnlm (written by benchmarks/ralm.py --no-curve; edits inside are overwritten) -->"
KNN_END = "<!-- END ralm-knnlm -->"


def markers(report: dict) -> tuple[str, str, str]:
    """(begin, end, png name) of a report's doc section: a run with ``--no-curve`` has its own."""
    return (DOC_BEGIN, DOC_END, "ralm.png") if report["points"] else (KNN_BEGIN, KNN_END, "ralm_knnlm.png")


BARS = {"fraction_of_bound": 0.8, "r_save_for_bound": 0.3, "speedup_at_max_r": 2.0, "min_speedup": 0.97}
KNN_FRACTION = 0.8
CURVE_KEYS = ("retriever", "backend", "passages", "embedder", "clients", "r_save", "r_encode", "bound", "speedup")


def _rnd(x, n: int = 3):
    return None if x is None else round(x, n)


def _knn_largest(report: dict) -> dict | None:
    """The exact searcher's run at the largest datastore (its best k)."""
    sizes = report.get("knnlm", {}).get("sizes", {})
    if not sizes:
        return None
    runs = [r for r in sizes[max(sizes, key=int)]["runs"].values() if r["searcher"] == "exact"]
    return max(runs, key=lambda r: r["speedup"]) if runs else None


def _ceiling(run: dict) -> float | None:
    """A kNN-LM run's model ceiling (``ralm_knnlm.model_ceiling``), computed from its rows for
    reports written before it was recorded."""
    if "model_fraction_of_bound" in run:
        return run["model_fraction_of_bound"]
    from benchmarks.ralm_knnlm import model_ceiling

    return model_ceiling([r["baseline"] for r in run["rows"]], run["hit_rate"])["model_fraction_of_bound"]


def _model_keys(point: dict) -> dict:
    """A curve point's model ceiling (``ralm_curve.model_ceiling``), computed from its rows for
    points saved before it was recorded."""
    if "model_fraction_of_bound" in point:
        return point
    return model_ceiling(point["rows"])


def _model(point: dict) -> float | None:
    """The model ceiling as a fraction of the point's bound."""
    return _model_keys(point)["model_fraction_of_bound"]


def _knn_full(sizes: dict) -> bool:
    """Whether the kNN-LM prompts ran their full length (end-of-sequence ignored)."""
    return bool(sizes) and all(sz.get("ignore_eos") for sz in sizes.values())


def summary(report: dict) -> dict:
    points = report["points"]
    curve = [
        {
            **{k: p[k] for k in CURVE_KEYS},
            "gamma": _rnd(p["gamma"], 4),
            "fraction_of_bound": _rnd(p["arms"][headline(p["arms"])]["fraction_of_bound"], 4),
            "model_fraction_of_bound": _rnd(_model(p), 4),
            **{k: _rnd(_model_keys(p).get(k), 4) for k in ("model_gamma", "model_gamma_needed")},
            **{
                f"speedup_{a.split()[-1].lower()}": _rnd(p["arms"][a]["speedup"], 4)
                for a in SPEC_ARMS
                if a in p["arms"]
            },
            **{
                f"ablation_{a.split(maxsplit=1)[-1].replace(' ', '_')}_vs_default": _rnd(
                    p["arms"][a]["speedup"] / p["arms"][headline(p["arms"])]["speedup"], 4
                )
                for a in ABLATIONS
                if a in p["arms"]
            },
        }
        for p in points
    ]
    for c in curve:
        for k in ("r_save", "r_encode", "bound", "speedup"):
            c[k] = _rnd(c[k], 4)
    bounded = [p for p in points if p["r_save"] >= BARS["r_save_for_bound"]]
    top = max(points, key=lambda p: p["r_save"]) if points else None
    knn = _knn_largest(report)
    knn_runs = [r for s in report.get("knnlm", {}).get("sizes", {}).values() for r in s["runs"].values()]
    identical = all(p["outputs_identical"] for p in points) and all(r["identical"] for r in knn_runs)
    return {
        "curve": curve,
        "min_fraction_of_bound": _rnd(min(p["arms"][headline(p["arms"])]["fraction_of_bound"] for p in bounded), 4)
        if bounded
        else None,
        "min_model_fraction_of_bound": _rnd(min((m for p in bounded if (m := _model(p)) is not None), default=None), 4),
        "speedup_at_max_r": _rnd(top["speedup"], 4) if top else None,
        "max_r_save": _rnd(top["r_save"], 4) if top else None,
        "min_speedup": _rnd(min(p["speedup"] for p in points), 4) if points else None,
        "knnlm_fraction_of_bound": _rnd(knn["fraction_of_bound"], 4) if knn else None,
        "knnlm_speedup": _rnd(knn["speedup"], 4) if knn else None,
        "knnlm_model_fraction_of_bound": _rnd(_ceiling(knn), 4) if knn else None,
        "knnlm_full_length": _knn_full(report.get("knnlm", {}).get("sizes", {})),
        "knnlm_ivfpq_min_speedup": _rnd(
            min((r["speedup"] for r in knn_runs if r["searcher"] == "ivfpq"), default=None), 4
        )
        if any(r["searcher"] == "ivfpq" for r in knn_runs)
        else None,
        "outputs_identical": 1.0 if identical else 0.0,
    }


def bars(report: dict) -> list[tuple[str, str, bool | None]]:
    """(bar, measured, met) for issue 37's bars (RaLMSpec = serving's default arm; the async arm in
    JSONs from before serving chose the verification mode)."""
    s = report["summary"]
    met = lambda x, bar: None if x is None else x >= bar  # noqa: E731
    return [
        (
            f"every point with r_save >= {BARS['r_save_for_bound']}: speed-up >= {BARS['fraction_of_bound']} x 1/(1-r_save)",
            fmt(s["min_fraction_of_bound"], ".0%")
            + (
                f" (RaLMSpec's own model allows {fmt(s['min_model_fraction_of_bound'], '.0%')} there)"
                if s.get("min_model_fraction_of_bound") is not None
                else ""
            ),
            met(s["min_fraction_of_bound"], BARS["fraction_of_bound"]),
        ),
        (
            f"at the highest r_save ({fmt(s['max_r_save'], '.2f')}): RaLMSpec >= {BARS['speedup_at_max_r']}x RaLMSeq",
            fmt(s["speedup_at_max_r"], ".2f", "x"),
            met(s["speedup_at_max_r"], BARS["speedup_at_max_r"]),
        ),
        (
            f"no point below {BARS['min_speedup']}x RaLMSeq",
            fmt(s["min_speedup"], ".2f", "x"),
            met(s["min_speedup"], BARS["min_speedup"]),
        ),
        (
            f"speculative kNN-LM >= {KNN_FRACTION} x its bound at the largest datastore (exact)",
            fmt(s["knnlm_fraction_of_bound"], ".0%"),
            met(s["knnlm_fraction_of_bound"], KNN_FRACTION),
        ),
        (
            "identical outputs everywhere",
            "yes" if s["outputs_identical"] == 1.0 else "NO",
            s["outputs_identical"] == 1.0,
        ),
    ]


def _knn_lines(knn: dict) -> list[str]:
    """The kNN-LM table of ``report["knnlm"]["sizes"]``."""
    lines: list[str] = []
    if knn:
        lines += [
            "",
            "**Speculative kNN-LM** (a datastore search per token vs RaLMSpec §5.3; `r`: the baseline's search "
            "share; bound 1 / (1 - r); model ceiling: the fraction of it RaLMSpec's own objective allows at the measured "
            "γ (hit rate) and the baseline's costs per token and per search, best stride, cache free; off: share of "
            "tokens OS³'s off rule decoded with a search each"
            + ("; every prompt runs its full length, end-of-sequence ignored" if _knn_full(knn) else "")
            + "):",
            "",
            "| entries | searcher | k | build s (exact: keys; IVFPQ: its index) | baseline s | speculative s | speed-up | r | bound | of bound "
            "| hit rate | model ceiling | off | identical |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
        ]
        for n, sz in knn.items():
            for run in sz["runs"].values():
                b = sz["build"].get(run["searcher"], {})
                built = b.get("index_s") if run["searcher"] == "ivfpq" else b.get("build_s")
                lines.append(
                    f"| {int(n):,} | {run['searcher']} | {run['k']} | {fmt(built, '.0f')} "
                    f"| {run['baseline_s']:.2f} | {run['speculative_s']:.2f} | {run['speedup']:.2f}x | {run['r']:.2f} "
                    f"| {run['bound']:.2f}x | {run['fraction_of_bound']:.0%} | {run['hit_rate']:.2f} "
                    f"| {fmt(_ceiling(run), '.0%')} "
                    f"| {fmt(run.get('unspeculated_share'), '.0%')} | {'yes' if run['identical'] else 'NO'} |"
                )
    return lines


def markdown(report: dict, plot_rel: str | None) -> str:
    if not report["points"]:
        return knn_markdown(report, plot_rel)
    a = report["args"]
    lines = [
        DOC_BEGIN,
        "## RaLMSpec vs RaLMSeq along the retrieval-cost curve, and speculative kNN-LM",
        "",
        "```sh",
        report["command"],
        "```",
        "",
        f"Target {report['target']}; greedy; {a['max_new_tokens']} new tokens; a retrieval every 4 tokens on the "
        "last 32 tokens, its passage (at most 256 tokens) put before the question; generation between retrievals "
        f"target-only. {report['questions']} questions from the KB's own documents, in waves of `clients` "
        f"concurrent requests; arms interleaved per wave (order rotating), {a['runs']} run(s), the median kept. "
        f"CPU: {report.get('cpu', '?')}, {report['environment']['cpu_count']} cores; wall time "
        f"{report['wall_s'] / 60:.0f} min.",
        "",
        "`r_save`: RaLMSeq's share of time in KB searches (transport and queueing included): all that "
        "speculation can remove. `bound` = 1 / (1 - r_save), from the RaLMSeq arm. `r_encode`: query encoding, "
        "which every arm pays. γ: share of the cache's guesses equal to the KB's answer (paper-OS3 arm). "
        "Model ceiling: the speed-up RaLMSpec's own objective allows at RaLMSeq's measured costs per interval and "
        "per search and the best γ any arm measured, best stride, sync or async, cache and rework free, as a "
        "fraction of the bound. "
        "Speed-up: RaLMSeq's wall time over the arm's. "
        + (
            "`RaLMSpec` is serving's default (OS3 with speculation off when it cannot pay, verification "
            "asynchronous while a request decodes alone, synchronous beside others or over embedded Milvus Lite); "
            "`sync` and `async` fix "
            "that choice; `paper OS3` always speculates."
            if any(AUTO in p["arms"] for p in report["points"])
            else "`async` is our default (OS3 with speculation off when it cannot pay); `paper OS3` always speculates."
        ),
        "",
    ]
    main = headline(report["points"][0]["arms"]) if report["points"] else PSA
    shown = [a for a in (AUTO, SYNC, PSA, PAPER) if report["points"] and a in report["points"][0]["arms"]]
    lines += [
        "| point | search ms | r_save | r_encode | bound | γ | "
        + " | ".join(a.replace("RaLMSpec ", "") for a in shown)
        + f" | {main.replace('RaLMSpec ', '')} / bound | model ceiling / bound | identical |",
        "|---|---:|---:|---:|---:|---:|" + "---:|" * (len(shown) + 2) + ":---:|",
    ]
    for p in report["points"]:
        ar = p["arms"]
        lines.append(
            f"| {p['label']} | {p['kb_search_ms']:.0f} | {p['r_save']:.2f} | {p['r_encode']:.2f} | {p['bound']:.2f}x "
            f"| {fmt(p['gamma'], '.2f')} | "
            + " | ".join(f"{ar[a]['speedup']:.2f}x" for a in shown)
            + f" | {ar[headline(ar)]['fraction_of_bound']:.0%} | {fmt(_model(p), '.0%')} "
            f"| {'yes' if p['outputs_identical'] else 'NO'} |"
        )
    ablated = [a for a in ABLATIONS if any(a in p["arms"] for p in report["points"])]
    if ablated:
        lines += [
            "",
            "Ablations (RaLMSpec §5): serving's default with one refinement changed, speed-up over RaLMSeq "
            "(and over the default). Asynchronous verification off is the `sync` column above.",
            "",
            "| point | " + " | ".join(a.replace("RaLMSpec ", "") for a in ablated) + " |",
            "|---|" + "---:|" * len(ablated),
        ]
        for p in report["points"]:
            ar = p["arms"]
            base = ar[headline(ar)]["speedup"]
            cells = [f"{ar[a]['speedup']:.2f}x ({ar[a]['speedup'] / base:.2f})" if a in ar else "–" for a in ablated]
            lines.append(f"| {p['label']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Where the time goes (mean per request: generation / retrieval wait; KB calls; mean stride; rounds "
        "unspeculated):",
        "",
        f"| point | RaLMSeq G / R s | {main.replace('RaLMSpec ', '')} G / R s | KB calls / intervals | stride "
        "| unspeculated |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for p in report["points"]:
        q, x = p["arms"][SEQ], p["arms"][headline(p["arms"])]
        lines.append(
            f"| {p['label']} | {q['generate_s']:.2f} / {q['retrieval_s']:.2f} | {x['generate_s']:.2f} / "
            f"{x['retrieval_s']:.2f} | {x['kb_calls']:.1f} / {x['intervals']:.1f} | {fmt(x['mean_stride'], '.2f')} "
            f"| {x['unspeculated']:.1f} |"
        )
    lines += _knn_lines(report.get("knnlm", {}).get("sizes", {}))
    lines += ["", "| bar | measured | met |", "|---|---|:---:|"]
    for bar, measured, ok in bars(report):
        lines.append(f"| {bar} | {measured} | {'–' if ok is None else 'yes' if ok else 'no'} |")
    if plot_rel:
        lines += ["", f"![RaLMSpec speed-up against r_save, with the bound]({plot_rel})"]
    lines += ["", DOC_END]
    return "\n".join(lines)


def knn_markdown(report: dict, plot_rel: str | None) -> str:
    """The doc section of a run with ``--no-curve``: speculative kNN-LM alone."""
    a = report["args"]
    sizes = report.get("knnlm", {}).get("sizes", {})
    s = report["summary"]
    lines = [
        KNN_BEGIN,
        "## Speculative kNN-LM against kNN-LM (RaLMSpec §5.3)",
        "",
        "```sh",
        report["command"],
        "```",
        "",
        f"Target {report['target']}; greedy; {a['knnlm_new_tokens']} new tokens from each of "
        f"{a['knnlm_prompts']} prompts (the curve's first questions), λ 0.25; datastores of the target's hidden "
        "states over the KB sources, exact and IVFPQ; baseline and speculative interleaved per prompt. "
        f"CPU: {report.get('cpu', '?')}, {report['environment']['cpu_count']} cores; wall time "
        f"{report['wall_s'] / 60:.0f} min.",
    ]
    lines += _knn_lines(sizes)
    lines += ["", "| bar | measured | met |", "|---|---|:---:|"]
    for bar, measured, ok in bars(report):
        if "kNN-LM" in bar or "identical" in bar:
            lines.append(f"| {bar} | {measured} | {'–' if ok is None else 'yes' if ok else 'no'} |")
    lines += [
        "",
        f"IVFPQ's slowest speed-up: {fmt(s.get('knnlm_ivfpq_min_speedup'), '.2f', 'x')}.",
    ]
    if plot_rel:
        lines += ["", f"![speculative kNN-LM speed-up against r, with the bound]({plot_rel})"]
    lines += ["", KNN_END]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> bool:
    """Speed-up against r_save for each RaLMSpec arm, with 1/(1-r) and 0.8 of it; kNN-LM beside
    (or alone, for a run with ``--no-curve``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = report["points"]
    knn = [r for s in report.get("knnlm", {}).get("sizes", {}).values() for r in s["runs"].values()]
    if not points and not knn:
        return False
    panels = int(bool(points)) + int(bool(knn))
    fig, axes = plt.subplots(1, panels, figsize=(11 if panels == 2 else 6, 4.2), squeeze=False)
    if points:
        _curve_panel(axes[0][0], points)
    if knn:
        _knn_panel(axes[0][panels - 1], knn)
    return save_png(fig, path)


def _curve_panel(ax, points: list[dict]) -> None:
    import numpy as np

    r = np.linspace(0, min(0.95, max(p["r_save"] for p in points) + 0.1), 200)
    ax.plot(r, 1 / (1 - r), "k-", lw=1, label="bound 1/(1-r_save)")
    ax.plot(r, 0.8 / (1 - r), "k--", lw=0.8, label="0.8 x bound")
    ax.axhline(1.0, color="#999999", lw=0.6)
    arms = ((SYNC, "s", "#55a868"), (PSA, "o", "#4c72b0"), (PAPER, "^", "#c44e52"), (AUTO, "D", "#8172b2"))
    for arm, marker, color in [x for x in arms if all(x[0] in p["arms"] for p in points)]:
        ax.scatter(
            [p["r_save"] for p in points],
            [p["arms"][arm]["speedup"] for p in points],
            marker=marker,
            color=color,
            label=arm,
            zorder=3,
        )
    for p in points:
        ax.annotate(
            f"{p['backend']} {p['passages'] // 1000}k" + (f" x{p['clients']}" if p["clients"] > 1 else ""),
            (p["r_save"], p["arms"][headline(p["arms"])]["speedup"]),
            fontsize=6,
            xytext=(3, 3),
            textcoords="offset points",
        )
    ax.set_xlabel("r_save (RaLMSeq's share of time in KB search + transport)")
    ax.set_ylabel("speed-up over RaLMSeq")
    ax.set_title("RaLMSpec along the retrieval-cost curve", fontsize=9)
    ax.legend(fontsize=7)


def _knn_panel(ax, knn: list[dict]) -> None:
    import numpy as np

    rk = np.linspace(0, min(0.95, max(x["r"] for x in knn) + 0.05), 200)
    ax.plot(rk, 1 / (1 - rk), "k-", lw=1, label="bound 1/(1-r)")
    ax.plot(rk, 0.8 / (1 - rk), "k--", lw=0.8, label="0.8 x bound")
    ax.axhline(1.0, color="#999999", lw=0.6)
    for searcher, color in (("exact", "#4c72b0"), ("ivfpq", "#dd8452")):
        xs = [x for x in knn if x["searcher"] == searcher]
        ax.scatter([x["r"] for x in xs], [x["speedup"] for x in xs], color=color, label=searcher, zorder=3)
    ax.set_xlabel("r (baseline's share of time in datastore search)")
    ax.set_ylabel("speed-up over kNN-LM")
    ax.set_title("speculative kNN-LM", fontsize=9)
    ax.legend(fontsize=7)
