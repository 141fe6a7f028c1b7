"""OSD benchmark: do drafts learn from production-shaped traffic they have never seen?

Reproduces Online Speculative Decoding (Liu et al., §5) on the bootstrapped pair with the
traffic an Instruct target serves: **chat requests** (system + user message through the
chat template, ``specops.workloads.chat_workload``) in three narrow domains the bootstrap corpus does
not contain — text-to-SQL (``sql``), grade-school math (``math``) and questions about
functions of pinned Python packages (``api``). Every request is distinct and served once.

How a request is served. Greedy speculative decoding accepts exactly the drafts the draft
proposes from the committed prefix, which is always the target's own output; so a
request's acceptance is fixed by the target's greedy continuation and the draft's argmax
at each position of it. The benchmark therefore:

1. generates each prompt's greedy continuation with the target once (prompts of equal
   length batched, no padding; cached on disk beside the models), with the target's
   top-64 distribution at every position;
2. serves a request to a draft by one forward of the draft over prompt + continuation and
   replays the engine's step rule (k drafted per step): accepted, drafted, the steps that
   ended in a rejection and the rejected positions come out exactly as the engine's;
3. logs it as serving does (``StreamLogger``), to a local stream one ``OnlineTrainer``
   consumes in the same process, one draft per cluster;
4. checks itself against the real engine: every ``--check-every``-th request is also
   decoded by ``SpecEngine``; output and acceptance must be the replayed ones.

**α is the paper's per-token α** (§3): Σ accepted / (Σ accepted + steps that ended in a
rejection) (``specops.serving.engine.types.token_alpha``); accepted ÷ drafted is reported beside it.

Arms, on the same held-out **probe** per domain (prompts never served; ``--probe`` each):

- ``static``: the bootstrap draft, never updated;
- ``gated``: the product's path: the requests are routed by a MiniLM router fitted on
  other prompts of the domains, each cluster's trainer updates go through the promotion
  gate (``specops.trainer.promote.judge``) and serving swaps in only promoted versions;
- ``ungated``: every update of the same trainer served as soon as it exists;
- ``offline``: the paper's offline baseline and this run's bound: the bootstrap draft
  distilled on the same served traffic at every output position, ``--offline-epochs``;
- ``generic_*``: the same online loop from a draft never distilled from the target
  (``specops.trainer.bootstrap.generic``), the paper's setting (``--no-generic`` skips it).

Also: a domain switch sql -> math -> sql on one draft, each later segment read as α after
50/150/300 requests of the new domain and requests until α is within 0.05 of the domain's
reference, for the gate's defaults (its window of recent held-out requests and its fresh
test-then-train requests) and, beside them, for other windows and amounts of fresh evidence
(``--gate-windows W:F``; ``0:0`` = the whole held-out set, the gate before issue 55; ``16:0`` the
gate before fresh evidence) judged on the same candidates; an audit of every
promotion (the promoted and the replaced version both serve the cluster's next
``--audit-window`` requests; a promotion whose per-token α difference has a 95 % interval
below zero is *worse*), tokens/s of the draft method with each arm's final draft against
target-only on probe prompts (the real engine, arms interleaved), and, with ``--grid``,
the recipe grid that chose the trainer's defaults. With ``--teacher-forward``, instead: the
same traffic logged as an external engine (vLLM) logs it, with no target distribution, against
our engine's records (``benchmarks/osd_teacher.py``).

    .venv/bin/python benchmarks/osd.py --json benchmarks/out/osd.json
    .venv/bin/python benchmarks/osd.py --quick
    .venv/bin/python benchmarks/osd.py --grid --quick --json benchmarks/out/osd_grid.json
    .venv/bin/python benchmarks/osd.py --teacher-forward --requests 250 --probe 60 --json benchmarks/out/osd_teacher.json
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import math
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make serving/, trainer/ importable
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.common import cpu_model, environment, target_name, write_doc_section  # noqa: E402
from specops.core import draft_vocab  # noqa: E402
from specops.core.models import ModelPair, load_model, load_model_dir  # noqa: E402
from specops.paths import models_dir  # noqa: E402
from specops.serving.engine.spec import DEFAULT_K, SpecEngine  # noqa: E402
from specops.serving.engine.types import GenerationResult, RejectedPosition, RequestStats, SamplingParams, token_alpha  # noqa: E402
from specops.serving.fleet.stream_logger import LoggerConfig, RequestMeta, StreamLogger  # noqa: E402
from specops.streams import StreamConfig  # noqa: E402
from specops.trainer.acceptance import evaluate_records  # noqa: E402
from specops.trainer.data import Example, draft_logits  # noqa: E402
from specops.trainer.losses import TargetDist, distill_loss  # noqa: E402
from specops.trainer.online.trainer import OnlineConfig, OnlineTrainer  # noqa: E402
from specops.trainer.promote import PromoteConfig, fresh_window, gate_window, judge  # noqa: E402
from specops.trainer.replay import ReplayConfig  # noqa: E402
from specops.workloads.chat_workload import ALL_DOMAINS, DOMAINS, HELD_OUT, chat_workload  # noqa: E402
from specops.workloads.chat_workload import DOMAINS as DEFAULT_DOMAINS  # noqa: E402  (DOMAINS: this process's, --domains)
from specops.workloads.prompts import Prompt  # noqa: E402

log = logging.getLogger("bench.osd")

DOC_BEGIN = "<!-- BEGIN osd (written by benchmarks/osd.py; edits inside are overwritten) -->"
DOC_END = "<!-- END osd -->"
PARTS = ("main", "offline", "speed", "generic", "shift")
"""What ``--parts`` can split among processes (``--merge`` joins their reports)."""
GRID_BEGIN = "<!-- BEGIN osd-grid (written by benchmarks/osd.py --grid; edits inside are overwritten) -->"
GRID_END = "<!-- END osd-grid -->"
WINDOW = 100
"""Requests in a moving average of served α."""
TOPK = 64
"""Target log-probs kept per position (as serving logs them)."""
GAIN_BAR = 0.10
OFFLINE_FRACTION_BAR = 0.8
RECOVERY_MARGIN = 0.02
RECOVERY_BAR = 300
SHIFT_AT = (50, 150, 300)
"""Requests into a new segment of the shift run at which each arm's α is reported."""
SHIFT_WINDOW = 50
"""Requests pooled for a segment's α at a point (the trailing ones, all of the new domain)."""
AUTO_STATIC_BAR = 1.1
"""Issue 55: ``auto`` with the final champion at least this much faster than with the static draft."""
SHIFT_MARGIN = 0.05
"""Issue 55's bars: gated ≥ ungated − this after 150 requests; adapted within this of the reference."""
SHIFT_WINDOWS = ("16:0", "16:16", "16:64", "32:0", "0:0")
"""Gate arms measured beside the default in the shift run, ``W`` or ``W:F`` (held-out window W, 0 =
the whole held-out set; F fresh requests, 0 = held-out only): ``0:0`` is the gate before issue 55,
``16:0`` the one before fresh evidence."""
COLORS = {
    "static": "tab:blue",
    "gated": "tab:green",
    "ungated": "tab:olive",
    "offline": "tab:red",
    "generic_gated": "tab:purple",
    "generic_ungated": "tab:pink",
    "generic_static": "tab:gray",
}


# ---------------------------------------------------------------- 1. target continuations
@dataclass
class Served:
    """A prompt and the target's greedy continuation, with its top-k distribution per position."""

    prompt: Prompt
    output: list[int]
    topk_ids: torch.Tensor  # [n_out, TOPK] int64
    topk_logprobs: torch.Tensor  # [n_out, TOPK] float32


def _model_key(pair: ModelPair, max_new: int) -> str:
    h = hashlib.sha256()
    h.update(
        json.dumps(
            {
                "target": pair.target.config.to_dict(),
                "tokenizer": pair.tokenizer_sha256,
                "eos": pair.eos_token_ids,
                "max_new": max_new,
                "topk": TOPK,
            },
            sort_keys=True,
            default=str,
        ).encode()
    )
    h.update(next(iter(pair.target.state_dict().values())).flatten()[:64].numpy().tobytes())
    return h.hexdigest()[:16]


def _prompt_key(model_key: str, prompt: Prompt) -> str:
    return hashlib.sha256((model_key + json.dumps(prompt.token_ids)).encode()).hexdigest()[:24]


@torch.no_grad()  # not inference_mode: the offline arm trains on these tensors
def continuations(pair: ModelPair, prompts: list[Prompt], max_new: int, cache_dir: Path, batch: int) -> list[Served]:
    """Each prompt's greedy continuation (to EOS or ``max_new``) and the target's top-k there, in
    the order of ``prompts``. Prompts of equal length run up to ``batch`` at a time through
    ``target.generate`` (no padding, so each row is the computation it is alone); each prompt's
    result is cached on disk by content, so a larger run reuses a smaller one's."""
    mkey = _model_key(pair, max_new)
    paths = [cache_dir / mkey / f"{_prompt_key(mkey, p)}.safetensors" for p in prompts]
    todo = [i for i, path in enumerate(paths) if not path.exists()]
    by_len: dict[int, list[int]] = {}
    for i in todo:
        by_len.setdefault(len(prompts[i].token_ids), []).append(i)
    chunks = [idx[s : s + batch] for _, idx in sorted(by_len.items()) for s in range(0, len(idx), batch)]
    eos = set(pair.eos_token_ids)
    (cache_dir / mkey).mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(todo), desc="target continuations", unit="prompt", leave=False)
    for idx in chunks:
        ids = torch.tensor([prompts[i].token_ids for i in idx])  # [b, P] (equal lengths)
        gen = pair.target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            top_k=None,
            top_p=None,
            temperature=None,
            pad_token_id=pair.eos_token_ids[0] if eos else 0,
        )
        tokens = gen.sequences[:, ids.shape[1] :]  # [b, n]
        logp = torch.log_softmax(torch.stack(gen.logits, 1).float(), -1)  # [b, n, V]
        vals, tids = logp.topk(TOPK, dim=-1)
        for j, (i, row) in enumerate(zip(idx, tokens.tolist())):
            n = len(row)
            for t, tok in enumerate(row):
                if tok in eos:
                    n = t + 1
                    break
            save_file(
                {
                    "tokens": tokens[j, :n].to(torch.int32).contiguous(),
                    "topk_ids": tids[j, :n].to(torch.int32).contiguous(),
                    "topk_logprobs": vals[j, :n].contiguous(),
                },
                str(paths[i].with_suffix(".tmp")),
            )
            os.replace(paths[i].with_suffix(".tmp"), paths[i])  # whole or absent: a killed run leaves no torn file
        bar.update(len(idx))
    bar.close()
    out = []
    for p, path in zip(prompts, paths):
        t = load_file(str(path))
        out.append(Served(p, t["tokens"].long().tolist(), t["topk_ids"].long(), t["topk_logprobs"].float()))
    return out


# ---------------------------------------------------------------- 2. serving a request (replayed exactly)
@dataclass
class Outcome:
    drafted: int
    accepted: int
    steps: int
    rejected: list[tuple[int, int, int]]  # (index into the output, drafted token, emitted token)

    @property
    def alpha(self) -> float:
        """Accepted ÷ drafted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def alpha_token(self) -> float:
        """The paper's per-token α of this request."""
        return token_alpha(self.accepted, len(self.rejected))


@torch.inference_mode()
def draft_argmax(draft: torch.nn.Module, served: Served) -> list[int]:
    """The draft's argmax at every output position, teacher-forced on prompt + output, as
    serving scores it (its draft vocabulary included)."""
    was = draft.training
    draft.eval()
    try:
        ids = torch.tensor([served.prompt.token_ids + served.output[:-1]])
        first = len(served.prompt.token_ids) - 1
        vocab = draft_vocab.of(draft)
        if vocab is not None:
            hidden = draft.base_model(input_ids=ids).last_hidden_state[0, first:]  # [n_out, h]
            logits = vocab.logits(draft.get_output_embeddings(), hidden)
        else:
            logits = draft(input_ids=ids).logits[0, first:]
        return logits.argmax(-1).tolist()
    finally:
        draft.train(was)


def replay(pred: list[int], output: list[int], k: int, max_new: int) -> Outcome:
    """The engine's greedy step rule on a known continuation (``SpecEngine.generate``): each
    step drafts ``min(k, remaining - 1)`` tokens, accepts the longest run of agreements and
    emits one more; nothing after the continuation's end (EOS or ``max_new``) counts."""
    n, j = len(output), 0
    drafted = accepted = steps = 0
    rejected = []
    while j < n:
        k_step = min(k, max_new - j - 1)
        a = 0
        while a < k_step and j + a < n and pred[j + a] == output[j + a]:
            a += 1
        drafted += max(k_step, 0)
        accepted += min(a, n - j)
        if a < k_step and j + a < n:
            rejected.append((j + a, pred[j + a], output[j + a]))
        steps += 1
        j += a + 1
    return Outcome(drafted, accepted, steps, rejected)


