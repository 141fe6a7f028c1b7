"""The engines benchmark's servers and clients: ``specops serve`` as a process, one request to
either engine over real HTTP, a batch at a fixed concurrency, and vLLM's spec-decode counters.

Both engines get the same request: the prompt as token ids, greedy (``temperature`` 0), the
same ``max_tokens``, streamed (``stream`` with ``include_usage``, as chat clients ask: the
first chunk with output gives the time to first token). vLLM returns the output's token ids
(``return_token_ids``, per chunk); our API returns text only, so outputs across engines are
compared as text (both detokenize with special tokens skipped)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import urllib3

from specops.serving.vllm.process import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Reply:
    """One finished request as the client saw it."""

    prompt: int
    """Index of the prompt in the run's list."""
    tokens: int
    latency_s: float
    text: str
    token_ids: list[int] | None = None
    accepted: int = 0
    rejected_steps: int = 0
    drafted: int = 0
    method: str | None = None
    ttft_s: float | None = None
    """Seconds from the send to the first streamed chunk with output."""


# ---------------------------------------------------------------- processes
class SpecopsServer:
    """``specops serve`` in its own process group: no stream, no registry, no router, no session
    cache (the benchmark serves each prompt several times: LLMA must not copy an earlier arm's
    answer), ``max_concurrency`` decode workers that may share target forwards."""

    def __init__(
        self,
        target: Path,
        draft: Path,
        *,
        log_dir: Path,
        data_dir: Path,
        threads: int,
        concurrency: int,
        draft_dtype: str,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir) / f"specops-serve-{self.port}.log"
        self.data_dir = Path(data_dir)
        self.argv = [
            sys.executable,
            "-m",
            "specops.cli.main",
            "--threads",
            str(threads),
            "serve",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--draft-dtype",
            draft_dtype,
            "--port",
            str(self.port),
            "--stream",
            "none",
            "--registry",
            "none",
            "--router",
            "none",
            "--session-cache-tokens",
            "0",
            "--max-concurrency",
            str(concurrency),
            "--batch-max-size",
            str(concurrency),
            "--max-queue",
            str(max(32, 4 * concurrency)),
        ]
        self.proc: subprocess.Popen | None = None
        self.name = "specops"
        self.started_at = 0.0
        self.ready_s: float | None = None

    def start(self) -> SpecopsServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "SPECOPS_DATA_DIR": str(self.data_dir), "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
        for var in ("SPECOPS_STREAM_URL", "SPECOPS_REGISTRY_URI", "SPECOPS_API_KEYS"):
            env.pop(var, None)
        self.started_at = time.monotonic()
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                cwd=REPO_ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        http, t0 = urllib3.PoolManager(), time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"specops serve exited before it was ready:\n{self.log_tail()}")
            with contextlib.suppress(urllib3.exceptions.HTTPError):
                if http.request("GET", self.url + "/readyz", timeout=2.0, retries=False).status == 200:
                    self.ready_s = time.monotonic() - self.started_at
                    return self.ready_s
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"specops serve not ready after {timeout_s:.0f}s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 30.0) -> None:
        from specops.serving.vllm.process import stop_group

        stop_group(self.proc, timeout_s)

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


