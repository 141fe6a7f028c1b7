"""The vLLM path benchmark's runs (``benchmarks/vllm_path.py`` is the command, its docstring describes the
arms, the workload and the measures): the front door over the vLLM servers, requests, interleaved arms
and the paired ratio, and the speed, swap, memory and vocabulary parts."""

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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import urllib3
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("bench.vllm_path")

ARMS = ("target", "pld", "llma", "draft", "auto")
SINGLE = ("target", "pld", "llma", "draft")
COPIES = ("llma", "auto")
"""Arms whose requests carry the case's references."""
KINDS = ("chat", "rag", "cag")


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
    """The draft server scoring the draft's own vocabulary against vLLM's full LM head
    (``benchmarks/vllm_path.py``'s docstring): a front door with the draft server alone for each, one
    after the other."""
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


def measure_speed(args, model_dir: Path, tmp: Path, cases: list[dict], max_len: int) -> dict:
    """``auto`` against each single-method server on the mixed workload (``benchmarks/vllm_path.py``'s docstring)."""
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
                if c == 1:  # case by case, every arm on it back to back, the orders balanced (vllm_path.py's docstring)
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
    from specops.serving.vllm.process import vllm_version

    return "vLLM " + vllm_version(python).replace("unknown", "?")
