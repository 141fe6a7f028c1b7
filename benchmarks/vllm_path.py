"""The vLLM path carrying the whole product: ``auto`` choosing a vLLM server per request, against
each single-method server, on a mixed workload, through ``specops serve --engine vllm``.

One front door (``specops serve --engine vllm --vllm-speculation draft,ngram,copy,none``, a
subprocess) runs four vLLM servers: the bootstrap draft (``draft``), vLLM's n-gram lookup
(``pld``), our copy proposer with each request's references (``llma``,
``serving/vllm/plugin``) and target-only (``target``). Every arm sends the same prompts, as
token ids, greedy, streamed, through the same front door; a request names its arm's method:

- ``target``, ``pld``, ``draft``: the prompt alone (these methods cannot use references);
- ``llma``: the prompt and its references;
- ``auto``: the prompt and its references; the front door picks a server per request
  (``serving/vllm/choice.py``).

**The mixed workload**, distinct prompts, interleaved (``chat``, ``rag``, ``cag``, ...):

- ``chat``: held-out chat requests of the chat workload's sql, math and api domains, rendered
  with the chat template (``benchmarks/engines_learn.py``);
- ``rag``: a question, its top-5 BM25 passages of man pages and ``/usr/share/doc`` in the
  LLMA paper's template; references: the passages (``benchmarks/llma.py``'s rag set);
- ``cag`` (repeated sessions): the question alone; references: the target's own answers to
  three rewordings of it, as a returning user's earlier sessions (``benchmarks/llma.py``'s
  cag set). They travel as ``references``, not through the session cache: every arm
  serves every prompt, and a shared cache would let an arm copy an earlier arm's answer.

Each kind is split in two: the first half warms the front door up, untimed, at every
concurrency (``auto`` tries each server and learns its acceptance and cost there); the
second half is measured, in ``--repeats`` rounds. At concurrency 1 a round serves the cases
one by one, every arm on a case back to back, the arms' order taken in turn from a Williams
design (each arm right after each other equally often): a slow spell of the machine, or what
one arm leaves behind, falls on every arm's copy of the same case, and ``auto`` ÷ the best arm
gets a 95 % bootstrap interval over the cases (``paired_c1``). At higher concurrencies the
arms run one after another, their order rotated by one per round and per concurrency.
Reported per arm: tokens/s (generated tokens ÷ wall time of the arm's runs, all rounds; at
concurrency 1 the sum of its latencies) and each round's, per kind at concurrency 1 (Σ tokens ÷ Σ request latency), p50
latency, the per-token α from each response (vLLM's own per-request counts), and whether
every greedy output equals target-only's, by token ids (``return_token_ids``).

**Swaps** (``--parts swap``): ``benchmarks/vllm_swap.py``'s run on this pair (its report
whole, under ``swap``): ``--swaps`` promotions of cluster ``chat`` under two clients, the
first into the standby draft server, the others into that server in place, then cluster
``code``'s first champion right after ``chat``'s first (a new server: the cold start). **Memory** (``--parts
rss``): the front door's own RSS after 4 requests, over vLLM (the models' configs only)
against a front door holding the weights (``specops serve --engine specops``, same pair).
**The draft's vocabulary** (``--parts vocab``): the ``draft`` arm on the measured cases at each
concurrency through a front door with the draft server alone, scoring the draft's own
vocabulary (``draft_vocab.json``: our model class in vLLM, ``serving/vllm/vocab.py``) and
then vLLM's full LM head (``--no-vllm-draft-vocab``), one front door at a time; outputs by
token ids against each other.

Summary: ``auto_vs_best_single`` (per concurrency: ``auto`` ÷ the best single-method arm;
bar ≥ 1) with ``auto_vs_best_single_rounds`` (the same ratio per round: the spread) and
``auto_vs_best_single_c1_ci95`` (concurrency 1's interval), ``llma_refs_vs_vllm_target`` (the rag set at concurrency 1: ``llma`` ÷ ``target``;
bar ≥ 1.5), ``identical_outputs``, ``alpha_token_per_request`` (every drafting response carried
a per-token α), ``swap_window_s`` (the longer of the standby and in-place windows; bar ≤ 10 s)
with ``swap_window_cold_s`` beside it, ``swap_failed``, ``front_door_rss_ratio`` (bar ≤ 1/3).
``cpu_model`` names the CPU. ``--parts`` runs some parts and keeps the others' results in an
existing ``--json``; ``parts_cpu`` names the CPU each part ran on.

    .venv/bin/python benchmarks/vllm_path.py --json benchmarks/out/vllm_path.json
    .venv/bin/python benchmarks/vllm_path.py --parts swap,rss --json benchmarks/out/vllm_path.json
    .venv/bin/python benchmarks/vllm_path.py --quick --no-doc
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import urllib3  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.common import cpu_model, environment, target_name, write_doc_section  # noqa: E402

log = logging.getLogger("bench.vllm_path")

ARMS = ("target", "pld", "llma", "draft", "auto")
SINGLE = ("target", "pld", "llma", "draft")
COPIES = ("llma", "auto")
"""Arms whose requests carry the case's references."""
KINDS = ("chat", "rag", "cag")
DOC_BEGIN, DOC_END = "<!-- vllm-path:begin -->", "<!-- vllm-path:end -->"
BARS = {
    "auto_vs_best_single": 1.0,
    "llma_refs_vs_vllm_target": 1.5,
    "swap_window_s": 10.0,
    "front_door_rss_ratio": 1 / 3,
}
PARTS = ("speed", "swap", "rss", "vocab")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from specops.paths import models_dir

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Arms, workload and measures: see the module docstring (benchmarks/vllm_path.py).",
    )
    p.add_argument("--quick", action="store_true", help="tiny random pair, 2 cases per kind, 16 tokens")
    p.add_argument("--json", type=Path, help="write the results (with a `summary`) here")
    p.add_argument("--doc", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md", help="markdown file to update")
    p.add_argument("--no-doc", action="store_true", help="do not update the doc")
    p.add_argument("--model-dir", type=Path, default=None, help=f"target/ + draft/ (default: {models_dir()})")
    p.add_argument("--cases", type=int, default=None, help="measured cases per kind (default 8, quick 2)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 64, quick 16)")
    p.add_argument("--concurrency", default="1,4", help="comma-separated client concurrencies")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="rounds of every arm at each concurrency in the speed part, the arms' order rotated each round; "
        "tokens/s is over all rounds (default 3, quick 1)",
    )
    p.add_argument("--k", type=int, default=3, help="vllm_k: tokens the draft and n-gram servers draft per step")
    p.add_argument("--copy-k", type=int, default=8, help="vllm_copy_k: tokens the copy server drafts per step at most")
    p.add_argument(
        "--vllm-args", default=None, help="more vLLM arguments (default none; quick: --enforce-eager, no compile)"
    )
    p.add_argument("--cache-dir", default=".specops/bench/llma", help="the RAG KB and the cag answers (llma.py's)")
    p.add_argument("--kb-passages", type=int, default=None, help="passages of the RAG KB (default 20000, quick 2000)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the front door (tokenizer, recounts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--parts",
        default="speed,swap,rss,vocab",
        help="comma-separated: speed (auto against each single server), swap (promotions under load), rss (a front "
        "door holding the target, for the RSS ratio), vocab (the draft server over the draft's own vocabulary against "
        "vLLM's full LM head); with fewer than all and an existing --json, the other parts' results there are kept",
    )
    p.add_argument("--swap-tokens", type=int, default=16, help="tokens per request in the swap and rss parts")
    p.add_argument("--swaps", type=int, default=5, help="promotions of cluster chat in the swap part (then one cold)")
    args = p.parse_args(argv)
    defaults = {"cases": (2, 8), "max_tokens": (16, 64), "kb_passages": (2000, 20000), "repeats": (1, 3)}
    for key, (quick, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if args.vllm_args is None:
        args.vllm_args = "--enforce-eager" if args.quick else ""
    args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c]
    args.parts = [x.strip() for x in str(args.parts).split(",") if x.strip()]
    if not args.parts or set(args.parts) - set(PARTS):
        p.error(f"--parts: choose from {', '.join(PARTS)}")
    return args