def serve(draft: torch.nn.Module, served: Served, k: int, max_new: int) -> Outcome:
    return replay(draft_argmax(draft, served), served.output, k, max_new)


def logged_result(served: Served, outcome: Outcome, vocab_size: int) -> GenerationResult:
    """The finished request as the engine hands it to the stream logger."""
    P = len(served.prompt.token_ids)
    rejections = []
    for idx, drafted, emitted in outcome.rejected:
        lp, ids = served.topk_logprobs[idx], served.topk_ids[idx]
        rest = max(1e-12, 1.0 - float(lp.double().exp().sum()))
        logits = torch.full((vocab_size,), math.log(rest / max(1, vocab_size - TOPK)))  # the residual, spread
        logits[ids] = lp
        rejections.append(
            RejectedPosition(index=P + idx, drafted_token=drafted, emitted_token=emitted, target_logits=logits)
        )
    stats = RequestStats(
        method="draft",
        num_prompt_tokens=P,
        num_generated=len(served.output),
        num_drafted=outcome.drafted,
        num_accepted=outcome.accepted,
        num_verify_steps=outcome.steps,
        num_rejected_steps=len(rejections),
        finish_reason="length",
    )
    return GenerationResult(token_ids=list(served.output), stats=stats, rejections=rejections)


class CachedTeacher:
    """The target's top-k at every output position of a logged request, from the continuation
    cache (what ``specops.trainer.data.TargetTeacher`` computes with a target forward; the benchmark has
    it already). Keyed by request id."""

    def __init__(self) -> None:
        self.by_request: dict[str, Served] = {}

    def __call__(self, rec) -> TargetDist:
        s = self.by_request[rec.request_id]
        rest = (1 - s.topk_logprobs.double().exp().sum(-1)).clamp_min(0).float()
        return TargetDist.topk(s.topk_ids, s.topk_logprobs, rest)


# ---------------------------------------------------------------- 3. measuring a draft on the probe
@dataclass
class ProbeResult:
    alpha_token: float
    alpha_drafted: float
    per_request: list[tuple[int, int, int]]  # (accepted, rejected steps, drafted)

    def to_dict(self) -> dict:
        return {
            "alpha_token": self.alpha_token,
            "alpha_drafted": self.alpha_drafted,
            "se": ratio_se([(a, a + r) for a, r, _ in self.per_request]),
        }


def probe(draft: torch.nn.Module, probe_set: list[Served], args) -> ProbeResult:
    outs = [serve(draft, s, args.k, args.max_new_tokens) for s in probe_set]
    acc, rej, dr = sum(o.accepted for o in outs), sum(len(o.rejected) for o in outs), sum(o.drafted for o in outs)
    return ProbeResult(
        token_alpha(acc, rej), acc / dr if dr else 0.0, [(o.accepted, len(o.rejected), o.drafted) for o in outs]
    )


def ratio_se(pairs: list[tuple[int, int]]) -> float:
    """Standard error of Σ a / Σ n over independent requests (the ratio estimator's)."""
    n = sum(b for _, b in pairs)
    if len(pairs) < 2 or n == 0:
        return float("inf")
    r = sum(a for a, _ in pairs) / n
    return math.sqrt(sum((a - r * b) ** 2 for a, b in pairs) * len(pairs) / (len(pairs) - 1)) / n


def pooled(rows: list[dict]) -> float:
    """Per-token α pooled over served rows."""
    return token_alpha(sum(r["accepted"] for r in rows), sum(r["rejected"] for r in rows))


# ---------------------------------------------------------------- 4. arms
def served_example(served: Served, vocab, name: str) -> Example:
    """A served request as the trainer trains on it: every output position, the target's top-k
    distribution there (the rest of its mass spread by ``TargetDist.topk``), restricted to the
    draft vocabulary when the draft has one, as the trainer does."""
    P = len(served.prompt.token_ids)
    ids = torch.tensor(served.prompt.token_ids + served.output[:-1])
    rest = (1 - served.topk_logprobs.double().exp().sum(-1)).clamp_min(0).float()
    target = TargetDist.topk(served.topk_ids, served.topk_logprobs, rest)
    if vocab is not None:
        target = target.restrict(vocab.token_ids)
    return Example(ids, torch.arange(P, len(ids) + 1), target, name)


def offline_distill(
    draft: torch.nn.Module,
    stream: list[Served],
    args,
    label: str,
    *,
    lr: float | None = None,
    at: tuple[int, ...] = (),
) -> torch.nn.Module | dict[int, torch.nn.Module]:
    """Forward KL to the target's top-k distribution at every output position of ``stream``,
    ``--offline-epochs`` passes at ``--offline-lr`` (the paper's offline distillation on the
    served traffic). With ``at``: one run of ``max(at)`` epochs (at ``lr``), and the draft after
    each epoch in ``at`` ({epochs: draft}), so a sweep over epochs costs the longest run only."""
    model = copy.deepcopy(draft).train()
    vocab = draft_vocab.of(draft)
    model.get_input_embeddings().weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.offline_lr if lr is None else lr, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(0)
    kept: dict[int, torch.nn.Module] = {}

    def snapshot() -> torch.nn.Module:
        served = copy.deepcopy(draft)
        served.load_state_dict(model.state_dict())
        return served.eval()

    for epoch in range(1, (max(at) if at else args.offline_epochs) + 1):
        order = torch.randperm(len(stream), generator=g).tolist()
        for start in tqdm(
            range(0, len(order), args.offline_batch), desc=f"{label} e{epoch}", unit="batch", leave=False
        ):
            opt.zero_grad(set_to_none=True)
            total, count = None, 0
            for j in order[start : start + args.offline_batch]:
                s = stream[j]
                ex = served_example(s, vocab, f"offline-{j}")
                loss = distill_loss(draft_logits(model, ex, vocab), ex.target, "fkl")
                total = loss * len(s.output) if total is None else total + loss * len(s.output)
                count += len(s.output)
            (total / count).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        if epoch in at:
            kept[epoch] = snapshot()
    return kept if at else snapshot()


def parse_sweep(spec: str) -> dict[float, set[int]]:
    """``--offline-sweep``: ``LR:E,E;LR:E`` -> {lr: {epochs}} (``1e-3:1,3;3e-3:2``)."""
    out: dict[float, set[int]] = {}
    for item in filter(None, (x.strip() for x in spec.split(";"))):
        lr, _, eps = item.partition(":")
        out.setdefault(float(lr), set()).update(int(e) for e in eps.split(",") if e.strip())
        if not out[float(lr)] or min(out[float(lr)]) < 1:
            raise ValueError(f"--offline-sweep {item!r}: give LR:EPOCHS[,EPOCHS...], epochs >= 1")
    return out


def offline_bound(draft: torch.nn.Module, stream: list[Served], probe_set: list[Served], args, domain: str):
    """The offline arm: ``--offline-epochs`` at ``--offline-lr``, and every (lr, epochs) of
    ``--offline-sweep``, each epoch count of one lr read off one run. Returns the draft with the
    best per-token α on ``probe_set`` (the bound: chosen on the probe itself, a generous one) and
    every configuration's α: (draft, its probe result, rows)."""
    sweep = parse_sweep(args.offline_sweep)
    sweep.setdefault(args.offline_lr, set()).add(args.offline_epochs)
    rows, best = [], None
    for lr, epochs in sorted(sweep.items()):
        snaps = offline_distill(draft, stream, args, f"{domain}/offline lr {lr:g}", lr=lr, at=tuple(sorted(epochs)))
        for e, model in sorted(snaps.items()):
            r = probe(model, probe_set, args)
            default = lr == args.offline_lr and e == args.offline_epochs
            rows.append({"lr": lr, "epochs": e, "alpha_token": r.alpha_token, "default": default})
            if best is None or r.alpha_token > best[0].alpha_token:
                best = (r, model)
    return best[1], best[0], rows


def online_config(args, **over) -> OnlineConfig:
    """The trainer's defaults, with this run's overrides (``--lr`` ...) and then ``over``."""
    base = OnlineConfig()
    fields = {
        "interval": args.interval,
        "lr": args.lr,
        "steps_per_update": args.steps,
        "average_decay": args.average_decay,
        "loss": args.loss,
        "positions": args.positions,
    }
    cfg = replace(base, poll_timeout_s=0.01, **{k: v for k, v in fields.items() if v is not None})
    if args.replay or args.capacity:
        cfg = replace(
            cfg,
            replay=ReplayConfig(
                policy=args.replay or base.replay.policy, capacity=args.capacity or base.replay.capacity
            ),
        )
    return replace(cfg, **over)