# ---------------------------------------------------------------- clients
@dataclass
class Arm:
    """One arm: an engine's server and what each request asks it for."""

    name: str
    engine: str  # "vllm" | "specops"
    url: str
    method: str | None = None
    """specops: the request's ``speculation.method``."""
    k: int = 3
    """vLLM: the server's ``num_speculative_tokens`` (0: no speculation)."""
    http: urllib3.PoolManager = field(default_factory=lambda: urllib3.PoolManager(num_pools=2, maxsize=32))

    def body(self, prompt: list[int], max_tokens: int) -> dict:
        common = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.engine == "vllm":
            return {"model": "target", **common, "return_token_ids": True}
        return {"model": "specops", **common, "speculation": {"method": self.method}}

    def request(self, index: int, prompt: list[int], max_tokens: int, timeout_s: float = 600.0) -> Reply:
        """One streamed completion (as chat clients ask for it): the text and token ids put together from
        its chunks, the time to the first chunk with output (TTFT) and to the end."""
        t0 = time.perf_counter()
        r = self.http.request(
            "POST",
            self.url + "/v1/completions",
            body=json.dumps(self.body(prompt, max_tokens)).encode(),
            headers={"Content-Type": "application/json"},
            timeout=timeout_s,
            retries=False,
            preload_content=False,
        )
        try:
            if r.status != 200:
                raise RuntimeError(f"{self.name}: HTTP {r.status}: {r.read()[:500]!r}")
            text, ids, ttft, usage, spec = [], [], None, None, {}
            buf = b""
            for data in r.stream(1 << 14):
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    line = line.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    usage = chunk.get("usage") or usage
                    spec = chunk.get("speculation") or spec
                    for choice in chunk.get("choices") or []:
                        piece, got = choice.get("text") or "", choice.get("token_ids") or []
                        if (piece or got) and ttft is None:
                            ttft = time.perf_counter() - t0
                        text.append(piece)
                        ids.extend(got)
        finally:
            r.release_conn()
        latency = time.perf_counter() - t0
        tokens = int(usage["completion_tokens"]) if usage else len(ids)
        reply = Reply(index, tokens, latency, "".join(text), ttft_s=ttft)
        if self.engine == "vllm":
            reply.token_ids = ids
        else:
            reply.accepted, reply.drafted = int(spec.get("accepted") or 0), int(spec.get("drafted") or 0)
            reply.rejected_steps, reply.method = int(spec.get("rejected_steps") or 0), spec.get("method")
        return reply

    def profile(self) -> dict[str, float] | None:
        """Our server's time counters now (``specops_profile``; None for vLLM)."""
        if self.engine != "specops":
            return None
        r = self.http.request("GET", self.url + "/metrics", timeout=10.0, retries=False)
        return specops_profile(r.data.decode())

    def metrics(self) -> dict | None:
        """vLLM's spec-decode counters now (None for our engine or a vLLM arm without speculation)."""
        if self.engine != "vllm" or not self.k:
            return None
        r = self.http.request("GET", self.url + "/metrics", timeout=10.0, retries=False)
        return spec_counters(r.data.decode())


PROFILE_SERIES = {
    "specops_target_pass_seconds_total": "what",
    "specops_request_stage_seconds_total": "stage",
}


def specops_profile(text: str) -> dict[str, float]:
    """Our server's time counters (``/metrics``): the batcher thread's forward/gather/idle seconds,
    requests' propose/verify seconds, their summed end-to-end seconds, passes, rows and tokens."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            label = PROFILE_SERIES.get(smp.name)
            if label is not None:
                key = f"{'batcher' if 'pass' in smp.name else 'request'}_{smp.labels[label]}_s"
                out[key] = out.get(key, 0.0) + smp.value
            elif smp.name == "specops_e2e_request_latency_seconds_sum":
                out["request_e2e_s"] = out.get("request_e2e_s", 0.0) + smp.value
            elif smp.name == "specops_e2e_request_latency_seconds_count":
                out["requests"] = out.get("requests", 0.0) + smp.value
            elif smp.name == "specops_target_batch_size_sum":
                out["pass_rows"] = smp.value
            elif smp.name == "specops_target_batch_size_count":
                out["passes"] = smp.value
            elif smp.name == "specops_target_pass_tokens_total":
                out["pass_tokens"] = smp.value
    return out


def batcher_shares(delta: dict[str, float], wall_s: float) -> dict:
    """The batcher thread's share of the arm's wall time in target passes, draft passes and gathering
    a batch; idle is the rest (its own counter also holds the wait while other arms ran)."""
    if not wall_s:
        return {}
    busy = {w: delta.get(f"batcher_{w}_s", 0.0) / wall_s for w in ("forward", "draft_forward", "gather")}
    return {**busy, "idle": max(0.0, 1.0 - sum(busy.values()))}


def profile_shares(delta: dict[str, float], wall_s: float) -> dict:
    """Where the time went: the requests' time split into target passes (queueing for a batch
    included), proposing and the rest (Python per step, tokenizer, HTTP); the batcher thread's
    wall time into forward passes, waiting to gather a batch, and idle; the passes' mean rows and tokens."""
    e2e = delta.get("request_e2e_s", 0.0)
    verify, propose = delta.get("request_verify_s", 0.0), delta.get("request_propose_s", 0.0)
    passes = delta.get("passes", 0.0)
    return {
        "request_seconds": e2e,
        "request_shares": {
            "target_pass": verify / e2e if e2e else None,
            "propose": propose / e2e if e2e else None,
            "other": max(0.0, e2e - verify - propose) / e2e if e2e else None,
        },
        "batcher_shares": batcher_shares(delta, wall_s),
        "passes": passes,
        "mean_rows_per_pass": delta.get("pass_rows", 0.0) / passes if passes else None,
        "mean_tokens_per_pass": delta.get("pass_tokens", 0.0) / passes if passes else None,
        "ms_per_pass": 1000.0 * delta.get("batcher_forward_s", 0.0) / passes if passes else None,
    }


