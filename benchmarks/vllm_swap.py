"""Hot-swap into vLLM under load: promotions reach the vLLM servers with no failed request.

``specops serve --engine vllm`` (real vLLM CPU servers, MLflow on SQLite, the local stream
log; the front door in this process) serves the target with each cluster's champion draft.
Once the standby draft server is ready (``--standby``, serve's ``vllm_standby``), while
``--clients`` clients send greedy requests without pause, the benchmark registers and
promotes a draft ``--swaps`` times for cluster ``chat``, alternating between a copy of the
bootstrap draft with slightly perturbed weights and the bootstrap draft (a different version
every time). The first loads into the standby server, the others into that server in place
(serving/vllm/fleet.py), each once the standby's replacement is ready again (promotions are
minutes apart in a deployment). With ``--cold-swap``, cluster ``code`` (its requests on the
base draft) gets its first champion right after ``chat``'s first, while the replacement is
still starting: a new server, the cold start the others avoid. Per swap:

- ``how`` the server got the draft (``standby``, ``in place``, ``new server``) and the
  load's (or the new server's start's) seconds;
- the **swap window** (``window_s``): promotion to the moment the cluster's slot serves the
  new version, from which every request that starts gets it (the front door routes a request
  when it starts); beside it ``first_request_s``, to the start of the first request the new
  version served, which also waits for the load's next request of that cluster;
- requests started meanwhile, and failed (any non-200).

Every response is checked: greedy outputs must be the same for a prompt whichever version
served it (lossless), and the versions named in the responses must be the promoted ones.
``benchmarks/vllm_path.py --parts swap`` runs this on the real pair into its own JSON.

    .venv/bin/python benchmarks/vllm_swap.py --json /tmp/vllm_swap.json
    .venv/bin/python benchmarks/vllm_swap.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make benchmarks/ importable
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.common import cpu_model, environment  # noqa: E402


def _perturbed(src: Path, dest: Path, scale: float = 1e-3) -> Path:
    """A copy of the draft ``src`` with every weight moved by ``scale`` x its std (a different version)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest, dirs_exist_ok=True)
    weights = load_file(str(dest / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    out = {}
    for k, w in weights.items():
        noise = torch.randn(w.shape, generator=gen, dtype=torch.float32) * float(w.float().std()) * scale
        out[k] = (w.float() + noise).to(w.dtype).contiguous()
    save_file(out, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def run(args) -> dict:
    # vLLM pins every server's worker to the same cores ("auto"); a standby starts beside a busy
    # server, and on 2 cores it then waits for it. nobind lets the OS place them (docs/vllm.md).
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from specops.cli.serve_runtime import Server
    from specops.core.models import load_tokenizer, tokenizer_hash
    from specops.registry import RegistryConfig, RegistryStore
    from specops.serving.http.config import ServeConfig

    work = Path(tempfile.mkdtemp(prefix="vllm-swap-"))
    models = Path(args.models) if args.models else None
    if args.quick:
        from specops.trainer.bootstrap import run as bootstrap

        models = work / "models"
        bootstrap(models, tiny=True)
    drafts = [models / "draft", _perturbed(models / "draft", work / "draft-b")]
    registry_uri = f"sqlite:///{work / 'mlflow.db'}"
    cfg = ServeConfig(
        model_dir=str(models),
        port=0,
        engine="vllm",
        stream=f"local://{work}/streams",
        registry=registry_uri,
        router="none",
        clusters=["chat", "code"],
        poll_s=0.5,
        max_concurrency=max(4, args.clients),
        vllm_max_model_len=args.max_model_len,
        vllm_args=args.vllm_args,
        vllm_standby=args.standby,
        vllm_start_timeout_s=args.start_timeout,
    )
    prompts = [
        "Write a SQL query that lists every customer with more than three orders.",
        "def fibonacci(n):",
        "Explain what a hash table is in one sentence.",
        "The three largest cities in France are",
    ][: args.prompts]
    srv = Server(cfg, root=work).start()
    t_start = time.monotonic()
    srv.wait_ready(args.start_timeout)
    base_ready_s = time.monotonic() - t_start
    vllm = srv.state.vllm
    if args.standby:
        while not vllm.standbys():
            if time.monotonic() - t_start > args.start_timeout:
                raise RuntimeError(f"the standby vLLM server was not ready after {args.start_timeout}s")
            time.sleep(1.0)
    standby_ready_s = time.monotonic() - t_start
    reg = RegistryStore(RegistryConfig(uri=registry_uri))
    records: list[dict] = []
    stop = threading.Event()

    def client(seed: int) -> None:
        i = seed
        while not stop.is_set():
            prompt, cluster = prompts[i % len(prompts)], ("chat", "code")[i % 2]
            t0 = time.monotonic()
            try:
                r = requests.post(
                    srv.url + "/v1/completions",
                    json={"model": "specops", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
                    | {"cluster": cluster},
                    timeout=600,
                )
                ok, body = r.status_code == 200, (r.json() if r.status_code == 200 else {"error": r.text[:300]})
            except requests.RequestException as exc:
                ok, body = False, {"error": str(exc)}
            rec = {"t0": t0, "t1": time.monotonic(), "ok": ok, "prompt": prompt, "cluster": cluster}
            if ok:
                rec |= {"text": body["choices"][0]["text"], "version": body["speculation"]["draft_version"]}
            else:
                rec["error"] = body.get("error")
            records.append(rec)
            i += 1

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(args.clients)]
    for t in threads:
        t.start()
    # chat's first champion into the standby, then (--cold-swap) code's first at once, while the standby's
    # replacement is still starting: a new server; then chat's next ones in place, each once the standby is
    # back (promotions are minutes apart in a deployment, a replacement's start is not)
    plan = [("chat", drafts[1])] + ([("code", drafts[1])] if args.cold_swap else [])
    plan += [("chat", drafts[n % 2]) for n in range(args.swaps - 1)]
    swaps = []
    try:
        follower = srv.state.follower
        time.sleep(args.settle_s)
        for n, (cluster, path) in enumerate(plan):
            dv = reg.artifact("draft").register(cluster, path, tokenizer_sha256=tokenizer_hash(load_tokenizer(path)))
            t0 = time.monotonic()
            reg.artifact("draft").promote(cluster, dv.version, reason=f"benchmark swap {n + 1}")
            while follower.serving_version(cluster) != dv.version:
                if time.monotonic() - t0 > args.start_timeout:
                    raise RuntimeError(f"swap {n + 1} did not land in {args.start_timeout}s")
                time.sleep(0.05)
            window = time.monotonic() - t0
            while not any(r.get("version") == dv.version and r["cluster"] == cluster for r in list(records)):
                if time.monotonic() - t0 > args.start_timeout:
                    raise RuntimeError(f"swap {n + 1}: no request served by v{dv.version}")
                time.sleep(0.05)
            first = min(r["t0"] for r in list(records) if r.get("version") == dv.version and r["cluster"] == cluster)
            h = next((h for h in reversed(vllm.history) if h["name"] == f"{cluster}-v{dv.version}"), {})
            during = [r for r in list(records) if t0 <= r["t0"] <= t0 + window]
            swaps.append(
                {
                    "swap": n + 1,
                    "cluster": cluster,
                    "version": dv.version,
                    "how": h.get("how", "new server"),
                    "load_s": h.get("reload_s", h.get("ready_s")),
                    "window_s": round(window, 2),
                    "first_request_s": round(first - t0, 2),
                    "requests_started_during": len(during),
                    "failed_during": sum(not r["ok"] for r in during),
                }
            )
            print(
                f"swap {n + 1}: {cluster} v{dv.version} ({swaps[-1]['how']}) serving after {window:.2f}s, first "
                f"request on it {swaps[-1]['first_request_s']}s ({len(during)} started meanwhile, "
                f"{swaps[-1]['failed_during']} failed)",
                flush=True,
            )
            if n == 0 and args.cold_swap:
                continue  # the cold swap follows at once (the standby's replacement still starting)
            t_wait = time.monotonic()
            while args.standby and not vllm.standbys() and time.monotonic() - t_wait < args.start_timeout:
                time.sleep(0.5)
            time.sleep(args.settle_s)
    finally:
        stop.set()
        for t in threads:
            t.join(700)
        live = [s.name for s in vllm.servers()]
        srv.stop()
    ok = [r for r in records if r["ok"]]
    by_prompt: dict[str, set[str]] = {}
    for r in ok:
        by_prompt.setdefault(r["prompt"], set()).add(r["text"])
    lossless = all(len(v) == 1 for v in by_prompt.values())
    # the window: promotion -> the slot serves the new version (every request that starts from then on gets
    # it); the first request's start beside it also waits for the load's next arrival
    warm = [s["window_s"] for s in swaps if s["how"] != "new server"]
    cold = [s["window_s"] for s in swaps if s["how"] == "new server"]
    first = [s["first_request_s"] for s in swaps if s["how"] != "new server"]
    summary = {
        "swaps": len(swaps),
        "swap_failed": sum(not r["ok"] for r in records),
        "requests": len(records),
        "swap_window_s": max(warm) if warm else None,
        "swap_window_s_median": round(statistics.median(warm), 2) if warm else None,
        "swap_window_cold_s": max(cold) if cold else None,
        "first_request_s": max(first) if first else None,
        "how": [s["how"] for s in swaps],
        "base_ready_s": round(base_ready_s, 1),
        "standby_ready_s": round(standby_ready_s, 1),
        "identical_outputs_across_versions": lossless,
        "versions_served": sorted({f"{r['cluster']}:{r['version']}" for r in ok}),
        "servers_live_at_end": live,
    }
    shutil.rmtree(work, ignore_errors=True)
    return {
        "benchmark": "vllm_swap",
        "args": {k: v for k, v in vars(args).items() if isinstance(v, str | int | float | bool | type(None))},
        "environment": environment(),
        "cpu": cpu_model(),
        "swaps": swaps,
        "failures": [r for r in records if not r["ok"]][:10],
        "summary": summary,
    }


def table(report: dict) -> str:
    rows = [
        "| swap | cluster | version | how | load or start (s) | promotion → first request on it (s) | "
        "→ slot swapped (s) | requests started meanwhile | failed |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for s in report["swaps"]:
        rows.append(
            f"| {s['swap']} | {s['cluster']} | {s['version']} | {s['how']} | {s['load_s']} | {s['first_request_s']} | "
            f"{s['window_s']} | {s['requests_started_during']} | {s['failed_during']} |"
        )
    sm = report["summary"]
    rows.append("")
    rows.append(
        f"{sm['swaps']} swaps, {sm['requests']} requests, {sm['swap_failed']} failed; swap window (promotion → slot "
        f"swapped; standby or in place) at most {sm['swap_window_s']} s (the first request on it started at most "
        f"{sm['first_request_s']} s after the promotion), cold start {sm['swap_window_cold_s']} s; identical greedy "
        f"outputs across versions: {sm['identical_outputs_across_versions']}"
    )
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default=str(REPO_ROOT / ".specops" / "models"), help="bootstrapped model directory")
    p.add_argument("--quick", action="store_true", help="tiny random models, 2 swaps (minutes)")
    p.add_argument("--swaps", type=int, default=5, help="promotions under load (default 5)")
    p.add_argument("--clients", type=int, default=2, help="clients sending requests without pause (default 2)")
    p.add_argument("--prompts", type=int, default=4, help="distinct prompts the clients cycle through (at most 4)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--settle-s", type=float, default=5.0, help="seconds of load between swaps")
    p.add_argument("--start-timeout", type=float, default=1200.0, help="longest a server start or a swap may take")
    p.add_argument("--vllm-args", default="", help="more arguments for every vLLM server (e.g. --enforce-eager)")
    p.add_argument("--standby", type=int, default=1, help="vllm_standby: draft servers started ahead (default 1)")
    p.add_argument(
        "--cold-swap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="right after the first swap, another cluster's first champion while the standby restarts: a cold start (default on)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the report (with its summary) here")
    args = p.parse_args(argv)
    if args.quick:
        args.swaps, args.max_tokens, args.settle_s = min(args.swaps, 2), 8, 2.0
        args.vllm_args = args.vllm_args or "--enforce-eager"
    report = run(args)
    print(table(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if report["summary"]["swap_failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