def learning_run(
    pair: ModelPair,
    base_dir: Path,
    base: torch.nn.Module,
    traffic: list[tuple[Served, str]],
    probes: dict[str, list[Served]],
    args,
    tmp: Path,
    *,
    label: str,
    ocfg: OnlineConfig,
    gate: bool = True,
    audit: bool = True,
    probe_every: int | None = None,
    windows: tuple[str, ...] = (),
) -> dict:
    """Serve ``traffic`` ((request, cluster) in order) while one OnlineTrainer learns from it.

    Per cluster, ``gated`` serves the champion (promoted through the gate) and logs the
    request; ``ungated`` is the trainer's newest version, measured on the same request.
    Each cluster's probe is measured every ``probe_every`` of its requests and at the end.

    ``windows``: more gated arms, one per gate window W (``PromoteConfig.window``; 0 = the whole
    held-out set), each with its own champion, judged on the same candidates and measured on the
    same requests (row keys ``w{W}_accepted`` ...). The trainer learns the same whatever serves:
    it trains at every output position of the target's own output (``positions = "all"``), which
    no draft changes; only the primary arm's records are logged."""
    cfg = StreamConfig(url=f"local://{tmp}/{label}/log", fsync=False, num_partitions=1)
    logger = StreamLogger(cfg, LoggerConfig(), vocab_size=pair.vocab_size)
    teacher = CachedTeacher()
    pcfg = PromoteConfig()
    arm_cfgs = {w: arm_config(pcfg, w) for w in windows}
    trainer = OnlineTrainer(
        cfg,
        base_dir,
        tmp / label / "trainer",
        ocfg,
        teacher=teacher if ocfg.positions == "all" else None,
        target=pair.target if ocfg.sampling != "teacher" else None,  # student/mixed sampling queries it
        fresh=max([pcfg.fresh, *(a.fresh for a in arm_cfgs.values())]) if gate else 0,
    )
    clusters = sorted({c for _, c in traffic})
    extra = {w: WindowArm(a, clusters, base, w) for w, a in arm_cfgs.items()}
    gated = {c: copy.deepcopy(base) for c in clusters}
    latest = {c: copy.deepcopy(base) for c in clusters}
    version = {c: 0 for c in clusters}  # the champion's
    latest_v = {c: 0 for c in clusters}
    rows: list[dict] = []
    promotions, gates, checks = [], [], []
    curves: dict[str, list[dict]] = {c: [] for c in clusters}
    probe_cache: dict[tuple[str, str, int], ProbeResult] = {}
    served_n = {c: 0 for c in clusters}
    future: dict[str, list[int]] = {c: [i for i, (_, cc) in enumerate(traffic) if cc == c] for c in clusters}
    ref_cache: dict[str, tuple] = {}
    fresh_cache: dict[str, dict] = {c: {} for c in clusters}  # the champion's fresh scores, until a swap
    champion_scores: dict[str, float | None] = {}  # the gate's served score of each cluster's champion
    cpu = 0.0
    params = SamplingParams(max_new_tokens=args.max_new_tokens)

    def measure(c: str, arm: str, model: torch.nn.Module, v: int) -> ProbeResult:
        key = (c, "v", v)  # gated and ungated share versions: one measurement per version
        if key not in probe_cache:
            probe_cache[key] = probe(model, probes[c], args)
        return probe_cache[key]

    def checkpoint(c: str) -> None:
        if c not in probes:
            return
        g, u = measure(c, "gated", gated[c], version[c]), measure(c, "ungated", latest[c], latest_v[c])
        curves[c].append(
            {
                "requests": served_n[c],
                "gated": g.alpha_token,
                "ungated": u.alpha_token,
                "gated_version": version[c],
                "ungated_version": latest_v[c],
            }
        )

    for c in clusters:
        checkpoint(c)
    try:
        for i, (s, c) in enumerate(tqdm(traffic, desc=label, unit="req", leave=False)):
            out = serve(gated[c], s, args.k, args.max_new_tokens)
            out_u = out if latest_v[c] == version[c] else serve(latest[c], s, args.k, args.max_new_tokens)
            rows.append(
                {
                    "cluster": c,
                    "domain": s.prompt.domain,
                    "accepted": out.accepted,
                    "rejected": len(out.rejected),
                    "drafted": out.drafted,
                    "version": version[c],
                    "u_accepted": out_u.accepted,
                    "u_rejected": len(out_u.rejected),
                    "u_drafted": out_u.drafted,
                    "u_version": latest_v[c],
                    **{k: v for w, arm in extra.items() for k, v in arm.serve_row(c, s, out, args).items()},
                }
            )
            if args.check_every and i % args.check_every == args.check_every - 1:  # the real engine agrees
                engine = SpecEngine(
                    ModelPair(
                        target=pair.target,
                        draft=gated[c],
                        tokenizer=pair.tokenizer,
                        tokenizer_sha256=pair.tokenizer_sha256,
                    )
                )
                res = engine.generate(s.prompt.token_ids, params, method="draft", k=args.k)
                checks.append(
                    {
                        "request": i,
                        "identical": res.token_ids == s.output,
                        "alpha_engine": res.stats.alpha_token,
                        "alpha_replayed": out.alpha_token,
                    }
                )
            rid = f"{label}-{i}"
            teacher.by_request[rid] = s
            logger.log(
                s.prompt.token_ids,
                logged_result(s, out, pair.vocab_size),
                params,
                RequestMeta(request_id=rid, cluster=c, draft_version=str(version[c])),
            )
            logger.flush(30)
            c0 = time.process_time()
            while trainer.step():
                pass
            st = trainer.clusters.get(c)
            if st is not None and st.version != latest_v[c]:  # a new candidate
                latest_v[c] = st.version
                # what the trainer publishes (with averaging: the average, not the trained weights)
                latest[c].load_state_dict(st.published.state_dict())
                if gate:
                    held = list(st.holdout)
                    for arm in extra.values():
                        arm.judge(c, st, held, trainer.vocab, i)
                    holdout = gate_window([h.record for h in held], pcfg)
                    key = (version[c], tuple(h.source for h in held[len(held) - len(holdout) :]))
                    if c not in ref_cache or ref_cache[c][0] != key:  # the champion on this held-out set
                        ref_cache[c] = (key, evaluate_records(gated[c], holdout, vocab=trainer.vocab))
                    result = judge(
                        str(st.version),
                        str(version[c]),
                        st.published,
                        gated[c],
                        holdout,
                        fresh_window(st.fresh, pcfg, version[c]),
                        pcfg,
                        trainer.vocab,
                        reference_acc=ref_cache[c][1],
                        fresh_cache=fresh_cache[c],
                    )
                    gates.append(
                        {
                            "request": i,
                            "cluster": c,
                            "candidate": st.version,
                            "promoted": result.promoted,
                            "reason": result.reason,
                            "window_requests": len(holdout),
                            "fresh_requests": int(result.extra.get("fresh_requests", 0)),
                        }
                    )
                    if result.promoted:
                        if audit:
                            nxt = [traffic[j][0] for j in future[c] if j > i][: args.audit_window]
                            promotions.append(
                                audit_promotion(
                                    gated[c],
                                    latest[c],
                                    nxt,
                                    args,
                                    request=i,
                                    cluster=c,
                                    old_version=version[c],
                                    new_version=st.version,
                                )
                            )
                        gated[c].load_state_dict(st.published.state_dict())  # the hot-swap, between requests
                        version[c] = st.version
                        fresh_cache[c] = {}
                        champion_scores[c] = result.candidate_score if result.metric == "served" else None
            cpu += time.process_time() - c0
            served_n[c] += 1
            if probe_every and served_n[c] % probe_every == 0:
                checkpoint(c)
    finally:
        logger.close()
        trainer.close()
    for c in clusters:
        if not curves[c] or curves[c][-1]["requests"] != served_n[c]:
            checkpoint(c)
    final = {
        c: {
            "gated": measure(c, "gated", gated[c], version[c]).to_dict(),
            "ungated": measure(c, "ungated", latest[c], latest_v[c]).to_dict(),
            "gated_version": version[c],
            "ungated_version": latest_v[c],
        }
        for c in clusters
        if c in probes
    }
    return {
        "rows": rows,
        "curves": curves,
        "final": final,
        "promotions": promotions,
        "gates": gates,
        "checks": checks,
        "trainer_cpu_s": cpu,
        "champion_scores": champion_scores,
        "windows": {
            arm_key(w): {
                **arm.summary(),
                "served_alpha_last": {  # per cluster, pooled over its last WINDOW requests, beside the primary's
                    c: {
                        "window": pooled(
                            [
                                {"accepted": r[f"{arm.prefix}accepted"], "rejected": r[f"{arm.prefix}rejected"]}
                                for r in tail
                            ]
                        ),
                        "gated": pooled(tail),
                        "ungated": pooled([{"accepted": r["u_accepted"], "rejected": r["u_rejected"]} for r in tail]),
                    }
                    for c in clusters
                    for tail in [[r for r in rows if r["cluster"] == c][-WINDOW:]]
                },
            }
            for w, arm in extra.items()
        },
        "drafts": {"gated": gated, "ungated": latest},
        "teacher_forwards": getattr(trainer.teacher, "forwards", 0),
    }


def arm_config(pcfg: PromoteConfig, spec: str) -> PromoteConfig:
    """A gate arm's configuration from ``W`` (held-out window W, the default fresh evidence) or
    ``W:F`` (window W, F fresh requests; F = 0 is the held-out-only gate)."""
    window, _, fresh = str(spec).partition(":")
    return replace(pcfg, window=int(window), fresh=int(fresh) if fresh else pcfg.fresh)


class WindowArm:
    """One more gated arm of :func:`learning_run`: its own champion per cluster, gated with its
    own window (and fresh evidence) on the same candidates, serving (measured on) the same requests.
    Row keys start ``w{spec}_`` with ``:`` written ``f`` (``w16f0_accepted``)."""

    def __init__(self, cfg: PromoteConfig, clusters: list[str], base: torch.nn.Module, spec: str) -> None:
        self.cfg = cfg
        self.spec = str(spec)
        self.prefix = f"w{arm_key(spec)}_"
        self.model = {c: copy.deepcopy(base) for c in clusters}
        self.version = {c: 0 for c in clusters}
        self.fresh_cache: dict[str, dict] = {c: {} for c in clusters}
        self.gates: list[dict] = []

    def serve_row(self, c: str, s: Served, primary: Outcome, args) -> dict:
        out = serve(self.model[c], s, args.k, args.max_new_tokens)
        p = self.prefix
        return {f"{p}accepted": out.accepted, f"{p}rejected": len(out.rejected), f"{p}version": self.version[c]}

    def judge(self, c: str, st, held: list, vocab, request: int) -> None:
        result = judge(
            str(st.version),
            str(self.version[c]),
            st.published,
            self.model[c],
            gate_window([h.record for h in held], self.cfg),
            fresh_window(st.fresh, self.cfg, self.version[c]),
            self.cfg,
            vocab,
            fresh_cache=self.fresh_cache[c],
        )
        self.gates.append({"request": request, "cluster": c, "candidate": st.version, "promoted": result.promoted})
        if result.promoted:
            self.model[c].load_state_dict(st.published.state_dict())
            self.version[c] = st.version
            self.fresh_cache[c] = {}

    def summary(self) -> dict:
        return {
            "window": self.cfg.window,
            "fresh": self.cfg.fresh,
            "gates": len(self.gates),
            "promotions": sum(g["promoted"] for g in self.gates),
            "promoted_at": [g["request"] for g in self.gates if g["promoted"]],
        }


def arm_label(key: str) -> str:
    """``16f32`` (or ``16:32``, or a plain window ``16``) in words."""
    window, _, fresh = str(key).replace("f", ":").partition(":")
    held = "all held-out (256)" if window == "0" else f"window {window}"
    if not fresh:
        return f"gated, {held}"
    return f"gated, {held}, " + ("no fresh" if fresh == "0" else f"{fresh} fresh")


def arm_key(spec) -> str:
    """``W:F`` as it appears in row keys and JSON (``WfF``); a plain ``W`` stays ``W``."""
    return str(spec).replace(":", "f")


def audit_promotion(
    old: torch.nn.Module,
    new: torch.nn.Module,
    future: list[Served],
    args,
    *,
    request: int,
    cluster: str,
    old_version: int,
    new_version: int,
) -> dict:
    """The promoted version and the one it replaces, both serving the cluster's next requests
    (paired): the per-token α difference and its 95 % interval (requests are the units)."""
    a = [serve(new, s, args.k, args.max_new_tokens) for s in future]
    b = [serve(old, s, args.k, args.max_new_tokens) for s in future]
    if not future:
        return {
            "request": request,
            "cluster": cluster,
            "from": old_version,
            "to": new_version,
            "requests": 0,
            "delta_alpha": 0.0,
            "ci95": float("inf"),
            "worse_beyond_noise": False,
        }
    na = token_alpha(sum(o.accepted for o in a), sum(len(o.rejected) for o in a))
    nb = token_alpha(sum(o.accepted for o in b), sum(len(o.rejected) for o in b))
    # paired, per request: the difference of the two ratio estimators, linearised
    ta = sum(o.accepted + len(o.rejected) for o in a) or 1
    tb = sum(o.accepted + len(o.rejected) for o in b) or 1
    d = [
        (x.accepted - na * (x.accepted + len(x.rejected))) / ta
        - (y.accepted - nb * (y.accepted + len(y.rejected))) / tb
        for x, y in zip(a, b)
    ]
    half = 1.96 * math.sqrt(sum(v * v for v in d) * len(d) / max(1, len(d) - 1)) if len(d) > 1 else float("inf")
    delta = na - nb
    return {
        "request": request,
        "cluster": cluster,
        "from": old_version,
        "to": new_version,
        "requests": len(d),
        "delta_alpha": delta,
        "ci95": half,
        "worse_beyond_noise": bool(d) and delta + half < 0,
    }


# ---------------------------------------------------------------- 5. speed and c
def speed(
    pair: ModelPair,
    drafts: dict[str, torch.nn.Module],
    prompts: list[Served],
    args,
    *,
    cluster: str = "default",
    champion_alpha: float | None = None,
    offline_alpha: float | None = None,
    warm: list[Served] = (),
) -> dict:
    """Tokens/s of target-only and of the draft method with each named draft (in serving's draft
    dtype), on the same prompts through the real engine, arms interleaved per prompt; outputs
    checked identical.

    With ``static`` and ``gated`` among the drafts, also the default method, ``auto``, as a
    replica runs it: one policy calibrated at load served the ``warm`` prompts with the static
    draft (its history in the cluster), and then each arm continues from that state:
    ``auto_static`` (no swap), ``auto_gated`` (the champion swapped in, its counts re-seeded from
    the gate's served score ``champion_alpha``, as serving's swap listener does) and
    ``auto_stale`` (the champion swapped in with the static draft's record kept: the product
    before issue 55). With ``offline`` among the drafts (the offline bound, run in the same
    process), also ``auto_offline``: that draft swapped in the same way, re-seeded from its probe
    α ``offline_alpha``, which says what `auto` could reach on the cluster with the best draft the
    offline sweep made rather than the one online learning made. Per ``auto`` arm: the share of
    steps on the draft model."""
    from specops.core.auto_policy import AutoPolicy
    from specops.core.models import DEFAULT_DRAFT_DTYPE, resolve_dtype
    from specops.serving.proposers.auto import calibrate
    from specops.serving.proposers.catalogue import ProposerResources

    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    dtype = resolve_dtype(DEFAULT_DRAFT_DTYPE, pair.draft)  # serving's draft precision (learning: in float32)
    drafts = {name: copy.deepcopy(d).to(dtype).eval() for name, d in drafts.items()}
    pairs = {
        name: ModelPair(target=pair.target, draft=d, tokenizer=pair.tokenizer, tokenizer_sha256=pair.tokenizer_sha256)
        for name, d in drafts.items()
    }
    engines = {name: SpecEngine(p) for name, p in pairs.items()}
    auto: dict[str, tuple[str, AutoPolicy]] = {}
    if "static" in drafts and ("gated" in drafts or "offline" in drafts):
        history = AutoPolicy(seed=args.seed)
        calibrate(history, pairs["static"])
        for s in warm:
            engines["static"].generate(
                s.prompt.token_ids,
                params,
                method="auto",
                resources=ProposerResources(pair=pairs["static"], cluster=cluster, policy=history),
            )
        state = history.priors()
        arms = [("auto_static", "static")]
        arms += [("auto_gated", "gated"), ("auto_stale", "gated")] if "gated" in drafts else []
        arms += [("auto_offline", "offline")] if "offline" in drafts else []
        for arm, draft in arms:
            policy = AutoPolicy(seed=args.seed + 1)
            calibrate(policy, pairs[draft])
            policy.load_priors(state)
            if arm == "auto_gated":
                policy.reseed(cluster, ["draft"], champion_alpha)
            elif arm == "auto_offline":
                policy.reseed(cluster, ["draft"], offline_alpha)
            auto[arm] = (draft, policy)
    tokens = {n: 0 for n in ["target", *drafts, *auto]}
    seconds = {n: 0.0 for n in tokens}
    steps = {n: {} for n in auto}
    identical = True
    for s in prompts:  # the engine runs under inference mode itself; the copies above must stay normal tensors
        ref = None
        for name in tokens:
            t0 = time.perf_counter()
            if name in auto:
                draft, policy = auto[name]
                res = engines[draft].generate(
                    s.prompt.token_ids,
                    params,
                    method="auto",
                    resources=ProposerResources(pair=pairs[draft], cluster=cluster, policy=policy),
                )
                for m, v in ((res.stats.policy or {}).get("methods") or {}).items():
                    steps[name][m] = steps[name].get(m, 0) + v["steps"]
            else:
                eng = engines.get(name) or next(iter(engines.values()))
                res = eng.generate(
                    s.prompt.token_ids, params, method="target" if name == "target" else "draft", k=args.k
                )
            seconds[name] += time.perf_counter() - t0
            tokens[name] += len(res.token_ids)
            ref = res.token_ids if ref is None else ref
            identical &= res.token_ids == ref
    tps = {n: tokens[n] / seconds[n] if seconds[n] else 0.0 for n in tokens}
    out = {
        "tokens_per_s": tps,
        "ratio_to_target": {n: tps[n] / tps["target"] for n in tokens if n != "target"},
        "prompts": len(prompts),
        "identical": identical,
    }
    if auto:
        out["auto"] = {
            "warm_prompts": len(warm),
            "champion_alpha": champion_alpha,
            "draft_step_share": {n: steps[n].get("draft", 0) / max(1, sum(steps[n].values())) for n in auto},
            "steps": steps,
        }
        if "auto_gated" in auto:
            out["auto"]["vs_static"] = tps["auto_gated"] / tps["auto_static"] if tps["auto_static"] else None
            out["auto"]["vs_target"] = tps["auto_gated"] / tps["target"] if tps["target"] else None
        if "auto_offline" in auto:
            out["auto"]["offline_alpha"] = offline_alpha
            out["auto"]["offline_vs_static"] = tps["auto_offline"] / tps["auto_static"] if tps["auto_static"] else None
    return out