def run_batch(arm: Arm, prompts: list[tuple[int, list[int]]], concurrency: int, max_tokens: int):
    """Send ``prompts`` ((index, ids)) to ``arm`` from ``concurrency`` client threads (at most that many
    in flight); returns (wall seconds from the first send to the last answer, replies in prompt order)."""
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        t0 = time.perf_counter()
        replies = list(pool.map(lambda p: arm.request(p[0], p[1], max_tokens), prompts))
        wall = time.perf_counter() - t0
    return wall, replies


# ---------------------------------------------------------------- vLLM's counters
_SAMPLE = re.compile(r"^(vllm:spec_decode_[a-z_]+?)(_total)?(\{[^}]*\})?\s+([-+0-9.eE]+|NaN)$")
_POSITION = re.compile(r'position="(\d+)"')


def spec_counters(text: str) -> dict:
    """vLLM's spec-decode counters from a Prometheus exposition, summed over engines:
    ``drafts``, ``draft_tokens``, ``accepted`` and ``per_pos`` ({position: drafts accepted there})."""
    out: dict = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {}}
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted",
    }
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m is None or line.startswith("#") or m.group(1).endswith("_created"):
            continue
        name, labels, value = m.group(1), m.group(3) or "", float(m.group(4))
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            pos = _POSITION.search(labels)
            if pos:
                out["per_pos"][int(pos.group(1))] = out["per_pos"].get(int(pos.group(1)), 0.0) + value
        elif name in names:
            out[names[name]] += value
    return out


def counter_delta(before: dict, after: dict) -> dict:
    return {
        "drafts": after["drafts"] - before["drafts"],
        "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
        "accepted": after["accepted"] - before["accepted"],
        "per_pos": {p: v - before["per_pos"].get(p, 0.0) for p, v in after["per_pos"].items()},
    }


def add_counters(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {
        "drafts": a["drafts"] + b["drafts"],
        "draft_tokens": a["draft_tokens"] + b["draft_tokens"],
        "accepted": a["accepted"] + b["accepted"],
        "per_pos": {p: a["per_pos"].get(p, 0.0) + b["per_pos"].get(p, 0.0) for p in {*a["per_pos"], *b["per_pos"]}},
    }


def vllm_alpha(c: dict, k: int) -> dict:
    """Per-token α from vLLM's counters. A draft ended in a rejection unless its last position
    was accepted; vLLM counts accepted drafts per position but not drafted tokens per position,
    so this is exact only when every draft had all ``k`` tokens (``draft_tokens == k * drafts``).
    Otherwise α is accepted ÷ drafted (``basis`` says which)."""
    drafts, tokens, acc = c["drafts"], c["draft_tokens"], c["accepted"]
    if not drafts:
        return {"alpha_token": None, "alpha_drafted": None, "basis": "no drafts", **_ints(c)}
    alpha_drafted = acc / tokens if tokens else None
    if abs(tokens - k * drafts) < 0.5 and (k - 1) in c["per_pos"]:
        rejected = drafts - c["per_pos"][k - 1]
        return {
            "alpha_token": acc / (acc + rejected) if acc + rejected else None,
            "alpha_drafted": alpha_drafted,
            "basis": "accepted / (accepted + drafts ending in a rejection)",
            **_ints(c),
        }
    return {
        "alpha_token": alpha_drafted,
        "alpha_drafted": alpha_drafted,
        "basis": "accepted / drafted (drafts of varying length: rejections per draft unknown)",
        **_ints(c),
    }


def _ints(c: dict) -> dict:
    return {"drafts": int(c["drafts"]), "draft_tokens": int(c["draft_tokens"]), "accepted": int(c["accepted"])}
