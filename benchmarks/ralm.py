"""RaLMSpec against RaLMSeq along the retrieval-cost curve, and speculative kNN-LM against
kNN-LM (RaLMSpec §5), on one target.

RaLMSpec can only hide what RaLMSeq spends waiting for the knowledge base. Where the KB is an
in-process index of a few hundred thousand passages that is a few percent of the time and
there is nothing to win; where it is a shared service (a vector database over the network,
queried by many replicas at once) it can be most of it. So every arm is measured at points of
growing retrieval cost (``--points``, ``BACKEND/RETRIEVER/PASSAGES[xCLIENTS][/minilm]``):

- ``memory``: the KB in this process (``specops.serving.retrieval.kb``), hashed-TF-IDF KBs of growing
  size (up to the largest this machine holds: the exact retriever reads every vector per
  search), or MiniLM KBs with any retriever (``/minilm``);
- ``milvus-lite``: the KB in a Milvus collection, Milvus Lite embedded in this process;
- ``milvus-server``: the same collection served by ``milvus-lite server`` in its own process,
  reached over loopback gRPC, with 1, 4 or 8 concurrent clients (requests) at once.

At every point the same questions (built from the KB sources' own documents, so the answer is
in the KB) run RaLMSeq and three RaLMSpec arms (sync, async, the paper's OS³), interleaved;
see ``benchmarks/ralm_curve.py`` for r_save, r_encode, the bound 1 / (1 - r_save) and γ.
Every arm's output is compared with RaLMSeq's token for token.

kNN-LM (``benchmarks/ralm_knnlm.py``): the search-every-token baseline against the speculative
loop over datastores of the target's hidden states, exact and IVFPQ, at each of
``--knnlm-sizes``.

Usage: ``python benchmarks/ralm.py [--quick] [--json PATH] [--doc docs/benchmarks.md]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import cpu_model, environment, finish_report, target_name  # noqa: E402
from benchmarks.ralm_curve import ABLATE_AT, Point, headline, parse_point, point_summary, run_point  # noqa: E402
from benchmarks.ralm_kbs import MilvusService, SourceText, hash_kb, milvus_kb, minilm_kb  # noqa: E402
from benchmarks.ralm_questions import interleaved, question_sets  # noqa: E402
from benchmarks.ralm_report import markdown, markers, plot, summary  # noqa: E402
from benchmarks.ralm_resume import RESUME_KEYS, Checkpoint, cpus_of, kb_fingerprint  # noqa: E402

log = logging.getLogger("benchmarks.ralm")
FULL_POINTS = (
    "memory/exact/100000,memory/exact/1000000,memory/exact/3000000,milvus-lite/exact/100000,"
    "milvus-server/exact/1000000,milvus-server/exact/1000000x4,milvus-server/exact/1000000x8,"
    "memory/hnsw/100000/minilm,memory/bm25/100000/minilm"
)
"""The curve's points; the last two are the approximate dense (HNSW) and the sparse (BM25) retrievers
over a MiniLM KB (issue 60). They come last so that a checkpoint of the first seven resumes."""
QUICK_POINTS = "memory/exact/2000,memory/exact/8000,milvus-lite/exact/2000,milvus-server/exact/2000x2"


def parse(argv) -> argparse.Namespace:
    from specops.paths import models_dir

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--quick", action="store_true", help="small KBs, 2 questions per set, 32 tokens, 1 run")
    p.add_argument("--json", type=Path, help="write the results (with a `summary`) here")
    p.add_argument("--doc", type=Path, help="write the tables into this markdown file (docs/benchmarks.md)")
    p.add_argument("--plot", type=Path, help="PNG of the curve (default: img/ralm.png beside --doc, else --json)")
    p.add_argument("--replot", type=Path, metavar="JSON", help="re-derive summary, table, plot and doc; runs nothing")
    p.add_argument("--model-dir", default=str(models_dir()), help="bootstrap directory (default: %(default)s)")
    p.add_argument("--cache-dir", default=".specops/bench/ralm", help="KBs, collections and datastores, built once")
    p.add_argument("--source", action="append", help="text sources for the KBs (default: man pages + /usr/share/doc)")
    p.add_argument("--points", default=None, help=f"comma-separated curve points (default {FULL_POINTS})")
    p.add_argument("--questions", type=int, default=None, help="questions per set, 3 sets (default 10, quick 2)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128, quick 32")
    p.add_argument("--runs", type=int, default=None, help="runs per wave, the median kept (default 3, quick 1)")
    p.add_argument(
        "--kb-cores",
        type=int,
        default=None,
        help="cores given to retrieval (the milvus-lite server process and RaLMSpec's verification workers); "
        "the LM and everything else run on the others (default: 1 when the machine has 2 or more, else 0 = "
        "no pinning)",
    )
    p.add_argument(
        "--ablations",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run serving's default with prefetch 256, a fixed stride of 3 and regeneration on a mismatch "
        "(default: on, off with --quick)",
    )
    p.add_argument(
        "--ablate-at",
        choices=ABLATE_AT,
        default="memory-exact",
        help="the points --ablations runs at: 'memory-exact' (the in-memory exact points, where the retrieval "
        "cost alone varies; default) or 'all' (every point: about 60 %% more time at the service points)",
    )
    p.add_argument(
        "--resume",
        type=Path,
        metavar="PATH",
        help="checkpoint after every wave to PATH and go on from what it holds (a run longer than a session; "
        "see benchmarks/ralm_resume.py)",
    )
    p.add_argument("--no-knnlm", action="store_true")
    p.add_argument(
        "--no-curve",
        action="store_true",
        help="kNN-LM only (its own section of --doc, ralm-knnlm, and plot ralm_knnlm.png; write it to another --json)",
    )
    p.add_argument("--knnlm-sizes", default=None, help="datastore entries, comma-separated (default 100000,300000)")
    p.add_argument("--knnlm-dir", default=None, metavar="DIR", help="use this saved exact kNN-LM datastore")
    p.add_argument("--knnlm-k", default=None, help="comma-separated k (default 16, quick 16)")
    p.add_argument("--knnlm-prompts", type=int, default=None, help="prompts (the first questions) (default 8)")
    p.add_argument("--knnlm-new-tokens", type=int, default=None, help="default: --max-new-tokens")
    args = p.parse_args(argv)
    full = dict(
        questions=10,
        max_new_tokens=128,
        runs=3,
        knnlm_sizes="100000,300000",
        knnlm_k="16",
        knnlm_prompts=8,
        ablations=True,
    )
    quick = dict(
        questions=2, max_new_tokens=32, runs=1, knnlm_sizes="3000", knnlm_k="16", knnlm_prompts=2, ablations=False
    )
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.points = [parse_point(s) for s in (args.points or (QUICK_POINTS if args.quick else FULL_POINTS)).split(",")]
    args.question_point = args.points[0]  # the KB the questions (and kNN-LM's prompts) are drawn from
    if args.no_curve:
        if args.no_knnlm:
            raise SystemExit("--no-curve with --no-knnlm leaves nothing to run")
        args.points = []
    args.knnlm_new_tokens = args.knnlm_new_tokens or args.max_new_tokens
    args.knnlm_k = [int(k) for k in str(args.knnlm_k).split(",") if k]
    args.knnlm_sizes = [int(n) for n in str(args.knnlm_sizes).split(",") if n]
    args.cache_dir = str(Path(args.cache_dir) / ("quick" if args.quick else "full"))
    cores = sorted(os.sched_getaffinity(0))
    if args.kb_cores is None:
        args.kb_cores = 1 if len(cores) >= 2 else 0
    if not 0 <= args.kb_cores < len(cores):
        raise SystemExit(f"--kb-cores must be in 0..{len(cores) - 1} on this machine ({len(cores)} cores)")
    args.kb_core_set = set(cores[len(cores) - args.kb_cores :]) if args.kb_cores else None
    args.lm_core_set = set(cores[: len(cores) - args.kb_cores]) if args.kb_cores else None
    return args


def pin_lm(args) -> None:
    """This process (the LM, its clients, RaLMSeq's searches) onto the LM's cores, torch sized to them."""
    if args.lm_core_set:
        import torch

        os.sched_setaffinity(0, args.lm_core_set)
        torch.set_num_threads(len(args.lm_core_set))
        log.info("LM on cores %s, retrieval on cores %s", sorted(args.lm_core_set), sorted(args.kb_core_set))


def finish(report: dict, args) -> None:
    """Summary, table, plot, JSON and doc section of a finished (or reloaded) run."""
    begin, end, png = markers(report)
    finish_report(report, args, summary=summary, markdown=markdown, plot=plot, png_name=png, begin=begin, end=end)


def memory_kb(point: Point, text: SourceText, tok, args):
    if point.embedder == "minilm":  # one KB with every retriever the run's MiniLM points of this size ask for
        wanted = {p.retriever for p in args.points if p.embedder == "minilm" and p.passages == point.passages}
        return minilm_kb(point.passages, sorted(wanted | {point.retriever}), tok, args)[0]
    if point.retriever != "exact":
        raise SystemExit(f"--points: hash KBs are built with the exact retriever only ({point.label})")
    return hash_kb(text, point.passages, args)[0]


def run_points(args, engine, tok, ck: Checkpoint) -> tuple[list[dict], list]:
    """Every point in order (KBs built on first use and dropped when no later point needs them);
    points and waves the checkpoint holds are kept, not rerun."""
    from benchmarks.ralm_questions import Question

    text = SourceText(args)
    questions = [Question(**q) for q in ck.questions()] if ck.questions() else None
    out = []
    for i, point in enumerate(args.points):
        if ck.point(i) is not None:
            out.append(ck.point(i))
            log.info("%s: measured in an earlier session (--resume)", point.label)
            continue
        kb = memory_kb(point, text, tok, args)
        if questions is None:  # the same questions at every point, from the first KB's documents
            questions = interleaved(question_sets(kb, args.questions))
            ck.save_questions([asdict(q) for q in questions])
            log.info("%d questions from %s", len(questions), kb.name)
        fingerprint = kb_fingerprint(kb)
        service = None
        try:
            if point.backend != "memory":
                service = MilvusService(point.backend, Path(args.cache_dir) / f"{point.backend}.db", args.kb_core_set)
                service.start()
                kb = milvus_kb(kb, service, point.retriever)
            rows = run_point(
                point,
                kb,
                engine,
                tok,
                questions,
                args,
                resume=ck.rows(i, fingerprint),
                on_wave=lambda rows, i=i, f=fingerprint, p=point: ck.save_rows(i, f, rows, point_summary(p, rows)),
            )
        finally:
            if service is not None:
                service.stop()
        s = point_summary(point, rows)
        s.update(label=point.label, rows=rows, kb=kb.describe(), kb_fingerprint=fingerprint, cpu=cpus_of(rows))
        out.append(s)
        ck.save_point(i, s)
        log.info(
            "%s: r_save %.2f (r_encode %.2f), bound %.2fx, RaLMSpec %.2fx (%.0f%% of it), gamma %s",
            point.label,
            s["r_save"],
            s["r_encode"],
            s["bound"],
            s["speedup"],
            100 * s["arms"][headline(s["arms"])]["fraction_of_bound"],
            s["gamma"],
        )
        del kb
        gc.collect()
    if questions is None and not args.no_knnlm:  # --no-curve: the questions the curve's first point would ask
        kb = memory_kb(args.question_point, text, tok, args)
        questions = interleaved(question_sets(kb, args.questions))
        ck.save_questions([asdict(q) for q in questions])
        log.info("%d questions from %s (kNN-LM's prompts)", len(questions), kb.name)
        del kb
    return out, questions or []


def main(argv=None) -> int:
    """Run (or ``--replot``) the benchmark; the process's cores and torch threads are restored after."""
    import torch

    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        return _main(argv)
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


def _main(argv=None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.replot:
        report = json.loads(args.replot.read_text())
        args.json = args.json or args.replot
        finish(report, args)
        return 0
    from specops.core.models import load_model_dir
    from specops.serving.engine.spec import SpecEngine

    pin_lm(args)
    pair = load_model_dir(Path(args.model_dir))
    tok, engine = pair.tokenizer, SpecEngine(pair)
    Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/ralm.py " + " ".join(sys.argv[1:] if argv is None else argv)
    report = {
        "command": command,
        "args": {
            k: (str(v) if k in ("points", "resume", "question_point") else v)
            for k, v in vars(args).items()
            if k not in ("json", "doc", "plot")
        },
        "target": target_name(Path(args.model_dir)),
        "cpu": cpu_model(),
    }
    settings = {k: report["args"].get(k) for k in RESUME_KEYS}
    ck = Checkpoint(args.resume, settings)
    report["points"], questions = run_points(args, engine, tok, ck)
    report["questions"], report["question_list"] = len(questions), [asdict(q) for q in questions]
    if not args.no_knnlm:
        from benchmarks.ralm_knnlm import knnlm_section

        texts = [q.prompt for q in questions] or ["Question: What does the `ls` command do?\nAnswer:"]
        prompts = [tok.encode(t, add_special_tokens=False) for t in texts[: args.knnlm_prompts]]
        report["knnlm"] = knnlm_section(pair, tok, prompts, args, ck)
    report["wall_s"] = ck.wall_s
    if ck.resumed():
        report["sessions"] = ck.data["sessions"]
        # a run resumed on other machines names each (every point's own `cpu` says which measured it)
        report["cpu"] = ", ".join(dict.fromkeys(s["cpu"] for s in report["sessions"]))
    report["environment"] = environment()
    finish(report, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