@torch.inference_mode()
def cost_ratio(target: torch.nn.Module, draft: torch.nn.Module, context: list[int], steps: int = 12) -> float:
    """c: seconds of one cached one-token step of the draft over the target's, after a shared prefill."""

    def step_time(model) -> float:
        ids = torch.tensor([context])
        out = model(input_ids=ids, use_cache=True)
        past, nxt = out.past_key_values, ids[:, -1:]
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
        return (time.perf_counter() - t0) / steps

    step_time(draft)
    return step_time(draft) / step_time(target)


# ---------------------------------------------------------------- 6. metrics
def moving(rows: list[dict], prefix: str = "", window: int = WINDOW) -> list[float]:
    """Pooled per-token α over the trailing ``window`` rows."""
    a, r = f"{prefix}accepted", f"{prefix}rejected"
    out, sa, sr = [], 0, 0
    for i, row in enumerate(rows):
        sa, sr = sa + row[a], sr + row[r]
        if i >= window:
            sa, sr = sa - rows[i - window][a], sr - rows[i - window][r]
        out.append(token_alpha(sa, sr))
    return out


def recovery(
    rows: list[dict],
    start: int,
    end: int,
    reference: float,
    *,
    margin: float = RECOVERY_MARGIN,
    min_seen: int = 20,
    window: int = WINDOW,
    prefix: str = "",
) -> int | None:
    """Requests after the switch at ``start`` until the pooled α of the trailing ``window``
    requests since the switch is back within ``margin`` of ``reference``; None if never before ``end``."""
    a, r = f"{prefix}accepted", f"{prefix}rejected"
    for n in range(start + min_seen, end + 1):
        seg = rows[max(start, n - window) : n]
        if token_alpha(sum(x[a] for x in seg), sum(x[r] for x in seg)) >= reference - margin:
            return n - start
    return None


def segment_alpha(rows: list[dict], start: int, n: int, prefix: str = "", window: int = SHIFT_WINDOW) -> float:
    """Pooled per-token α of the ``window`` requests ending ``n`` requests after ``start`` (all after it)."""
    a, r = f"{prefix}accepted", f"{prefix}rejected"
    seg = rows[max(start, start + n - window) : start + n]
    return token_alpha(sum(x[a] for x in seg), sum(x[r] for x in seg))


def shift_segments(rows: list[dict], domains: list[str], n: int, arms: dict[str, str]) -> list[dict]:
    """Per segment after the first: each arm's α after ``SHIFT_AT`` requests of the new domain,
    the reference it should reach and how many requests each arm took to come within
    ``SHIFT_MARGIN`` of it (None: not in the segment).

    The reference of a domain served before is the gated arm's pooled α over the last ``WINDOW``
    requests it served of it (its own level before the switch); of a domain never served before,
    the ungated arm's over the segment's last ``WINDOW`` requests (the level the trainer reaches
    on it, which no gate slows). ``arms`` maps a name to its row prefix."""
    out = []
    tail = min(WINDOW, n)
    points = [k for k in SHIFT_AT if k <= n] or [n]
    for j in range(1, len(domains)):
        start, end = j * n, (j + 1) * n
        prev = [i for i in range(j) if domains[i] == domains[j]]
        if prev:
            last = prev[-1]
            ref = pooled(rows[(last + 1) * n - tail : (last + 1) * n])
            ref_from = f"gated, last {tail} requests of segment {last + 1}"
        else:
            seg = rows[end - tail : end]
            ref = token_alpha(sum(r["u_accepted"] for r in seg), sum(r["u_rejected"] for r in seg))
            ref_from = f"ungated, last {tail} requests of this segment"
        seg_out = {"segment": j + 1, "domain": domains[j], "start": start, "reference": ref, "reference_from": ref_from}
        for name, prefix in arms.items():
            at = {str(k): segment_alpha(rows, start, k, prefix) for k in points}
            adapt = None
            for k in range(min(20, n), n + 1):
                if segment_alpha(rows, start, k, prefix) >= ref - SHIFT_MARGIN:
                    adapt = k
                    break
            seg_out[name] = {"alpha_at": at, "adapt_requests": adapt}
        k150 = 150 if n >= 150 else n  # the bar's point (a quick run's segment end)
        seg_out["gated_minus_ungated_150"] = segment_alpha(rows, start, k150) - segment_alpha(rows, start, k150, "u_")
        out.append(seg_out)
    return out


def shift_markdown(sh: dict) -> str:
    """The shift run's table: per segment and arm, α after 50/150/300 requests and requests to adapt."""
    segs = sh.get("segments") or []
    if not segs:
        return ""
    arms = [a for a in segs[0] if isinstance(segs[0][a], dict) and "alpha_at" in segs[0][a]]
    ats = list(segs[0][arms[0]]["alpha_at"])
    default = arm_label(f"{sh.get('window', '?')}:{sh.get('fresh', 0)}").removeprefix("gated, ")
    label = {"gated": f"gated (default: {default})", "ungated": "ungated"}
    lines = [
        f"Domain switch {' → '.join(sh['domains'])}, {sh['boundaries'][0]} requests per segment, one draft; per-token α "
        f"of the {SHIFT_WINDOW} requests served before each point; adapted: requests until that α is within "
        f"{SHIFT_MARGIN} of the reference.",
        "",
        "| segment | arm | " + " | ".join(f"α after {k}" for k in ats) + " | reference | adapted after | promotions |",
        "|---|---|" + "---:|" * (len(ats) + 3),
    ]
    promos = {"gated": sh.get("promotions"), "ungated": "every update"}
    promos.update({f"w{k}": w["promotions"] for k, w in (sh.get("windows") or {}).items()})
    for seg in segs:
        for a in arms:
            name = label.get(a, arm_label(a[1:]))
            ad = seg[a]["adapt_requests"]
            lines.append(
                f"| {seg['segment']}: {seg['domain']} | {name} | "
                + " | ".join(f"{seg[a]['alpha_at'][k]:.3f}" for k in ats)
                + f" | {seg['reference']:.3f} | {'not reached' if ad is None else ad} | {promos.get(a, '')} |"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------- 7. workload
def build_workload(pair: ModelPair, args, model_dir: Path) -> tuple[dict, dict, dict, bool, dict]:
    """Per domain: the served stream and the probe (with continuations), the router texts;
    whether every prompt of the run is distinct (by token ids); and the template-disjoint probe
    (``--probe-disjoint`` prompts of the families served traffic never has,
    ``specops.workloads.chat_workload.HELD_OUT``; empty with ``--families all``)."""
    parts = chat_workload(
        pair.tokenizer,
        {"router": args.router_texts, "served": args.requests, "probe": args.probe},
        domains=DOMAINS,
        seed=args.seed,
        families=args.families,
    )
    held = (
        chat_workload(
            pair.tokenizer, {"probe": args.probe_disjoint}, domains=DOMAINS, seed=args.seed, families="held_out"
        )
        if args.families == "seen" and args.probe_disjoint
        else {d: {"probe": []} for d in DOMAINS}
    )
    cache = model_dir / "cache" / "osd-chat"
    streams, probes, disjoint = {}, {}, {}
    everything = [p for d in DOMAINS for part in [*parts[d].values(), *held[d].values()] for p in part]
    distinct = len({tuple(p.token_ids) for p in everything}) == len(everything)
    for d in DOMAINS:
        mine = parts[d]["served"] + parts[d]["probe"] + held[d]["probe"]
        served = continuations(pair, mine, args.max_new_tokens, cache, args.batch)
        n, m = args.requests, args.requests + len(parts[d]["probe"])
        streams[d], probes[d], disjoint[d] = served[:n], served[n:m], served[m:]
    routers = {d: [pair.tokenizer.decode(p.token_ids) for p in parts[d]["router"]] for d in DOMAINS}
    return streams, probes, routers, distinct, disjoint


def interleave(streams: dict[str, list[Served]], seed: int) -> list[Served]:
    """The domains' streams mixed into one arrival order (seeded), each stream's order kept."""
    import random

    rng = random.Random(f"arrivals:{seed}")
    left = {d: list(v) for d, v in streams.items()}
    out = []
    while any(left.values()):
        d = rng.choices([d for d in left if left[d]], [len(left[d]) for d in left if left[d]])[0]
        out.append(left[d].pop(0))
    return out


def route(routers: dict[str, list[str]], texts: list[str], args) -> list[str]:
    """Cluster of each text by a nearest-centroid router fitted on ``routers`` (serving's router)."""
    from specops.core.embed import make_embedder
    from specops.trainer.router_fit import fit_router

    emb = make_embedder(args.router_embedder)
    router = fit_router(routers, emb, refine=False)
    out = []
    for start in tqdm(range(0, len(texts), 64), desc="routing", unit="batch", leave=False):
        out += [r.cluster for r in router.route_batch(texts[start : start + 64])]
    return out


# ---------------------------------------------------------------- 8. grid
GRID_FACTORS: dict[str, list] = {
    "positions": ["rejected", "all"],
    "lr": [5e-4, 1e-3, 3e-3],
    "steps_per_update": [1, 4],
    "replay": ["clear", "recent"],
    "loss": ["fkl", "rkl", "jsd"],
    "sampling": ["teacher", "student", "mixed"],
}
GRID_CENTER = {
    "positions": "rejected",
    "lr": 5e-4,
    "steps_per_update": 1,
    "replay": "clear",
    "loss": "fkl",
    "sampling": "teacher",
}
"""The grid's center: OSD Algorithm 1 as the paper runs it (the rejected positions, the buffer
cleared after each update, one step per update at 5e-4, forward KL, teacher sampling: the
target's own served output). Each other run moves one factor from it; the last combines the
best level of each. ``sampling`` is the paper's Table 1 comparison: ``student`` samples each
request's continuation from the draft and ``mixed`` from ``mix·p + (1-mix)·q`` (λ =
``OnlineConfig.mix``), both scored by the target (``specops.trainer.sampling``)."""


GRID_BUDGET_S = 0.6
"""Trainer CPU seconds per request a default recipe may cost. The trainer must keep pace with
the traffic on the cores it is given (in the demo, one of two): serving a 48-token chat
request takes 2-3 s of one core on this machine, and a trainer that needs more than about a
fifth of that per request falls behind as traffic grows."""


def grid(pair: ModelPair, base_dir: Path, streams: dict, probes: dict, args, tmp: Path, model_dir: Path) -> dict:
    """The recipe grid: one factor at a time around the center (:data:`GRID_CENTER`), then the
    best level of every factor together (and, when that exceeds :data:`GRID_BUDGET_S`, the same
    with the buffer cleared); the chosen recipe is the best probe α within the budget. Then draft
    depth 2 vs 4 (layers of the target, undistilled) learning online with it, with c. Ungated:
    a recipe is judged on the probe α of the newest version after the traffic. Rows already in
    ``--grid-reuse`` (same recipe, same traffic size) are taken from it, not run again."""
    traffic = [
        (s, s.prompt.domain) for s in interleave({d: v[: args.grid_requests] for d, v in streams.items()}, args.seed)
    ]
    center = online_config(args)
    for factor, level in GRID_CENTER.items():
        center = _with(center, factor, level)
    static = {d: probe(pair.draft, probes[d], args).alpha_token for d in DOMAINS}
    reuse = []
    if args.grid_reuse and args.grid_reuse.exists():
        old = json.loads(args.grid_reuse.read_text())
        if old.get("requests_per_domain") == args.grid_requests:
            reuse = old.get("rows", [])
    rows: list[dict] = []
    out = {
        "requests_per_domain": args.grid_requests,
        "static": static,
        "rows": rows,
        "center": _recipe(center),
        "budget_s_per_request": GRID_BUDGET_S,
    }

    def save() -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({**out, "partial": True}, indent=1))

    def run(name: str, cfg: OnlineConfig, base=None, bdir=None, key: str = "") -> dict:
        recipe = {**_recipe(cfg), **({"base": key} if key else {})}
        hit = next((r for r in reuse if r.get("config") == recipe), None)
        if hit is not None:
            row = {**hit, "name": name, "reused_from": str(args.grid_reuse)}
        else:
            t0 = time.perf_counter()
            res = learning_run(
                pair,
                bdir or base_dir,
                base if base is not None else pair.draft,
                traffic,
                probes,
                args,
                tmp,
                label=f"grid-{len(rows)}",
                ocfg=cfg,
                gate=False,
                audit=False,
            )
            alpha = {d: res["final"][d]["ungated"]["alpha_token"] for d in DOMAINS}
            row = {
                "name": name,
                "config": recipe,
                "alpha_token": alpha,
                "mean": statistics.fmean(alpha.values()),
                "gain_vs_static": statistics.fmean(alpha[d] - static[d] for d in DOMAINS),
                "trainer_cpu_s_per_request": res["trainer_cpu_s"] / len(traffic),
                "seconds": time.perf_counter() - t0,
            }
        rows.append(row)
        save()
        log.warning(
            "grid %-34s α %s mean %.3f (%+.3f vs static) %.2f s/request",
            name,
            " ".join(f"{d}={a:.3f}" for d, a in row["alpha_token"].items()),
            row["mean"],
            row["gain_vs_static"],
            row["trainer_cpu_s_per_request"],
        )
        return row

    center_row = run("center (OSD Algorithm 1)", center)
    best: dict[str, object] = {}
    for factor, levels in GRID_FACTORS.items():
        scores = {_level(center, factor): center_row["mean"]}
        for level in levels:
            if level == _level(center, factor):
                continue
            scores[level] = run(f"{factor}={level}", _with(center, factor, level))["mean"]
        best[factor] = max(scores, key=lambda lv: (scores[lv], lv == _level(center, factor)))
    combined = center
    for factor, level in best.items():
        combined = _with(combined, factor, level)
    candidates = [(center_row, center)]
    if _recipe(combined) != _recipe(center):
        candidates.append((run("best of each factor", combined), combined))
        if (
            candidates[-1][0]["trainer_cpu_s_per_request"] > GRID_BUDGET_S
            and combined.replay.policy != center.replay.policy
        ):
            cleared = _with(combined, "replay", center.replay.policy)
            candidates.append((run(f"best of each factor, replay={center.replay.policy}", cleared), cleared))
    for r in rows:  # every measured one-factor run is a candidate too
        if r not in [c[0] for c in candidates] and "config" in r and "base" not in r["config"]:
            candidates.append((r, _from_recipe(center, r["config"])))
    within = [c for c in candidates if c[0]["trainer_cpu_s_per_request"] <= GRID_BUDGET_S] or candidates
    chosen_row, chosen = max(within, key=lambda c: c[0]["mean"])
    depth = {}
    n_target = int(pair.target.config.num_hidden_layers)
    for layers in sorted({tuple(range(min(d, n_target))) for d in (2, 4)}):
        ddir = undistilled_draft(pair, base_dir, layers, tmp)
        d_model = load_model(ddir)
        depth[len(layers)] = run(
            f"depth {len(layers)} (undistilled)", chosen, base=d_model, bdir=ddir, key=f"undistilled-{len(layers)}"
        )
        depth[len(layers)]["c"] = cost_ratio(pair.target, d_model, probes[DOMAINS[0]][0].prompt.token_ids)
    center_recipe = _recipe(center)
    for r in rows:  # the paper's Table 1 comparison: the center recipe under each sampling
        r["sampling_row"] = is_sampling_row(r.get("config", {}), center_recipe)
    out.update(
        {
            "best_levels": best,
            "chosen": _recipe(chosen),
            "chosen_name": chosen_row["name"],
            "chosen_mean": chosen_row["mean"],
            "depth": {str(k): v for k, v in depth.items()},
            "positions_cost": positions_cost(pair, streams, args),
        }
    )
    return out


