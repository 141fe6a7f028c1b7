"""Section 2 of ``benchmarks/gpu_check.py``: target-pass, draft and loop timings on randomly
initialised models of real shapes (no weights travel to the GPU machine), and the helpers every
section shares: a deadline per section (:class:`OutOfTime`) and :func:`attempt`, which records a
failure (under the GPU machine's older torch or transformers, say) and lets the other sections run."""

from __future__ import annotations

import logging
import statistics
import threading
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks import gpu_compat  # noqa: F401  (before specops: stand-ins for the pins the GPU machine lacks)
from specops.core import draft_vocab
from specops.core.cost import step_ms
from specops.core.draft_vocab import DraftVocab
from specops.core.models import ModelPair, prepare_for_decoding
from specops.serving.engine.batching import TargetBatcher
from specops.serving.engine.kv import CachedLM
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.tree import build as build_tree
from specops.serving.engine.types import SamplingParams
from specops.trainer.bootstrap.distill import DraftRecipe, init_draft

log = logging.getLogger("benchmarks.gpu_check")

_COMMON = dict(rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
SHAPES = {
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        **_COMMON,
    ),
    "smollm2-1.7b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=130000.0,
        **_COMMON,
    ),
}
"""HuggingFaceTB/SmolLM2-135M and -1.7B's configs (the fields that shape the compute)."""

DRY_SHAPES = {
    "smollm2-135m": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        max_position_embeddings=1024,
        rope_theta=100000.0,
        **_COMMON,
    ),
    "smollm2-1.7b": dict(
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=24,
        vocab_size=512,
        max_position_embeddings=1024,
        rope_theta=130000.0,
        **_COMMON,
    ),
}
"""The same code's tiny shapes for ``--dry-run``."""

VERIFY_TOKENS = (1, 2, 4, 5, 8, 16)
"""Tokens of one cached target pass (5 = a draft of k = 4 plus the bonus position)."""
TREES = {"10x6": (10, 6), "3x20": (3, 20)}
"""Token trees timed in one pass: rows x depth (distinct rows: 60 nodes each)."""
CONCURRENCY = (1, 4, 16)

DRY_RUN_SETTINGS = dict(context=32, new_tokens=8, reps=5, warmup=2, loop_reps=2, draft_vocab=128)
RUN_SETTINGS = dict(context=128, new_tokens=64, reps=30, warmup=5, loop_reps=3, draft_vocab=DraftRecipe().vocab_size)


class OutOfTime(Exception):
    """A section ran past its cap; what it measured so far is kept."""