# ---------------------------------------------------------------- the workload
def workload(args, model_dir: Path) -> list[dict]:
    """``2 * cases`` cases per kind, interleaved chat, rag, cag, ...: {kind, prompt (ids), references}."""
    from benchmarks import llma
    from specops.core.models import load_pair
    from specops.workloads.chat_workload import chat_workload

    pair = load_pair(model_dir / "target", model_dir / "draft")
    tok = pair.tokenizer
    n = 2 * args.cases
    per = -(-n // 3)
    parts = chat_workload(tok, {"heldout": max(per, 8)}, domains=("sql", "math", "api"), seed=args.seed)
    chat = [parts[d]["heldout"][i].token_ids for i in range(per) for d in ("sql", "math", "api")][:n]
    ns = argparse.Namespace(
        cache_dir=args.cache_dir,
        kb_passages=args.kb_passages,
        source=None,
        seed=args.seed,
        model_dir=str(model_dir),
        max_new_tokens=args.max_tokens,
    )
    rag = llma.rag_cases(ns, tok, n)
    cag = llma.cag_cases(ns, pair, n)

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    kinds = {
        "chat": [{"kind": "chat", "prompt": list(p), "references": []} for p in chat],
        "rag": [{"kind": "rag", "prompt": ids(c.prompt), "references": c.references} for c in rag],
        "cag": [{"kind": "cag", "prompt": ids(c.prompt), "references": c.references} for c in cag],
    }
    for kind, cases in kinds.items():
        if len(cases) < n:
            raise SystemExit(f"{kind}: {len(cases)} cases on this machine, {n} needed (--cases {args.cases})")
    return [kinds[k][i] for i in range(n) for k in KINDS]


# ---------------------------------------------------------------- the front door
class FrontDoor:
    """``specops serve`` (default: ``--engine vllm`` with every method's server), in its own process group.

    ``options`` replace or add ``specops serve`` options (``{"--registry": uri}``; a value of
    None drops the option)."""

    def __init__(
        self, args, model_dir: Path, log_dir: Path, data_dir: Path, max_len: int, *, name: str = "vllm", options=None
    ) -> None:
        from specops.serving.vllm.process import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"specops-serve-{name}.log"
        self.data_dir = data_dir
        opts = {
            "--engine": "vllm",
            "--vllm-speculation": "draft,ngram,copy,none",
            "--vllm-k": str(args.k),
            "--vllm-copy-k": str(args.copy_k),
            "--vllm-max-model-len": str(max_len),
            "--vllm-start-timeout-s": "2400",  # four servers compile side by side on few cores
            "--vllm-standby": "0",  # no draft is promoted in the speed part
            "--target": str(model_dir / "target"),
            "--draft": str(model_dir / "draft"),
            "--port": str(self.port),
            "--stream": "none",
            "--registry": "none",
            "--router": "none",
            "--session-cache-tokens": "0",
            "--max-concurrency": str(max(args.concurrency)),
            "--max-tokens-limit": str(max(args.max_tokens, 64)),
            "--max-prompt-tokens": str(max_len - args.max_tokens - max(args.k, args.copy_k) - 1),
        }
        if args.vllm_args:
            opts["--vllm-args"] = args.vllm_args
        opts.update(options or {})
        self.argv = [sys.executable, "-m", "specops.cli.main", "--threads", str(args.threads), "serve"]
        for key, value in opts.items():
            if value is True:  # a flag without a value (--no-vllm-draft-vocab)
                self.argv.append(key)
            elif value is not None:
                self.argv.append(f"{key}={value}")  # "=": a value may start with "--"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 2700.0) -> float:
        env = {**os.environ, "SPECOPS_DATA_DIR": str(self.data_dir), "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # several servers on few cores: let the OS place them
        for var in ("SPECOPS_STREAM_URL", "SPECOPS_REGISTRY_URI", "SPECOPS_API_KEYS"):
            env.pop(var, None)
        t0 = time.monotonic()
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        http = urllib3.PoolManager()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specops serve exited:\n{self.log_path.read_text(errors='replace')[-3000:]}")
            with contextlib.suppress(urllib3.exceptions.HTTPError):
                if http.request("GET", self.url + "/readyz", timeout=2.0, retries=False).status == 200:
                    return time.monotonic() - t0
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"specops serve not ready after {timeout_s:.0f}s")

    def stop(self) -> None:
        from specops.serving.vllm.process import stop_group

        stop_group(self.proc, 60.0)

    def rss_mb(self) -> float | None:
        """The front door process's own resident memory (not its vLLM children)."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
        except (OSError, AttributeError):
            return None
        return None


def request(http: urllib3.PoolManager, url: str, arm: str, case: dict, max_tokens: int) -> dict:
    body = {
        "model": "specops",
        "prompt": case["prompt"],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
        "speculation": {"method": arm},
    }
    if arm in COPIES and case["references"]:
        body["references"] = case["references"]
    t0 = time.perf_counter()
    r = http.request(
        "POST",
        url + "/v1/completions",
        body=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        timeout=900.0,
        retries=False,
    )
    latency = time.perf_counter() - t0
    if r.status != 200:
        raise RuntimeError(f"{arm}: HTTP {r.status}: {r.data[:400]!r}")
    out = json.loads(r.data)
    sp = out["speculation"]
    return {
        "kind": case["kind"],
        "method": sp["method"],
        "token_ids": out["choices"][0]["token_ids"],
        "tokens": out["usage"]["completion_tokens"],
        "latency_s": latency,
        "alpha_token": sp.get("alpha_token"),
        "accepted": sp.get("accepted"),
        "rejected_steps": sp.get("rejected_steps"),
        "counts_source": sp.get("counts_source"),
        "reason": ((sp.get("auto") or {}).get("last") or {}).get("reason"),  # auto's: why this server
        "estimates_tok_s": ((sp.get("auto") or {}).get("last") or {}).get("estimates_tok_s"),
    }


def run_arm(url: str, arm: str, cases: list[dict], concurrency: int, max_tokens: int, desc: str) -> dict:
    http = urllib3.PoolManager(num_pools=2, maxsize=max(8, concurrency))
    replies: list[dict | None] = [None] * len(cases)
    bar = tqdm(total=len(cases), desc=desc, unit="req", leave=False)
    lock = threading.Lock()

    def one(i: int) -> None:
        replies[i] = request(http, url, arm, cases[i], max_tokens)
        with lock:
            bar.update(1)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(len(cases))))
    wall = time.perf_counter() - t0
    bar.close()
    return {"wall_s": wall, "replies": replies}


def balanced_orders(arms: tuple[str, ...]) -> list[tuple[str, ...]]:
    """A Williams design: orders of ``arms`` in which each arm comes right after each other arm
    equally often (2n orders for an odd n), so what one arm leaves behind (a server that was just
    busy, a warm CPU cache) lands on every other arm alike."""
    n = len(arms)
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [tuple(arms[(x + i) % n] for x in first) for i in range(n)]
    return rows + [tuple(reversed(r)) for r in rows] if n % 2 else rows


def run_interleaved(url: str, cases: list[dict], max_tokens: int, rep: int, desc: str) -> dict[str, dict]:
    """Concurrency 1, case by case: every arm serves the case back to back in one of
    :func:`balanced_orders`' orders (case ``j`` of round ``rep``: order ``rep * len(cases) + j``),
    so a slow spell of the machine falls on every arm's copy of the same cases. Per arm: its
    replies in case order and ``wall_s`` = Σ its requests' latencies (one request at a time)."""
    orders = balanced_orders(ARMS)
    http = urllib3.PoolManager(num_pools=2, maxsize=8)
    replies: dict[str, list[dict]] = {a: [] for a in ARMS}
    with tqdm(total=len(cases) * len(ARMS), desc=desc, unit="req", leave=False) as bar:
        for j, case in enumerate(cases):
            for arm in orders[(rep * len(cases) + j) % len(orders)]:
                replies[arm].append(request(http, url, arm, case, max_tokens))
                bar.update(1)
    return {a: {"wall_s": sum(r["latency_s"] for r in rs), "replies": rs} for a, rs in replies.items()}


def paired_ratio(runs: dict[str, list[dict]], seed: int, resamples: int = 2000) -> dict:
    """Concurrency 1: ``auto`` ÷ the best single arm over the same cases served back to back, with
    a 95 % bootstrap interval over cases (each case's pair of latencies resampled together; the
    tokens are the same, the outputs being identical)."""
    lat = {a: [r["latency_s"] for run in runs[a] for r in run["replies"]] for a in ARMS}
    tok = {a: [r["tokens"] for run in runs[a] for r in run["replies"]] for a in ARMS}
    speed = {a: sum(tok[a]) / max(sum(lat[a]), 1e-9) for a in SINGLE}
    best = max(speed, key=speed.get)
    pairs = list(zip(lat["auto"], lat[best], tok["auto"], tok[best]))

    def ratio(rows) -> float:
        a = sum(r[2] for r in rows) / max(sum(r[0] for r in rows), 1e-9)
        b = sum(r[3] for r in rows) / max(sum(r[1] for r in rows), 1e-9)
        return a / b

    rng = random.Random(seed)
    boot = sorted(ratio([rng.choice(pairs) for _ in pairs]) for _ in range(resamples))
    return {
        "best_single": best,
        "ratio": round(ratio(pairs), 3),
        "ci95": [round(boot[int(0.025 * resamples)], 3), round(boot[int(0.975 * resamples) - 1], 3)],
        "cases": len(pairs),
        "auto_faster_cases": sum(r[0] < r[1] for r in pairs),
    }


# ---------------------------------------------------------------- swaps and the front door's memory
def measure_swap(args, model_dir: Path) -> dict:
    """``benchmarks/vllm_swap.py`` on this pair: promotions under load into the standby and in
    place, then another cluster's first champion at once (its report, whole)."""
    from benchmarks import vllm_swap

    ns = argparse.Namespace(
        models=str(model_dir),
        quick=False,
        swaps=args.swaps,
        clients=2,
        prompts=4,
        max_tokens=args.swap_tokens,
        max_model_len=1024,
        settle_s=5.0,
        start_timeout=2700.0,
        vllm_args=args.vllm_args,
        standby=1,
        cold_swap=True,
        json=None,
    )
    return vllm_swap.run(ns)


def measure_rss(args, model_dir: Path, tmp: Path, max_len: int, prompts: list[list[int]]) -> dict:
    """The front door's own resident memory (not its servers') after a few requests: over vLLM
    (``--engine vllm``, one draft server; the models' configs only) against one that holds the
    weights, as ours did over vLLM before (``--engine specops`` on the same pair)."""
    out = {}
    doors = {
        "over_vllm": {"--vllm-speculation": "draft", "--vllm-args": "--enforce-eager"},  # eager: its RSS is the same
        "with_weights": {"--engine": "specops"},
    }
    for name, options in doors.items():
        door = FrontDoor(args, model_dir, tmp, tmp / f"rss-{name}", max_len, name=f"rss-{name}", options=options)
        ready_s = door.start()
        http = urllib3.PoolManager()
        try:
            for prompt in prompts[:4]:
                body = {"model": "specops", "prompt": prompt, "max_tokens": args.swap_tokens, "temperature": 0.0}
                r = http.request(
                    "POST", door.url + "/v1/completions", body=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json"}, timeout=900.0, retries=False,
                )  # fmt: skip
                if r.status != 200:
                    raise RuntimeError(f"{name}: HTTP {r.status}: {r.data[:300]!r}")
            rss = door.rss_mb()
        finally:
            door.stop()
        out[name] = {"ready_s": round(ready_s, 1), "rss_mb": None if rss is None else round(rss, 1)}
        log.info("front door %s: %.0f MB resident", name, rss or 0)
    lean, full = out["over_vllm"]["rss_mb"], out["with_weights"]["rss_mb"]
    out["ratio"] = round(lean / full, 3) if lean and full else None
    return out


def measure_vocab(args, model_dir: Path, tmp: Path, cases: list[dict], max_len: int) -> dict:
    """The draft server scoring the draft's own vocabulary against vLLM's full LM head (module
    docstring): a front door with the draft server alone for each, one after the other."""
    warm = [c for i, c in enumerate(cases) if (i // len(KINDS)) < args.cases][: len(KINDS)]
    measured = [c for i, c in enumerate(cases) if (i // len(KINDS)) >= args.cases]
    heads = {"own_vocab": {}, "full_head": {"--no-vllm-draft-vocab": True}}
    out: dict = {"vocab_size": _vocab_size(model_dir / "draft"), "by_concurrency": {}}
    ids: dict[str, list] = {}
    for head, options in heads.items():
        door = FrontDoor(
            args, model_dir, tmp, tmp / f"vocab-{head}", max_len, name=f"vocab-{head}",
            options={"--vllm-speculation": "draft", **options},
        )  # fmt: skip
        ready_s = door.start()
        try:
            run_arm(door.url, "draft", warm, 1, args.max_tokens, f"warm-up {head}")
            for c in args.concurrency:
                run = run_arm(door.url, "draft", measured, c, args.max_tokens, f"c={c} draft {head}")
                out["by_concurrency"].setdefault(str(c), {})[head] = arm_row(run)
                ids.setdefault(head, []).append([r["token_ids"] for r in run["replies"]])
                log.info("c=%d draft, %s: %.1f tokens/s", c, head, out["by_concurrency"][str(c)][head]["tok_s"])
        finally:
            door.stop()
        out[f"{head}_ready_s"] = round(ready_s, 1)
    out["identical_outputs"] = ids["own_vocab"] == ids["full_head"]
    out["speedup"] = {
        c: round(rows["own_vocab"]["tok_s"] / rows["full_head"]["tok_s"], 3)
        for c, rows in out["by_concurrency"].items()
    }
    return out


def _vocab_size(draft: Path) -> int | None:
    try:
        return len(json.loads((draft / "draft_vocab.json").read_text())["token_ids"])
    except (OSError, ValueError, KeyError):
        return None


# ---------------------------------------------------------------- the report
def arm_row(run: dict) -> dict:
    replies = run["replies"]
    tokens = sum(r["tokens"] for r in replies)
    acc = sum(r["accepted"] or 0 for r in replies)
    rej = sum(r["rejected_steps"] or 0 for r in replies)
    per_kind = {}
    for kind in KINDS:
        rs = [r for r in replies if r["kind"] == kind]
        if rs:
            per_kind[kind] = {
                "tok_s": round(sum(r["tokens"] for r in rs) / max(sum(r["latency_s"] for r in rs), 1e-9), 2),
                "methods": {m: sum(r["method"] == m for r in rs) for m in sorted({r["method"] for r in rs})},
            }
            reasons = [r.get("reason") for r in rs if r.get("reason")]
            if reasons:  # auto: explore / alone / home / split (serving/vllm/choice.py)
                per_kind[kind]["reasons"] = {x: reasons.count(x) for x in sorted(set(reasons))}
    return {
        "tok_s": round(tokens / max(run["wall_s"], 1e-9), 2),
        "tokens": tokens,
        "wall_s": round(run["wall_s"], 2),
        "p50_latency_s": round(statistics.median(r["latency_s"] for r in replies), 3),
        "alpha_token": round(acc / (acc + rej), 4) if acc + rej else None,
        "per_kind": per_kind,
    }


def summarise(report: dict) -> dict:
    by_c = report.get("by_concurrency") or {}
    auto_vs = {}
    for c, rows in by_c.items():
        best = max(SINGLE, key=lambda a: rows[a]["tok_s"])
        auto_vs[c] = {"ratio": round(rows["auto"]["tok_s"] / rows[best]["tok_s"], 3), "best_single": best}
        rounds = zip(rows["auto"].get("tok_s_rounds") or [], rows[best].get("tok_s_rounds") or [])
        auto_vs[c]["rounds"] = [round(a / b, 3) for a, b in rounds if b]
    c1 = by_c.get("1") or next(iter(by_c.values()), {})
    rag = {a: c1.get(a, {}).get("per_kind", {}).get("rag", {}).get("tok_s") for a in ("llma", "target")}
    llma_vs = round(rag["llma"] / rag["target"], 3) if rag["llma"] and rag["target"] else None
    swap = (report.get("swap") or {}).get("summary") or {}
    window, failed = swap.get("swap_window_s"), swap.get("swap_failed")
    rss = report.get("rss") or {}
    ratio = rss.get("ratio")
    return {
        "auto_vs_best_single": {c: v["ratio"] for c, v in auto_vs.items()},
        "best_single": {c: v["best_single"] for c, v in auto_vs.items()},
        "auto_vs_best_single_rounds": {c: v["rounds"] for c, v in auto_vs.items()},
        "auto_vs_best_single_c1_ci95": (report.get("paired_c1") or {}).get("ci95"),
        "llma_refs_vs_vllm_target": llma_vs,
        "identical_outputs": report.get("identical_outputs"),
        "alpha_token_per_request": report.get("alpha_token_per_request"),
        "swap_window_s": window,
        "swap_window_cold_s": swap.get("swap_window_cold_s"),
        "swap_how": swap.get("how"),
        "swap_failed": failed,
        "front_door_rss_ratio": ratio,
        "draft_vocab_vs_full_head": (report.get("vocab") or {}).get("speedup"),
        "draft_vocab_identical_outputs": (report.get("vocab") or {}).get("identical_outputs"),
        "front_door_rss_mb": (rss.get("over_vllm") or {}).get("rss_mb"),
        "front_door_with_weights_rss_mb": (rss.get("with_weights") or {}).get("rss_mb"),
        "bars": {
            "auto_vs_best_single": bool(auto_vs)
            and all(v["ratio"] >= BARS["auto_vs_best_single"] for v in auto_vs.values()),
            "llma_refs_vs_vllm_target": llma_vs is not None and llma_vs >= BARS["llma_refs_vs_vllm_target"],
            "swap_window_s": window is not None and window <= BARS["swap_window_s"] and failed == 0,
            "front_door_rss_ratio": ratio is not None and ratio <= BARS["front_door_rss_ratio"],
        },
        "cpu_model": report["environment"].get("cpu_model"),
        "parts_cpu": report.get("parts_cpu") or {},
    }


def markdown(report: dict, command: str) -> str:
    s = report["summary"]
    env = report["environment"]
    lines = [
        f"Target {report['target']}, {env.get('cpu_model')}, {env.get('cpu_count')} cores, {report['vllm_version']}.",
    ]
    cpus = report.get("parts_cpu") or {}
    if len(set(cpus.values())) > 1:
        lines[0] += " The parts ran on different machines: " + ", ".join(f"{p} on {c}" for p, c in cpus.items()) + "."
    if report.get("by_concurrency"):
        lines += [
            "",
            f"**Speed**: {report['cases_per_kind']} measured cases per kind (chat, rag, cag), {report['max_tokens']} "
            f"tokens, greedy, k = {report['k']} (copy server: up to {report.get('copy_k', report['k'])}); one front door "
            f"with four vLLM servers; {report.get('repeats', 1)} round(s) of every arm per concurrency, tokens/s over "
            "all rounds; at concurrency 1 every case is served by all arms back to back, in balanced orders "
            "(tokens/s: Σ tokens ÷ Σ latency).",
            "",
            "| concurrency | arm | tokens/s | chat tok/s (c=1 kinds) | rag | cag | p50 latency s | per-token α |",
            "|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for c, rows in report["by_concurrency"].items():
            for arm in ARMS:
                r = rows[arm]
                kinds = [r["per_kind"].get(k, {}).get("tok_s") for k in KINDS]
                alpha = "–" if r["alpha_token"] is None else f"{r['alpha_token']:.3f}"
                lines.append(
                    f"| {c} | {arm} | {r['tok_s']:.1f} | "
                    + " | ".join("–" if x is None else f"{x:.1f}" for x in kinds)
                    + f" | {r['p50_latency_s']:.2f} | {alpha} |"
                )
        auto_methods = {c: rows["auto"]["per_kind"] for c, rows in report["by_concurrency"].items() if "auto" in rows}
        lines += ["", "`auto`'s choices per kind (requests per server, and why):", ""]
        for c, per in auto_methods.items():
            lines.append(
                f"- concurrency {c}: "
                + "; ".join(
                    f"{k} {v['methods']}" + (f" {v['reasons']}" if v.get("reasons") else "") for k, v in per.items()
                )
            )
        lines += [
            "",
            f"`auto` ÷ best single-method arm: {s['auto_vs_best_single']} (bar ≥ 1; best: {s['best_single']}; per "
            f"round: {s.get('auto_vs_best_single_rounds')}; concurrency 1, the arms served case by case: 95 % "
            f"bootstrap interval over cases {s.get('auto_vs_best_single_c1_ci95')}); "
            f"LLMA with references ÷ target-only on the rag set at concurrency 1: {s['llma_refs_vs_vllm_target']} "
            f"(bar ≥ 1.5); greedy outputs identical to target-only's by token ids: {s['identical_outputs']}; every "
            f"drafting response carried a per-token α: {s['alpha_token_per_request']}.",
        ]
    swap = report.get("swap")
    if swap:
        from benchmarks import vllm_swap

        a = swap["args"]
        lines += [
            "",
            f"**Swaps under load** (`benchmarks/vllm_swap.py`'s run): `--vllm-standby 1`, MLflow on SQLite, the local "
            f"stream; {a['clients']} clients without pause, {a['max_tokens']} tokens per request; base server ready in "
            f"{swap['summary']['base_ready_s']} s, its standby in {swap['summary']['standby_ready_s']} s.",
            "",
            vllm_swap.table(swap),
            "",
            f"Swap window (standby or in place): {s['swap_window_s']} s (bar ≤ 10 s with 0 failed: "
            f"{s['bars']['swap_window_s']}).",
        ]
    rss = report.get("rss")
    if rss:
        lines += [
            "",
            f"**Front door memory** (its own RSS, not its vLLM servers', after 4 requests): "
            f"{s['front_door_rss_mb']} MB over vLLM (the models' configs only) against "
            f"{s['front_door_with_weights_rss_mb']} MB holding the weights (`--engine specops`, the same pair): "
            f"ratio {s['front_door_rss_ratio']} (bar ≤ 1/3).",
        ]
    vocab = report.get("vocab")
    if vocab:
        lines += [
            "",
            f"**The draft's vocabulary in vLLM** (the draft server alone, the measured cases, greedy): scoring its own "
            f"{vocab['vocab_size']} tokens (`draft_vocab.json`) against vLLM's full LM head; outputs identical: "
            f"{vocab['identical_outputs']}.",
            "",
            "| concurrency | LM head | tokens/s | p50 latency s | per-token α |",
            "|---:|---|---:|---:|---:|",
        ]
        for c, rows in vocab["by_concurrency"].items():
            for head, row in rows.items():
                lines.append(
                    f"| {c} | {head.replace('_', ' ')} | {row['tok_s']} | {row['p50_latency_s']} | {row['alpha_token']} |"
                )
        lines += [
            "",
            "Own vocabulary ÷ full head, tokens/s: " + ", ".join(f"c={c}: {v}×" for c, v in vocab["speedup"].items()),
        ]
    lines += ["", f"Command: `{command}`"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from specops.serving.vllm.process import vllm_python

    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-path-"))
    if args.quick and args.model_dir is None:
        from specops.trainer.bootstrap import run as bootstrap

        args.model_dir = tmp / "models"
        bootstrap(args.model_dir, tiny=True)
    elif args.model_dir is None:
        from specops.paths import models_dir

        args.model_dir = models_dir()
    model_dir = Path(args.model_dir)
    report: dict = {}
    if args.json and args.json.exists() and set(args.parts) != set(PARTS):
        report = json.loads(args.json.read_text())  # the other parts' results are kept
        report.pop("summary", None)
    kept_cpu = (report.get("environment") or {}).get("cpu_model")
    parts_cpu = report.get("parts_cpu") or {
        part: kept_cpu
        for part, key in (("speed", "by_concurrency"), ("swap", "swap"), ("rss", "rss"), ("vocab", "vocab"))
        if key in report
    }
    parts_cpu.update({part: cpu_model() for part in args.parts})  # a kept part may come from another machine
    cases = workload(args, model_dir)
    longest = max(len(c["prompt"]) for c in cases)
    max_len = min(2048, longest + args.max_tokens + max(args.k, args.copy_k) + 16)
    chat = [c["prompt"] for c in cases if c["kind"] == "chat"]
    if "speed" in args.parts:
        report.update(measure_speed(args, model_dir, tmp, cases, max_len))
    if "swap" in args.parts:
        report["swap"] = measure_swap(args, model_dir)
    if "rss" in args.parts:
        report["rss"] = measure_rss(args, model_dir, tmp, max_len, chat)
    if "vocab" in args.parts:
        report["vocab"] = measure_vocab(args, model_dir, tmp, cases, max_len)
    report.update(
        {
            "benchmark": "vllm_path",
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "target": target_name(model_dir),
            "quick": args.quick,
            "vllm_version": _vllm_version(vllm_python()),
            "vllm_args": args.vllm_args,
            "parts_run": args.parts,
            "parts_cpu": parts_cpu,
            "environment": {**environment(), "cpu_model": cpu_model()},
        }
    )
    report["summary"] = summarise(report)
    command = "python benchmarks/vllm_path.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(report, command.strip())
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if not args.no_doc and not args.quick:
        write_doc_section(args.doc, DOC_BEGIN, DOC_END, f"{DOC_BEGIN}\n{text}\n{DOC_END}")
    return 0


def measure_speed(args, model_dir: Path, tmp: Path, cases: list[dict], max_len: int) -> dict:
    """``auto`` against each single-method server on the mixed workload (module docstring)."""
    warm = [c for i, c in enumerate(cases) if (i // len(KINDS)) < args.cases]
    measured = [c for i, c in enumerate(cases) if (i // len(KINDS)) >= args.cases]
    log.info("%d warm-up and %d measured cases; longest prompt %d tokens", len(warm), len(measured), max_len)
    door = FrontDoor(args, model_dir, tmp, tmp / "data", max_len)
    ready_s = door.start()
    log.info("front door with four vLLM servers ready in %.0fs", ready_s)
    by_c: dict[str, dict] = {}
    identical, alpha_every, paired = True, True, None
    try:
        for c in args.concurrency:  # untimed: every server warmed, auto explores at this load
            for arm in ARMS:
                run_arm(door.url, arm, warm, c, args.max_tokens, f"warm-up c={c} {arm}")
        rss = door.rss_mb()
        for ci, c in enumerate(args.concurrency):
            runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
            for rep in range(args.repeats):  # rounds, each arm once per round
                if c == 1:  # case by case, every arm on it back to back, the orders balanced (module docstring)
                    done = run_interleaved(door.url, measured, args.max_tokens, rep, f"c=1 round {rep + 1}")
                else:  # arm by arm, the order rotated
                    shift = (ci + rep) % len(ARMS)
                    order = ARMS[shift:] + ARMS[:shift]
                    done = {
                        a: run_arm(door.url, a, measured, c, args.max_tokens, f"c={c} round {rep + 1} {a}")
                        for a in order
                    }
                for arm, run in done.items():
                    runs[arm].append(run)
                    alpha_every = alpha_every and all(
                        r["alpha_token"] is not None for r in run["replies"] if r["method"] != "target"
                    )
                    log.info("c=%d round %d %s: %.1f tokens/s", c, rep + 1, arm, arm_row(run)["tok_s"])
            rows = {}
            if c == 1:
                paired = paired_ratio(runs, args.seed)
            for arm in ARMS:
                merged = {
                    "wall_s": sum(r["wall_s"] for r in runs[arm]),
                    "replies": [x for r in runs[arm] for x in r["replies"]],
                }
                rows[arm] = arm_row(merged)
                rows[arm]["tok_s_rounds"] = [arm_row(r)["tok_s"] for r in runs[arm]]
            for rep in range(args.repeats):  # by token ids, against target-only's outputs
                target_ids = [x["token_ids"] for x in runs["target"][rep]["replies"]]
                identical = identical and all(
                    [x["token_ids"] for x in runs[arm][rep]["replies"]] == target_ids for arm in ARMS
                )
            by_c[str(c)] = rows
    finally:
        door.stop()
    return {
        "cases_per_kind": args.cases,
        "max_tokens": args.max_tokens,
        "k": args.k,
        "copy_k": args.copy_k,
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "front_door_ready_s": round(ready_s, 1),
        "speed_front_door_rss_mb": None if rss is None else round(rss, 1),
        "by_concurrency": by_c,
        "paired_c1": paired,
        "identical_outputs": identical,
        "alpha_token_per_request": alpha_every,
    }


def _vllm_version(python: Path) -> str:
    try:
        out = subprocess.run(
            [str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, timeout=120
        )
        return "vLLM " + out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "vLLM ?"


if __name__ == "__main__":
    raise SystemExit(main())