def is_sampling_row(recipe: dict, center: dict) -> bool:
    """``recipe`` is the grid's center (``center``, a ``_recipe`` dict) but for its sampling."""
    return (
        bool(center)
        and "base" not in recipe
        and all(recipe.get(k) == v for k, v in center.items() if k not in ("sampling", "mix"))
    )


def _from_recipe(center: OnlineConfig, recipe: dict) -> OnlineConfig:
    cfg = center
    for factor in GRID_FACTORS:
        cfg = _with(cfg, factor, recipe[factor])
    return cfg


def _level_of(recipe: dict, factor: str):
    """A factor's level in a ``_recipe`` dict."""
    return recipe[factor]


def _level(cfg: OnlineConfig, factor: str):
    return cfg.replay.policy if factor == "replay" else getattr(cfg, factor)


def _with(cfg: OnlineConfig, factor: str, level) -> OnlineConfig:
    if factor == "replay":
        return replace(cfg, replay=ReplayConfig(policy=level, capacity=cfg.replay.capacity))
    return replace(cfg, **{factor: level})


def _recipe(cfg: OnlineConfig) -> dict:
    return {
        "positions": cfg.positions,
        "lr": cfg.lr,
        "steps_per_update": cfg.steps_per_update,
        "replay": cfg.replay.policy,
        "capacity": cfg.replay.capacity,
        "loss": cfg.loss,
        "interval": cfg.interval,
        "sampling": cfg.sampling,
        **({"mix": cfg.mix} if cfg.sampling == "mixed" else {}),
        **({"average_decay": cfg.average_decay} if cfg.average_decay else {}),
    }


def undistilled_draft(pair: ModelPair, base_dir: Path, layers: tuple[int, ...], tmp: Path) -> Path:
    """A draft of ``layers`` of the target (the bootstrap's construction, before its distillation),
    with the bootstrap draft's vocabulary and tokenizer files."""
    from specops.trainer.bootstrap.distill import init_draft

    out = tmp / f"draft-{len(layers)}-layers"
    if not out.exists():
        init_draft(pair.target, layers).save_pretrained(out, safe_serialization=True)
        for f in base_dir.iterdir():
            if (
                f.is_file()
                and not f.name.endswith(".safetensors")
                and f.name not in ("config.json", "generation_config.json")
            ):
                shutil.copy(f, out / f.name)
    return out


def positions_cost(pair: ModelPair, streams: dict, args) -> dict:
    """What training at every position costs: bytes per MissRecord when serving logs every
    position (against the rejected ones only), and seconds of the trainer's teacher forward."""
    from specops.serving.fleet.stream_logger import build_records
    from specops.streams import codec
    from specops.trainer.data import TargetTeacher

    sample = [s for d in DOMAINS for s in streams[d][:8]]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    rejected_b, all_b = [], []
    teacher = TargetTeacher(pair.target)
    for i, s in enumerate(sample):
        out = serve(pair.draft, s, args.k, args.max_new_tokens)
        meta = RequestMeta(request_id=f"cost-{i}", cluster="c", draft_version="0")
        miss, _ = build_records(
            s.prompt.token_ids, logged_result(s, out, pair.vocab_size), params, meta, vocab_size=pair.vocab_size
        )
        rejected_b.append(len(codec.encode(miss)))
        every = Outcome(
            out.accepted + len(s.output),
            out.accepted,
            out.steps,
            [(j, (t + 1) % pair.vocab_size, t) for j, t in enumerate(s.output)],
        )
        miss_all, _ = build_records(
            s.prompt.token_ids, logged_result(s, every, pair.vocab_size), params, meta, vocab_size=pair.vocab_size
        )
        all_b.append(len(codec.encode(miss_all)))
        teacher(miss)
    return {
        "records": len(sample),
        "bytes_rejected": statistics.fmean(rejected_b),
        "bytes_all": statistics.fmean(all_b),
        "teacher_forward_s": teacher.seconds / max(1, teacher.forwards),
    }


# ---------------------------------------------------------------- 9. report
def summarise(report: dict) -> dict:
    """The headline numbers (also for ``--replot``)."""
    main = report["main"]
    clusters = [d for d in DOMAINS if d in main["final"]]
    arm = lambda name: {d: main["final"][d][name]["alpha_token"] for d in clusters}  # noqa: E731
    static = {d: report["static"][d]["alpha_token"] for d in clusters}
    offline = {d: report["offline"][d]["alpha_token"] for d in clusters}
    gated, ungated = arm("gated"), arm("ungated")
    gain = {d: gated[d] - static[d] for d in clusters}
    frac = {d: (gated[d] - static[d]) / (offline[d] - static[d]) if offline[d] > static[d] else None for d in clusters}
    promos = main["promotions"]
    per_cluster = {d: sum(p["cluster"] == d for p in promos) for d in clusters}
    shift = report.get("shift") or {}
    out = {
        "chat": True,
        "distinct_prompts": bool(report.get("distinct_prompts")),
        "clusters": clusters,
        "requests_per_cluster": report["config"]["requests"],
        "alpha_token_static": static,
        "alpha_token_gated": gated,
        "alpha_token_ungated": ungated,
        "alpha_token_offline": offline,
        "alpha_drafted_static": {d: report["static"][d]["alpha_drafted"] for d in clusters},
        "alpha_drafted_gated": {d: main["final"][d]["gated"]["alpha_drafted"] for d in clusters},
        "gain_gated": gain,
        "gain_gated_min": min(gain.values()),
        "gain_ungated_min": min(ungated[d] - static[d] for d in clusters),
        **disjoint_summary(report, clusters),
        "offline_fraction": frac,
        "offline_fraction_min": min((f for f in frac.values() if f is not None), default=None),
        **offline_summary(report, clusters, static),
        **grid_summary(report),
        **other_summary(report),
        "promotions": len(promos),
        "promotions_per_cluster": per_cluster,
        "worse_promotions": sum(p["worse_beyond_noise"] for p in promos),
        "gate_candidates": len(main["gates"]),
        "recovery_requests": shift.get("recovery", {}).get("requests"),
        "routing_accuracy": report.get("routing", {}).get("accuracy"),
        "routing_accuracy_user_only": report.get("routing", {}).get("accuracy_user_only"),
        "engine_checks": {
            "n": len(report.get("engine_checks", [])),
            "identical": sum(c["identical"] for c in report.get("engine_checks", [])),
            "alpha_equal": sum(
                abs(c["alpha_engine"] - c["alpha_replayed"]) < 1e-9 for c in report.get("engine_checks", [])
            ),
        },
        "trainer_cpu_s_per_request": main["trainer_cpu_s"] / max(1, len(main["rows"])),
    }
    segs = shift.get("segments") or []
    if segs:
        out["shift_gated_minus_ungated_min"] = min(g["gated_minus_ungated_150"] for g in segs)
        out["shift_adapt_requests"] = {f"{g['segment']}:{g['domain']}": g["gated"]["adapt_requests"] for g in segs}
        out["shift_ungated_adapt_requests"] = {
            f"{g['segment']}:{g['domain']}": g["ungated"]["adapt_requests"] for g in segs
        }
        out["shift_worse_promotions"] = shift.get("worse_promotions")
        out["gate_window"] = shift.get("window")
        out["gate_fresh"] = shift.get("fresh", 0)
    if report.get("generic"):
        g = report["generic"]
        out["alpha_token_generic"] = {k: {d: g[k][d] for d in clusters} for k in ("static", "gated", "ungated")}
    if report.get("speed"):
        out["tokens_per_s_ratio"] = {d: report["speed"][d]["ratio_to_target"] for d in clusters if d in report["speed"]}
        autos = {
            d: report["speed"][d]["auto"] for d in clusters if "vs_static" in report["speed"].get(d, {}).get("auto", {})
        }
        if autos:
            out["auto_default_vs_static"] = {d: a["vs_static"] for d, a in autos.items()}
            out["auto_default_vs_target"] = {d: a["vs_target"] for d, a in autos.items()}
            out["auto_default_vs_static_min"] = min(out["auto_default_vs_static"].values())
            out["auto_default_vs_target_min"] = min(out["auto_default_vs_target"].values())
            out["auto_draft_step_share"] = {d: a["draft_step_share"] for d, a in autos.items()}
            out["auto_champion_alpha"] = {d: a["champion_alpha"] for d, a in autos.items()}
            bound = {d: a["offline_vs_static"] for d, a in autos.items() if a.get("offline_vs_static") is not None}
            if bound:  # the offline bound's draft under `auto` (same process): what any draft of this size reached
                out["auto_offline_vs_static"] = bound
    out["bars"] = {
        "gain_gated_min >= 0.10": out["gain_gated_min"] >= GAIN_BAR,
        "offline_fraction_min >= 0.8": (out["offline_fraction_min"] or 0) >= OFFLINE_FRACTION_BAR,
        ">= 1 promotion per cluster": all(v >= 1 for v in per_cluster.values()),
        "0 worse promotions": out["worse_promotions"] == 0,
        "recovery <= 300 requests": out["recovery_requests"] is not None and out["recovery_requests"] <= RECOVERY_BAR,
    }
    if "gain_template_disjoint_min" in out:
        out["bars"]["template-disjoint gain >= 0.10"] = out["gain_template_disjoint_min"] >= GAIN_BAR
    if "auto_default_vs_static_min" in out:
        out["bars"]["auto: champion >= 1.1x static"] = out["auto_default_vs_static_min"] >= AUTO_STATIC_BAR
        out["bars"]["auto: champion >= 1.0x target-only"] = out["auto_default_vs_target_min"] >= 1.0
    if segs:
        out["bars"]["shift: gated >= ungated - 0.05 after 150"] = out["shift_gated_minus_ungated_min"] >= -SHIFT_MARGIN
        out["bars"]["shift: adapted in <= 300 requests"] = all(
            v is not None and v <= 300 for v in out["shift_adapt_requests"].values()
        )
        out["bars"]["shift: 0 worse promotions"] = not shift.get("worse_promotions")
    for o in out.get("real_text", []):  # the real-text domains' own run, held to the same bars
        name = "+".join(o.get("clusters", []))
        out["bars"][f"real text {name}: gain >= 0.10"] = o.get("gain_gated_min", 0) >= GAIN_BAR
        if "gain_template_disjoint_min" in o:
            out["bars"][f"real text {name}: template-disjoint gain >= 0.10"] = (
                o["gain_template_disjoint_min"] >= GAIN_BAR
            )
        if "offline_fraction_min" in o:
            out["bars"][f"real text {name}: offline_fraction_min >= 0.8"] = (
                o["offline_fraction_min"] or 0
            ) >= OFFLINE_FRACTION_BAR
        out["bars"][f"real text {name}: 0 worse promotions"] = o.get("worse_promotions") == 0
    return out


