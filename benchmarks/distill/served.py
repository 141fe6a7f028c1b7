"""The OSD benchmark's traffic: the target's greedy continuations (cached on disk), a request served
to a draft by replaying the engine's step rule, the probe, and the workload (streams, probes,
routers) with its arrival order and routing."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from benchmarks.distill import scope
from benchmarks.distill.constants import TOPK
from benchmarks.harness.interleave import mix_streams
from specops.core import draft_vocab
from specops.core.models import ModelPair
from specops.serving.engine.types import GenerationResult, RejectedPosition, RequestStats, token_alpha
from specops.trainer.data import Example
from specops.trainer.losses import TargetDist
from specops.workloads.chat_workload import chat_workload
from specops.workloads.prompts import Prompt


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


# ---------------------------------------------------------------- 7. workload
def build_workload(pair: ModelPair, args, model_dir: Path) -> tuple[dict, dict, dict, bool, dict]:
    """Per domain: the served stream and the probe (with continuations), the router texts;
    whether every prompt of the run is distinct (by token ids); and the template-disjoint probe
    (``--probe-disjoint`` prompts of the families served traffic never has,
    ``specops.workloads.chat_workload.HELD_OUT``; empty with ``--families all``)."""
    parts = chat_workload(
        pair.tokenizer,
        {"router": args.router_texts, "served": args.requests, "probe": args.probe},
        domains=scope.DOMAINS,
        seed=args.seed,
        families=args.families,
    )
    held = (
        chat_workload(
            pair.tokenizer, {"probe": args.probe_disjoint}, domains=scope.DOMAINS, seed=args.seed, families="held_out"
        )
        if args.families == "seen" and args.probe_disjoint
        else {d: {"probe": []} for d in scope.DOMAINS}
    )
    cache = model_dir / "cache" / "osd-chat"
    streams, probes, disjoint = {}, {}, {}
    everything = [p for d in scope.DOMAINS for part in [*parts[d].values(), *held[d].values()] for p in part]
    distinct = len({tuple(p.token_ids) for p in everything}) == len(everything)
    for d in scope.DOMAINS:
        mine = parts[d]["served"] + parts[d]["probe"] + held[d]["probe"]
        served = continuations(pair, mine, args.max_new_tokens, cache, args.batch)
        n, m = args.requests, args.requests + len(parts[d]["probe"])
        streams[d], probes[d], disjoint[d] = served[:n], served[n:m], served[m:]
    routers = {d: [pair.tokenizer.decode(p.token_ids) for p in parts[d]["router"]] for d in scope.DOMAINS}
    return streams, probes, routers, distinct, disjoint


def interleave(streams: dict[str, list[Served]], seed: int) -> list[Served]:
    """The domains' streams mixed into one arrival order (seeded), each stream's order kept."""
    return mix_streams(streams, seed)


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