def _check(deadline: float, what: str) -> None:
    if time.perf_counter() > deadline:
        raise OutOfTime(f"out of time before {what}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- models
def build_target(shape: dict, device: torch.device, dtype: torch.dtype, seed: int = 0) -> LlamaForCausalLM:
    """A randomly initialised Llama of ``shape``, built on ``device`` (no weights travel)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(**shape)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model.to(dtype).eval()
    return prepare_for_decoding(model)


def build_draft(target: LlamaForCausalLM, vocab_rows: int, seed: int = 0) -> LlamaForCausalLM:
    """The bootstrap's draft of ``target`` (``specops.trainer.bootstrap.distill.init_draft``: its layers 0 and 1,
    its embeddings, norm and head) with a draft vocabulary of ``vocab_rows`` head rows, as served."""
    draft = init_draft(target, DraftRecipe().layers).to(target.device, target.dtype).eval()
    vocab = int(target.config.vocab_size)
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(vocab, generator=g)[: min(vocab_rows, vocab)].sort().values
    draft_vocab.attach(draft, DraftVocab(rows, vocab))
    return prepare_for_decoding(draft)


def context_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n,), generator=g).tolist()


# ---------------------------------------------------------------- 2. timings
def tree_ms(model, ctx: list[int], rows: int, depth: int, *, reps: int, warmup: int, deadline: float) -> float:
    """Median ms of one cached pass over a ``rows`` x ``depth`` token tree after ``ctx`` (``CachedLM.forward_tree``)."""
    lm = CachedLM(model)
    lm.forward(ctx[:-1], logits_to_keep=1)
    base = lm.num_cached
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(rows * 100 + depth)
    first = torch.randperm(vocab - 1, generator=g)[:rows] + 1  # distinct first tokens: rows x depth nodes
    tree = build_tree(
        [[int(first[r])] + torch.randint(1, vocab, (depth - 1,), generator=g).tolist() for r in range(rows)]
    )
    times = []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        lm.forward_tree([ctx[-1]], tree)  # logits come back to the CPU: the pass has finished
        elapsed = time.perf_counter() - t0
        lm.rollback(base)
        if i >= warmup:
            times.append(elapsed)
            if time.perf_counter() > deadline and len(times) >= 3:
                break
    return statistics.median(times) * 1000.0


def verify_curve(model, ctx: list[int], s: dict, deadline: float) -> dict:
    """Target pass ms over :data:`VERIFY_TOKENS` tokens and :data:`TREES`, each over the 1-token pass."""
    ms: dict[str, float] = {}
    for n in VERIFY_TOKENS:  # every shape once first: one-time costs (kernels loaded, the allocator) stay out
        step_ms(model, ctx, n, reps=1, warmup=1)
    for n in VERIFY_TOKENS:
        _check(deadline, f"the {n}-token pass")
        ms[str(n)] = step_ms(model, ctx, n, reps=s["reps"], warmup=s["warmup"])
    trees: dict[str, float] = {}
    for name, (rows, depth) in TREES.items():
        _check(deadline, f"the {name} tree")
        trees[name] = tree_ms(model, ctx, rows, depth, reps=s["reps"], warmup=s["warmup"], deadline=deadline)
    one = ms["1"]
    return {
        "ms": ms,
        "ratio": {n: v / one for n, v in ms.items()},
        "tree_ms": trees,
        "tree_ratio": {n: v / one for n, v in trees.items()},
        "tree_nodes": {name: rows * depth for name, (rows, depth) in TREES.items()},
    }


def loop_vs_hf(target, ctx: list[int], s: dict, deadline: float) -> dict:
    """Our target-only loop (``SpecEngine``, method ``target``) against HF ``generate``, greedy, same
    prompt and length, interleaved; the ratio is the median of per-round tokens/s ratios."""
    engine = SpecEngine(ModelPair(target=target, draft=None, tokenizer=None))
    n = s["new_tokens"]
    params = SamplingParams(temperature=0.0, max_new_tokens=n)
    ids = torch.tensor([ctx], device=target.device)

    def ours() -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        out = engine.generate(ctx, params, None, 1).token_ids  # target-only: no proposer (k is unused)
        return time.perf_counter() - t0, out

    def hf() -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False
            )
        toks = out[0, len(ctx) :].tolist()  # on the CPU: the generation has finished
        return time.perf_counter() - t0, toks

    ours(), hf()  # warm-up: kernels, allocator, HF's generation config
    runs: dict[str, list[float]] = {"ours": [], "hf": []}
    ratios, identical = [], True
    for r in range(s["loop_reps"]):
        _check(deadline, f"loop round {r}")
        (t_ours, a), (t_hf, b) = ours(), hf()
        identical &= a == b
        runs["ours"].append(len(a) / t_ours)
        runs["hf"].append(len(b) / t_hf)
        ratios.append((len(a) / t_ours) / (len(b) / t_hf))
    return {
        "new_tokens": n,
        "tokens_per_s": {k: statistics.median(v) for k, v in runs.items()},
        "runs_tokens_per_s": runs,
        "target_vs_hf_target": statistics.median(ratios),
        "identical": identical,
    }


def batched_throughput(target, s: dict, deadline: float) -> dict:
    """Target-only tokens/s with 1, 4, 16 requests in flight sharing passes through serving's ``TargetBatcher``."""
    pair = ModelPair(target=target, draft=None, tokenizer=None)
    n = s["new_tokens"]
    params = SamplingParams(temperature=0.0, max_new_tokens=n)
    vocab = int(target.config.vocab_size)
    out: dict[str, dict] = {}
    for conc in CONCURRENCY:
        _check(deadline, f"{conc} concurrent sequences")
        batcher = TargetBatcher(target, max_batch=max(CONCURRENCY), capacity=s["context"] + n + 32)
        prompts = [context_ids(s["context"], vocab, seed=100 + i) for i in range(conc)]
        made = [0] * conc

        def run(i: int) -> None:
            batcher.begin()
            try:
                res = SpecEngine(pair, target_lm=batcher.lm).generate(prompts[i], params, None, 1)
                made[i] = len(res.token_ids)
            finally:
                batcher.end()

        try:
            run(0)  # warm-up: this batch width's kernels
            batcher.num_steps = batcher.num_batches = 0
            threads = [threading.Thread(target=run, args=(i,)) for i in range(conc)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join(max(1.0, deadline - time.perf_counter() + 30))
            wall = time.perf_counter() - t0
            _sync(target.device)
        finally:
            batcher.close()
        out[str(conc)] = {
            "tokens_per_s": sum(made) / wall,
            "per_sequence_tokens_per_s": sum(made) / wall / conc,
            "mean_batch": batcher.num_steps / max(1, batcher.num_batches),
            "wall_s": wall,
        }
    base = out.get("1", {}).get("tokens_per_s")
    for v in out.values():
        v["vs_one"] = v["tokens_per_s"] / base if base else None
    return out


def attempt(errors: dict, what: str, fn):
    """``fn()``, or None with the error recorded under ``what``: code that fails under the GPU machine's
    torch or transformers is a finding, and the other sections still run. ``OutOfTime`` propagates."""
    try:
        return fn()
    except OutOfTime:
        raise
    except Exception as exc:  # noqa: BLE001  (recorded, with the traceback in the log)
        log.exception("%s failed", what)
        errors[what] = f"{type(exc).__name__}: {exc}"[:600]
        return None


def time_shape(name: str, shape: dict, device, dtype, s: dict, deadline: float, errors: dict, *, loop: bool) -> dict:
    """The verify curve, c and (``loop``) our loop against HF for one target shape; its models under ``_models``."""
    t0 = time.perf_counter()
    res: dict = {"shape": name, "config": {k: v for k, v in shape.items() if v is not None}, "reps": s["reps"]}
    models = attempt(errors, f"{name}: models", lambda: _models(shape, device, dtype, s["draft_vocab"]))
    if models is None:
        return res
    target, draft = models
    ctx = context_ids(s["context"], int(shape["vocab_size"]))
    res.update(
        params={
            "target": sum(p.numel() for p in target.parameters()),
            "draft": sum(p.numel() for p in draft.parameters()),
        },
        draft_vocab_rows=draft_vocab.of(draft).size,
        context_tokens=len(ctx),
    )
    try:
        verify = attempt(errors, f"{name}: verify curve", lambda: verify_curve(target, ctx, s, deadline))
        if verify is not None:
            res["verify"] = verify
        _check(deadline, "the draft's step")
        draft_ms = attempt(
            errors, f"{name}: draft step", lambda: step_ms(draft, ctx, 1, reps=s["reps"], warmup=s["warmup"])
        )
        if draft_ms is not None:
            res["draft_1_ms"] = draft_ms
            if verify is not None:
                res["c"] = draft_ms / verify["ms"]["1"]
        if loop:
            lp = attempt(errors, f"{name}: loop vs HF generate", lambda: loop_vs_hf(target, ctx, s, deadline))
            if lp is not None:
                res["loop"] = lp
    except OutOfTime as exc:
        res["incomplete"] = str(exc)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    res["_models"] = (target, draft)  # dropped before the JSON
    return res


def _models(shape: dict, device, dtype, vocab_rows: int):
    target = build_target(shape, device, dtype)
    return target, build_draft(target, vocab_rows)