def offline_summary(report: dict, clusters: list[str], static: dict) -> dict:
    """The swept offline bound (every configuration, the best) and the 10 % baseline, per cluster."""
    out: dict = {}
    sweep = report.get("offline_sweep") or {}
    if any(sweep.get(d) for d in clusters):
        out["offline_swept"] = {
            d: {
                "configs": len(sweep[d]),
                "best": max(sweep[d], key=lambda r: r["alpha_token"]),
                "default": next((r for r in sweep[d] if r.get("default")), None),
            }
            for d in clusters
            if sweep.get(d)
        }
    base = report.get("baseline_10pct") or {}
    if any(d in base for d in clusters):
        out["baseline_10pct"] = {d: base[d]["alpha_token"] for d in clusters if d in base}
        out["baseline_10pct_gain"] = {d: base[d]["alpha_token"] - static[d] for d in clusters if d in base}
    return out


OTHER_KEYS = (
    "clusters",
    "requests_per_cluster",
    "alpha_token_static",
    "alpha_token_gated",
    "alpha_token_ungated",
    "alpha_token_offline",
    "gain_gated",
    "gain_gated_min",
    "alpha_token_disjoint",
    "gain_template_disjoint",
    "gain_template_disjoint_min",
    "offline_fraction",
    "offline_fraction_min",
    "offline_swept",
    "baseline_10pct",
    "promotions",
    "worse_promotions",
    "auto_default_vs_static",
    "auto_default_vs_target",
    "auto_default_vs_static_min",
    "auto_default_vs_target_min",
    "auto_draft_step_share",
    "auto_offline_vs_static",
    "tokens_per_s_ratio",
    "engine_checks",
)


def other_summary(report: dict) -> dict:
    """``real_text``: the headline numbers of runs of other domains merged beside this one
    (``--domains docs``: prompts from real documentation, not templates), per file; {} without."""
    other = report.get("other_domains") or []
    if not other:
        return {}
    return {
        "real_text": [
            {
                "file": o["file"],
                "command": o.get("command"),
                **{k: o["summary"][k] for k in OTHER_KEYS if k in o["summary"]},
            }
            for o in other
        ]
    }


def grid_summary(report: dict) -> dict:
    """``sampling_grid``: the recipe grid's teacher, student and mixed sampling rows (OSD Table 1:
    the same traffic, the grid's center recipe otherwise), from a ``--grid`` JSON given to
    ``--merge``; {} without one."""
    g = report.get("grid") or {}
    center = g.get("center") or {}
    rows = {
        r["config"]["sampling"]: r
        for r in g.get("rows", [])
        if r.get("sampling_row", is_sampling_row(r.get("config", {}), center))  # a partial grid has no marks yet
        and "sampling" in r.get("config", {})
    }
    if not rows:
        return {}
    return {
        "sampling_grid": {
            level: {
                "alpha_token": r["alpha_token"],
                "mean": r["mean"],
                "gain_vs_static": r["gain_vs_static"],
                "trainer_cpu_s_per_request": r["trainer_cpu_s_per_request"],
                **({"mix": r["config"]["mix"]} if "mix" in r["config"] else {}),
            }
            for level, r in rows.items()
        }
        | {"requests_per_domain": g.get("requests_per_domain"), "source": g.get("file"), "command": g.get("command")},
    }


def disjoint_summary(report: dict, clusters: list[str]) -> dict:
    """Per-token α on the template-disjoint probe per cluster and arm, each arm's gain over the
    static draft there, and the smallest gated gain (issue 55's bar); {} without that probe."""
    dj = report.get("disjoint") or {}
    cs = [d for d in clusters if "gated" in dj.get(d, {})]
    if not cs:
        return {}
    arms = [a for a in ("static", "gated", "ungated", "offline") if all(a in dj[d] for d in cs)]
    alpha = {a: {d: dj[d][a]["alpha_token"] for d in cs} for a in arms}
    gain = {a: {d: alpha[a][d] - alpha["static"][d] for d in cs} for a in arms if a != "static"}
    return {
        "alpha_token_disjoint": alpha,
        "gain_template_disjoint": gain,
        "gain_template_disjoint_min": min(gain["gated"].values()),
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main, clusters = report["main"], [d for d in DOMAINS if d in report["main"]["final"]]
    panels = len(clusters) + (1 if report.get("shift") else 0)
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 3.9), sharey=True)
    axes = list(axes) if panels > 1 else [axes]
    for ax, d in zip(axes, clusters):
        curve = main["curves"][d]
        x = [p["requests"] for p in curve]
        ax.plot(x, [p["gated"] for p in curve], "-o", ms=3, label="gated (served)", color=COLORS["gated"])
        ax.plot(x, [p["ungated"] for p in curve], "-s", ms=3, label="ungated", color=COLORS["ungated"])
        ax.axhline(report["static"][d]["alpha_token"], color=COLORS["static"], ls="--", label="static")
        ax.axhline(report["offline"][d]["alpha_token"], color=COLORS["offline"], ls=":", label="offline (bound)")
        if report.get("generic") and report["generic"].get("curves", {}).get(d):
            gc = report["generic"]["curves"][d]
            ax.plot(
                [p["requests"] for p in gc],
                [p["ungated"] for p in gc],
                "-",
                color=COLORS["generic_ungated"],
                label="generic start, ungated",
            )
        served_idx = {}
        for i, r in enumerate(main["rows"]):
            if r["cluster"] == d:
                served_idx[i] = len(served_idx) + 1
        for p in main["promotions"]:
            if p["cluster"] == d:
                ax.axvline(served_idx.get(p["request"], 0), color=COLORS["gated"], alpha=0.25, lw=0.8)
        ax.set_title(f"{d}: α on the held-out probe")
        ax.set_xlabel(
            f"requests of the cluster served (promotions: {sum(p['cluster'] == d for p in main['promotions'])})"
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    if report.get("shift"):
        ax = axes[-1]
        sh = report["shift"]
        ax.plot(range(1, len(sh["gated_curve"]) + 1), sh["gated_curve"], label="gated", color=COLORS["gated"])
        ax.plot(range(1, len(sh["ungated_curve"]) + 1), sh["ungated_curve"], label="ungated", color=COLORS["ungated"])
        for name, curve in (sh.get("window_curves") or {}).items():
            w = name[1:] if name[1:] != "0" else "all"
            ax.plot(range(1, len(curve) + 1), curve, label=f"gated, window {w}", lw=0.8, ls="--")
        for b in sh["boundaries"]:
            ax.axvline(b, color="grey", ls=":", lw=1)
        ax.set_title(" → ".join(sh["domains"]) + f" (one draft; gate window {sh.get('window', 'all')})")
        ax.set_xlabel(f"requests served (α over the last {WINDOW})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[0].set_ylabel("per-token α (OSD §3)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(report: dict) -> str:
    s = report["summary"]
    clusters = s["clusters"]
    gen = s.get("alpha_token_generic")
    ratio = s.get("tokens_per_s_ratio", {})
    head = "| cluster | static | gated | ungated | offline bound | gated gain | of offline gain | promotions |"
    lines = [
        head + (" generic start → gated / ungated |" if gen else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if gen else ""),
    ]
    for d in clusters:
        f = s["offline_fraction"][d]
        line = (
            f"| {d} | {s['alpha_token_static'][d]:.3f} | {s['alpha_token_gated'][d]:.3f} | "
            f"{s['alpha_token_ungated'][d]:.3f} | {s['alpha_token_offline'][d]:.3f} | {s['gain_gated'][d]:+.3f} | "
            f"{'–' if f is None else f'{f:.2f}'} | {s['promotions_per_cluster'][d]} |"
        )
        if gen:
            line += f" {gen['static'][d]:.3f} → {gen['gated'][d]:.3f} / {gen['ungated'][d]:.3f} |"
        lines.append(line)
    if ratio:
        arms = list(dict.fromkeys(a for r in ratio.values() for a in r))  # every arm any cluster ran
        lines += [
            "",
            "Tokens/s ÷ target-only (real engine, same probe prompts, interleaved): the draft method with each "
            "arm's final draft, and (`auto_*`) the default method, `auto`, continuing from a policy that served "
            "with the static draft: with it still (`auto_static`), with the final champion swapped in and its "
            "estimate re-seeded from the gate (`auto_gated`, what serving does), or kept (`auto_stale`, before "
            "issue 55); where the offline part ran in the same process, with the offline bound's draft "
            "(`auto_offline`, re-seeded from its probe α):",
            "",
            "| cluster | " + " | ".join(arms) + " |",
            "|---|" + "---:|" * len(arms),
        ]
        for d in clusters:
            lines.append(f"| {d} | " + " | ".join(f"{ratio[d][a]:.2f}x" if a in ratio[d] else "–" for a in arms) + " |")
    sw, b10 = s.get("offline_swept"), s.get("baseline_10pct")
    if sw or b10:
        lines += [
            "",
            "Offline arms: the bound swept over learning rate and epochs (best on the probe), and the "
            "paper's baseline of offline distillation on 10 % of the domain's served requests:",
            "",
        ]
        lines += [
            "| cluster | configurations | best (lr, epochs): α | default: α | 10 % baseline: α |",
            "|---|---:|---:|---:|---:|",
        ]
        for d in clusters:
            w = (sw or {}).get(d)
            best = f"{w['best']['lr']:g}, {w['best']['epochs']}: {w['best']['alpha_token']:.3f}" if w else "–"
            dflt = f"{w['default']['alpha_token']:.3f}" if w and w.get("default") else "–"
            ten = f"{b10[d]:.3f}" if b10 and d in b10 else "–"
            lines.append(f"| {d} | {w['configs'] if w else '–'} | {best} | {dflt} | {ten} |")
    dj = s.get("alpha_token_disjoint")
    if dj:
        arms = list(dj)
        lines += [
            "",
            "The same arms on the **template-disjoint probe** (prompts of families served traffic never had: "
            + "; ".join(f"{d}: {', '.join(sorted(HELD_OUT[d]))}" for d in clusters if d in HELD_OUT)
            + "), per-token α, and on the in-template probe above for comparison (gain over static):",
            "",
            "| cluster | " + " | ".join(arms) + " | gated gain, disjoint | gated gain, in-template |",
            "|---|" + "---:|" * (len(arms) + 2),
        ]
        for d in clusters:
            if d in dj[arms[0]]:
                lines.append(
                    f"| {d} | "
                    + " | ".join(f"{dj[a][d]:.3f}" for a in arms)
                    + f" | {s['gain_template_disjoint']['gated'][d]:+.3f} | {s['gain_gated'][d]:+.3f} |"
                )
    share = s.get("auto_draft_step_share")
    if share:
        arms = list(dict.fromkeys(a for r in share.values() for a in r))
        lines += [
            "",
            "`auto`: share of its steps on the draft model, and the champion's speed-up under `auto` "
            "(`auto_gated` ÷ `auto_static`; the gate's served score that re-seeded it):",
            "",
            "| cluster | " + " | ".join(f"draft steps, {a}" for a in arms) + " | auto_gated ÷ auto_static | seed |",
            "|---|" + "---:|" * (len(arms) + 2),
        ]
        for d in clusters:
            if d in share:
                seed = s["auto_champion_alpha"].get(d)
                lines.append(
                    f"| {d} | "
                    + " | ".join(f"{share[d][a]:.2f}" if a in share[d] else "–" for a in arms)
                    + f" | {s['auto_default_vs_static'][d]:.2f}x | {'–' if seed is None else f'{seed:.3f}'} |"
                )
    return "\n".join(lines)


def grid_markdown(g: dict) -> str:
    lines = [
        f"Recipe grid: ungated, {g['requests_per_domain']} requests per domain (3 domains interleaved), per-token α "
        "on the held-out probe after the traffic. Static: "
        + ", ".join(f"{d} {a:.3f}" for d, a in g["static"].items())
        + ".",
        "",
        "| run | " + " | ".join(DOMAINS) + " | mean | gain vs static | trainer CPU s / request |",
        "|---|" + "---:|" * (len(DOMAINS) + 3),
    ]
    for r in g["rows"]:
        lines.append(
            f"| {r['name']} | "
            + " | ".join(f"{r['alpha_token'][d]:.3f}" for d in DOMAINS)
            + f" | {r['mean']:.3f} | {r['gain_vs_static']:+.3f} | {r['trainer_cpu_s_per_request']:.3f} |"
        )
    dp = g["depth"]
    pc = g["positions_cost"]
    samp = {r["config"]["sampling"]: r for r in g["rows"] if r.get("sampling_row")}
    if len(samp) > 1:
        lines += [
            "",
            "Sampling (OSD Table 1; the center recipe otherwise, the same traffic): "
            + "; ".join(
                f"{lv}{' (λ = ' + str(r['config']['mix']) + ')' if 'mix' in r['config'] else ''} mean α "
                f"{r['mean']:.3f} ({r['gain_vs_static']:+.3f} vs static), {r['trainer_cpu_s_per_request']:.2f} "
                "trainer CPU s / request"
                for lv, r in samp.items()
            )
            + ".",
        ]
    lines += [
        "",
        f"Chosen (best probe α within {g['budget_s_per_request']} trainer CPU s per request): "
        f"{g['chosen_name']}: " + ", ".join(f"`{k}={v}`" for k, v in g["chosen"].items()) + ".",
        "Draft depth, with the chosen recipe from the target's own layers (undistilled): "
        + "; ".join(f"{k} layers α {v['mean']:.3f}, c = {v['c']:.3f}" for k, v in dp.items())
        + ".",
        f"Training at every position costs, per request: {pc['bytes_all'] / 1024:.1f} KiB logged (against "
        f"{pc['bytes_rejected'] / 1024:.1f} KiB for the rejected positions), or one target forward of "
        f"{pc['teacher_forward_s'] * 1000:.0f} ms in the trainer (`trainer.data.TargetTeacher`).",
    ]
    return "\n".join(lines)


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


# ---------------------------------------------------------------- 10. main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Full run: about 1.5 h on 2 cores (target continuations cached after the first).",
    )
    p.add_argument("--model-dir", default=str(models_dir()), help="bootstrap dir with target/, draft/, manifest.json")
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="distinct chat requests served per domain (default 1000; 120 with --quick)",
    )
    p.add_argument(
        "--probe", type=int, default=None, help="held-out probe requests per domain (default 100; 40 with --quick)"
    )
    p.add_argument(
        "--router-texts",
        type=int,
        default=None,
        help="prompts per domain the router is fitted on (default 100; 30 with --quick)",
    )
    p.add_argument("--router-embedder", default="minilm", help="router embedder (serving's: minilm)")
    p.add_argument(
        "--max-new-tokens", type=int, default=None, help="new tokens per request (default 48; 32 with --quick)"
    )
    p.add_argument("--k", type=int, default=DEFAULT_K["draft"], help="draft tokens per step (the engine's default)")
    p.add_argument("--interval", type=int, default=None, help="trainer: update interval I (default: the trainer's)")
    p.add_argument("--lr", type=float, default=None, help="trainer: learning rate (default: the trainer's)")
    p.add_argument("--steps", type=int, default=None, help="trainer: AdamW steps per update (default: the trainer's)")
    p.add_argument(
        "--average-decay",
        type=float,
        default=None,
        metavar="D",
        help="trainer: publish a moving average of the weights at decay D, 0 = off (default: the trainer's)",
    )
    p.add_argument("--loss", choices=("fkl", "rkl", "jsd"), default=None, help="trainer: loss (default: the trainer's)")
    p.add_argument(
        "--positions",
        choices=("rejected", "all"),
        default=None,
        help="trainer: positions trained (default: the trainer's)",
    )
    p.add_argument(
        "--replay",
        choices=("clear", "recent", "reservoir"),
        default=None,
        help="trainer: replay policy (default: the trainer's)",
    )
    p.add_argument("--capacity", type=int, default=None, help="trainer: replay capacity (default: the trainer's)")
    p.add_argument(
        "--probe-every",
        type=int,
        default=None,
        help="measure the probe every N requests of a cluster (default 100; 40 with --quick)",
    )
    p.add_argument("--offline-epochs", type=int, default=2, help="offline distillation epochs (the paper's 2)")
    p.add_argument("--offline-lr", type=float, default=1e-3, help="offline learning rate")
    p.add_argument(
        "--offline-sweep",
        default="",
        metavar="LR:E,E;LR:E",
        help="more offline configurations (learning rate: epoch counts, one run per rate); the offline arm, the "
        "bound, is the best on the probe of these and the default (e.g. '1e-3:1,3;3e-3:1,2,3')",
    )
    p.add_argument(
        "--baseline-fraction",
        type=float,
        default=0.1,
        help="the paper's baseline: offline distillation on this share of each domain's served requests "
        "(0 skips; runs with the offline part)",
    )
    p.add_argument("--offline-batch", type=int, default=8, help="sequences per offline step")
    p.add_argument(
        "--generic",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run the loop from a generic (never distilled) draft (default: on; off with --quick)",
    )
    p.add_argument(
        "--generic-requests", type=int, default=None, help="requests per domain of the generic run (default 300)"
    )
    p.add_argument("--generic-steps", type=int, default=400, help="hard-label training steps of the generic draft")
    p.add_argument(
        "--shift-requests",
        type=int,
        default=None,
        help="requests per segment of the sql -> math -> sql switch on one draft (default 400; 40 with --quick; 0 skips)",
    )
    p.add_argument(
        "--gate-windows",
        default=",".join(map(str, SHIFT_WINDOWS)),
        help="shift run: more gated arms beside the gate's default, on the same candidates and requests, each W "
        "(held-out window W, 0 = all the trainer keeps) or W:F (and F fresh test-then-train requests, 0 = "
        "held-out only; W alone takes the default F) ('' for none)",
    )
    p.add_argument(
        "--main-windows",
        default="",
        help="main run: gate arms (W or W:F, as --gate-windows) measured as more gated arms (served α over each cluster's last "
        f"{WINDOW} requests; e.g. '0' for the whole held-out set)",
    )
    p.add_argument(
        "--auto-warm",
        type=int,
        default=None,
        help="probe prompts per domain the auto policy serves with the static draft before the speed arms (its "
        "history in the cluster; default 4, 1 with --quick)",
    )
    p.add_argument(
        "--families",
        choices=("seen", "all"),
        default="seen",
        help="seen: served traffic, its probe and the router texts leave out the held-out families (sql schemas, "
        "math templates, api packages: specops.workloads.chat_workload.HELD_OUT), which the template-disjoint probe uses; "
        "all: every family (the workload before issue 55, no disjoint probe)",
    )
    p.add_argument(
        "--probe-disjoint",
        type=int,
        default=None,
        help="template-disjoint probe requests per domain, from the held-out families only (default 100; 40 with "
        "--quick; 0 skips)",
    )
    p.add_argument("--audit-window", type=int, default=50, help="requests of its cluster each promotion is audited on")
    p.add_argument("--check-every", type=int, default=100, help="decode every N-th request with the real engine too")
    p.add_argument(
        "--speed-prompts",
        type=int,
        default=None,
        help="probe prompts per domain timed with the real engine (default 6; 2 with --quick; 0 skips)",
    )
    p.add_argument(
        "--prepare",
        action="store_true",
        help="only build the workload and cache the target's continuations (the slow first step), then exit",
    )
    p.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="which parts to run (comma-separated): two processes can share the work, then --merge their JSONs",
    )
    p.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="merge the --json reports of runs of different --parts (the first one's command and config "
        "lead), then write the summary, plot, JSON and doc as one run; runs nothing",
    )
    p.add_argument(
        "--grid",
        action="store_true",
        help="run the recipe grid (quick size: --grid-requests per domain) instead of the arms",
    )
    p.add_argument(
        "--grid-reuse",
        type=Path,
        default=None,
        metavar="JSON",
        help="a (partial) --grid JSON whose rows are reused where the recipe and traffic size match",
    )
    p.add_argument("--grid-requests", type=int, default=None, help="requests per domain of each grid run (default 80)")
    p.add_argument(
        "--domains",
        default=",".join(DEFAULT_DOMAINS),
        help="chat domains, one cluster each (comma-separated; default %(default)s). docs: documentation "
        "paragraphs of pinned packages to rewrite in plain words, real text rather than templates "
        "(specops.workloads.chat_workload.REAL_TEXT); run it on its own and --merge its JSON beside the main run's",
    )
    p.add_argument("--batch", type=int, default=16, help="prompts per batched target generation")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument(
        "--speed-threads",
        type=int,
        default=None,
        help="torch CPU threads for the speed part only (default: --threads); e.g. learn on 2 threads, time on 1 "
        "as a one-core replica serves",
    )
    p.add_argument("--quick", action="store_true", help="120 requests per domain, 32 new tokens, no generic run")
    p.add_argument("--json", type=Path, default=None, help="write the full results here")
    p.add_argument(
        "--plot", type=Path, default=REPO_ROOT / "docs" / "img" / "osd.png", help="PNG plot of α over requests"
    )
    p.add_argument("--doc", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md", help="markdown doc to update")
    p.add_argument("--no-doc", action="store_true", help="do not write the doc")
    p.add_argument(
        "--replot",
        type=Path,
        default=None,
        metavar="JSON",
        help="re-derive the summary, plot, table and doc section from a saved --json report; runs nothing",
    )
    p.add_argument(
        "--teacher-forward",
        action="store_true",
        help="measure teacher-forward training (requests an external engine served, no distributions logged) "
        "against the native path instead of the arms (benchmarks/osd_teacher.py)",
    )
    p.add_argument("--tf-domains", default="sql", help="domains of --teacher-forward (comma-separated)")
    args = p.parse_args(argv)
    q = args.quick
    for name, full, quick in (
        ("requests", 1000, 120),
        ("probe", 100, 40),
        ("router_texts", 100, 30),
        ("max_new_tokens", 48, 32),
        ("probe_every", 100, 40),
        ("generic", True, False),
        ("generic_requests", 300, 60),
        ("shift_requests", 400, 40),
        ("speed_prompts", 6, 2),
        ("auto_warm", 4, 1),
        ("probe_disjoint", 100, 40),
        ("grid_requests", 80, 80),
    ):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    return args


def set_domains(names) -> None:
    """The domains (clusters) this process runs or reports: ``--domains`` for a run; for
    ``--replot`` and ``--merge``, those the report measured."""
    global DOMAINS
    names = tuple(names)
    unknown = [d for d in names if d not in ALL_DOMAINS]
    if unknown or not names:
        raise SystemExit(f"--domains: unknown {unknown or 'none given'}; choose from {', '.join(ALL_DOMAINS)}")
    DOMAINS = names


def report_domains(report: dict) -> list[str]:
    """The domains a report measured, in :data:`ALL_DOMAINS` order."""
    return [d for d in ALL_DOMAINS if d in (report.get("static") or {})]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_domains(d.strip() for d in args.domains.split(",") if d.strip())
    if args.replot:
        report = json.loads(args.replot.read_text())
        set_domains(report_domains(report) or DOMAINS)
        args.json = args.json or args.replot
        if report.get("mode") == "teacher_forward":
            from benchmarks import osd_teacher

            return osd_teacher.finish(report, args)
        if "rows" in report and "requests_per_domain" in report:  # a --grid run
            set_domains([d for d in ALL_DOMAINS if d in report["static"]])
            return grid_finish(report, args)
        return finish(report, args)
    if args.merge:
        if json.loads(args.merge[0].read_text()).get("mode") == "teacher_forward":
            from benchmarks import osd_teacher

            return osd_teacher.merge(args.merge, args, argv)
        report = {}
        for path in args.merge:
            part = json.loads(path.read_text())
            if "rows" in part and "requests_per_domain" in part:  # a --grid run: its rows, kept beside the arms
                report["grid"] = {**part, "file": str(path)}
                continue
            if report and not set(report_domains(part)) & set(report_domains(report)):
                # a run of other domains (--domains docs): its summary, reported beside the main run's clusters
                report.setdefault("other_domains", []).append(
                    {"file": str(path), "command": part.get("command"), "summary": part.get("summary") or {}}
                )
                continue
            taken = [k for k in PARTS if k in part and k not in report]  # the first file holding a part gives it
            for key, value in part.items():
                if key == "disjoint" and key in report:  # each part measured its own arms on the disjoint probe
                    for d, arms in value.items():
                        report[key].setdefault(d, {}).update({a: v for a, v in arms.items() if a not in report[key][d]})
                report.setdefault(key, value)
            env = part.get("environment") or {}
            report.setdefault("merged_from", []).append(
                {
                    "file": str(path),
                    "command": part.get("command"),
                    "elapsed_s": part.get("elapsed_s"),
                    "date": part.get("date"),
                    "cpu_model": env.get("cpu_model"),
                    "git_commit": env.get("git_commit"),
                    "parts": taken,
                    "config": part.get("config"),
                }
            )
        report["merge_command"] = " ".join(
            [".venv/bin/python", "benchmarks/osd.py", *map(shlex.quote, argv if argv is not None else sys.argv[1:])]
        )
        report["elapsed_s"] = max(m["elapsed_s"] or 0 for m in report["merged_from"])
        set_domains(report_domains(report))
        return finish(report, args)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model_dir = Path(args.model_dir)
    # Learning is measured in float32, the precision the trainer trains and evaluates in.
    pair = load_model_dir(model_dir, draft_dtype="float32")
    if args.teacher_forward:
        from benchmarks import osd_teacher

        return osd_teacher.run(pair, args, model_dir, argv)
    base_dir = model_dir / "draft"
    streams, probes, routers, distinct, disjoint = build_workload(pair, args, model_dir)
    if args.prepare:
        print(
            f"cached the target's continuations of {sum(len(v) for v in streams.values())} served, "
            f"{sum(len(v) for v in probes.values())} probe and {sum(len(v) for v in disjoint.values())} "
            f"template-disjoint probe requests under {model_dir / 'cache' / 'osd-chat'}"
        )
        return 0
    command = " ".join(
        [".venv/bin/python", "benchmarks/osd.py", *map(shlex.quote, argv if argv is not None else sys.argv[1:])]
    )
    env = {**environment(), "cpu_model": cpu_model()}
    with tempfile.TemporaryDirectory(prefix="specops-osd-") as tmp_s:
        tmp = Path(tmp_s)
        if args.grid:
            g = grid(pair, base_dir, streams, probes, args, tmp, model_dir)
            g.update(
                {
                    "command": command,
                    "date": datetime.now(UTC).isoformat(timespec="seconds"),
                    "environment": env,
                    "distinct_prompts": distinct,
                    "elapsed_s": time.perf_counter() - started,
                }
            )
            return grid_finish(g, args)
        report: dict = {"distinct_prompts": distinct}
        parts = set(args.parts.split(","))
        ocfg = online_config(args)
        report["static"] = {d: probe(pair.draft, probes[d], args).to_dict() for d in DOMAINS}
        if any(disjoint.values()):  # the template-disjoint probe: families served traffic never had
            report["disjoint"] = {d: {"static": probe(pair.draft, disjoint[d], args).to_dict()} for d in DOMAINS}
        drafts: dict = {}
        if "main" in parts:
            # routing: every served and probe request by serving's router; the user message alone as a harder check
            texts = [
                (pair.tokenizer.decode(s.prompt.token_ids), s.prompt.domain)
                for d in DOMAINS
                for s in streams[d] + probes[d]
            ]
            routed = route(routers, [t for t, _ in texts], args)
            user_only = route(routers, [s.prompt.text for d in DOMAINS for s in probes[d]], args)
            truth_user = [d for d in DOMAINS for _ in probes[d]]
            report["routing"] = {
                "accuracy": statistics.fmean(r == d for r, (_, d) in zip(routed, texts)),
                "accuracy_user_only": statistics.fmean(r == d for r, d in zip(user_only, truth_user)),
                "requests": len(texts),
            }
            cluster_of = {
                tuple(s.prompt.token_ids): r
                for (s, r) in zip([s for d in DOMAINS for s in streams[d] + probes[d]], routed)
            }
            traffic = [(s, cluster_of[tuple(s.prompt.token_ids)]) for s in interleave(streams, args.seed)]
            main_run = learning_run(
                pair,
                base_dir,
                pair.draft,
                traffic,
                probes,
                args,
                tmp,
                label="main",
                ocfg=ocfg,
                probe_every=args.probe_every,
                windows=tuple(w.strip() for w in args.main_windows.split(",") if w.strip()),
            )
            report["main"] = {k: v for k, v in main_run.items() if k != "drafts"}
            report["engine_checks"] = main_run["checks"]
            drafts = {
                d: {"gated": main_run["drafts"]["gated"][d], "ungated": main_run["drafts"]["ungated"][d]}
                for d in main_run["drafts"]["gated"]
            }
            for d in report.get("disjoint", {}):
                if d in drafts:
                    for arm in ("gated", "ungated"):
                        report["disjoint"][d][arm] = probe(drafts[d][arm], disjoint[d], args).to_dict()
            if args.json:  # kept even if a later part fails: the main part is most of the run's time
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.with_suffix(".main-part.json").write_text(
                    json.dumps({**report, "command": " ".join(sys.argv)}, indent=1)
                )
        offline = {}
        if "offline" in parts:
            offline = {}
            report["offline"], report["offline_sweep"], report["baseline_10pct"] = {}, {}, {}
            for d in DOMAINS:
                offline[d], bound, report["offline_sweep"][d] = offline_bound(
                    pair.draft, streams[d], probes[d], args, d
                )
                report["offline"][d] = bound.to_dict()
                if args.baseline_fraction:  # the paper's baseline: offline distillation on a tenth of the domain's data
                    part = streams[d][: max(1, int(len(streams[d]) * args.baseline_fraction))]
                    small = offline_distill(pair.draft, part, args, f"{d}/{args.baseline_fraction:.0%} of the data")
                    report["baseline_10pct"][d] = {
                        **probe(small, probes[d], args).to_dict(),
                        "requests": len(part),
                        **({"disjoint": probe(small, disjoint[d], args).to_dict()} if report.get("disjoint") else {}),
                    }
            for d in report.get("disjoint", {}):
                report["disjoint"][d]["offline"] = probe(offline[d], disjoint[d], args).to_dict()
        if args.speed_prompts and "speed" in parts and (drafts or offline):  # offline,speed: the bound's draft alone
            if args.speed_threads:
                torch.set_num_threads(args.speed_threads)
            report["speed_threads"] = torch.get_num_threads()
            report["speed"] = {
                d: speed(
                    pair,
                    {"static": pair.draft, **drafts.get(d, {}), **({"offline": offline[d]} if d in offline else {})},
                    probes[d][: args.speed_prompts],
                    args,
                    cluster=d,
                    champion_alpha=(report.get("main") or {}).get("champion_scores", {}).get(d),
                    offline_alpha=(report.get("offline") or {}).get(d, {}).get("alpha_token"),
                    warm=probes[d][args.speed_prompts : args.speed_prompts + args.auto_warm],
                )
                for d in DOMAINS
                if d in drafts or d in offline
            }
        if args.generic and "generic" in parts:
            from specops.trainer.bootstrap.generic import build_generic_draft

            gdir = build_generic_draft(model_dir, steps=args.generic_steps)
            gdraft = load_model(gdir)
            gtraffic = [
                (s, s.prompt.domain)
                for s in interleave({d: v[: args.generic_requests] for d, v in streams.items()}, args.seed)
            ]
            grun = learning_run(
                pair,
                gdir,
                gdraft,
                gtraffic,
                probes,
                args,
                tmp,
                label="generic",
                ocfg=ocfg,
                probe_every=args.probe_every,
                audit=False,
            )
            report["generic"] = {
                "static": {d: probe(gdraft, probes[d], args).alpha_token for d in DOMAINS},
                "gated": {d: grun["final"][d]["gated"]["alpha_token"] for d in DOMAINS},
                "ungated": {d: grun["final"][d]["ungated"]["alpha_token"] for d in DOMAINS},
                "promotions": len(grun["gates"]) and sum(g["promoted"] for g in grun["gates"]),
                "curves": grun["curves"],
            }
        if args.shift_requests and "shift" in parts and len(DOMAINS) >= 2:
            n = min(args.shift_requests, args.requests // 2)
            windows = tuple(w.strip() for w in args.gate_windows.split(",") if w.strip())
            a, b = DOMAINS[0], DOMAINS[1]
            seq = streams[a][:n] + streams[b][:n] + streams[a][n : 2 * n]
            srun = learning_run(
                pair,
                base_dir,
                pair.draft,
                [(s, "shift") for s in seq],
                {},
                args,
                tmp,
                label="shift",
                ocfg=ocfg,
                windows=windows,
            )
            rows = srun["rows"]
            before = rows[max(0, n - WINDOW) : n]
            ref = pooled(before)
            arms = {"gated": "", "ungated": "u_", **{f"w{arm_key(w)}": f"w{arm_key(w)}_" for w in windows}}
            report["shift"] = {
                "domains": [a, b, a],
                "boundaries": [n, 2 * n],
                "window": PromoteConfig().window,
                "fresh": PromoteConfig().fresh,
                "segments": shift_segments(rows, [a, b, a], n, arms),
                "windows": srun["windows"],
                "audits": srun["promotions"],
                "worse_promotions": sum(p["worse_beyond_noise"] for p in srun["promotions"]),
                "window_curves": {f"w{arm_key(w)}": moving(rows, f"w{arm_key(w)}_") for w in windows},
                "reference": ref,
                "gated_curve": moving(rows),
                "ungated_curve": moving(rows, "u_"),
                "recovery": {
                    "requests": recovery(rows, 2 * n, 3 * n, ref),
                    "reference": ref,
                    "ungated_requests": recovery(
                        rows,
                        2 * n,
                        3 * n,
                        pooled([{"accepted": r["u_accepted"], "rejected": r["u_rejected"]} for r in before]),
                        prefix="u_",
                    ),
                },
                "promotions": sum(g["promoted"] for g in srun["gates"]),
            }
    report.update(
        {
            "command": command,
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "config": {
                "target": target_name(model_dir),
                "requests": args.requests,
                "probe": args.probe,
                "router_texts": args.router_texts,
                "max_new_tokens": args.max_new_tokens,
                "k": args.k,
                "recipe": ", ".join(f"{k} {v}" for k, v in _recipe(ocfg).items()),
                "offline_epochs": args.offline_epochs,
                "offline_lr": args.offline_lr,
                "generic_requests": args.generic_requests if args.generic else None,
                "generic_steps": args.generic_steps if args.generic else None,
                "shift_requests": args.shift_requests,
                "audit_window": args.audit_window,
                "check_every": args.check_every,
                "window": WINDOW,
                "gate_metric": PromoteConfig().metric,
                "gate_window": PromoteConfig().window,
                "gate_fresh": PromoteConfig().fresh,
                "gate_windows": args.gate_windows,
                "main_windows": args.main_windows,
            },
            "environment": env,
            "elapsed_s": time.perf_counter() - started,
        }
    )
    return finish(report, args)


def grid_finish(g: dict, args: argparse.Namespace) -> int:
    """Table, JSON and doc section of a finished (or reloaded) ``--grid`` run."""
    text = grid_markdown(g)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(g, indent=1))
    if not args.no_doc:
        env = g["environment"]
        write_doc_section(
            args.doc,
            GRID_BEGIN,
            GRID_END,
            "\n".join(
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
            ),
        )
    return 0


def finish(report: dict, args: argparse.Namespace) -> int:
    """Summary, plot, table, JSON and doc section of a finished (or reloaded) run."""
    if "main" not in report or "offline" not in report:  # one process's share of --parts: merged later
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1))
        print(f"partial run (parts {sorted(k for k in report if k in PARTS)}): combine the reports with --merge")
        return 0
    report["summary"] = summarise(report)
    plot(report, args.plot)
    table = markdown(report)
    print(table)
    print(json.dumps(report["summary"], indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    if not args.no_doc:
        rel = os.path.relpath(args.plot, args.doc.parent)
        write_doc_section(args.doc, DOC_BEGIN, DOC_END, doc_section(report, table, rel))
    checks = report["summary"]["engine_checks"]
    return 0 if checks["identical"] == checks["n"] else 1


if __name__ == "__main__":
    sys.exit(main())
