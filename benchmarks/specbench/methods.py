"""The arms: Hugging Face baselines (target-only, assisted, prompt lookup) and our engine's methods,
with forward counting.

Split out of ``benchmarks/spec_decode.py``, which is the command.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.generation.utils import GenerationMixin

from benchmarks.specbench.config import HF_PLD_NUM_TOKENS, REFERENCE, BenchConfig, default_arm, serving_setting
from specops.core.cpu_linear import stock_linear
from specops.core.models import ModelPair
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.plan import plain_generate
from specops.serving.proposers.catalogue import DEFAULT_K, ProposerResources


# ---------------------------------------------------------------- counting
class ForwardCounter:
    """Counts forward calls of a module (a pre-hook), for HF and our engine alike."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.n = 0
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        self.n += 1

    def close(self) -> None:
        self._handle.remove()


@dataclass
class HFSpecCounts:
    """Drafted / accepted tokens seen by HF's candidate generator in one generate call."""

    num_drafted: int = 0
    num_accepted: int = 0
    num_steps: int = 0


@contextlib.contextmanager
def hf_spec_counting():
    """Wrap ``update_candidate_strategy`` of the candidate generator HF builds, which it
    calls once per verification with the target scores ``[1, drafted + 1, vocab]`` and
    ``num_matches`` (the accepted drafts). Yields the counts of that generate call."""
    counts = HFSpecCounts()
    original = GenerationMixin._get_candidate_generator

    def patched(self, *args, **kwargs):
        gen = original(self, *args, **kwargs)
        update = gen.update_candidate_strategy

        def counted(input_ids, scores, num_matches):
            counts.num_drafted += int(scores.shape[1]) - 1
            counts.num_accepted += int(num_matches)
            counts.num_steps += 1
            return update(input_ids, scores, num_matches)

        gen.update_candidate_strategy = counted
        return gen

    GenerationMixin._get_candidate_generator = patched
    try:
        yield counts
    finally:
        GenerationMixin._get_candidate_generator = original


# ---------------------------------------------------------------- methods
@dataclass
class Outcome:
    """One request by one method."""

    token_ids: list[int]
    wall_s: float
    num_target_forwards: int
    num_drafted: int | None
    num_accepted: int | None
    num_verify_steps: int | None
    num_rejected_steps: int | None = None
    """Verification steps that rejected a draft (ours only, from the engine's stats)."""
    finish_reason: str | None = None
    cpu_share: float | None = None
    """Process CPU seconds / wall seconds of the call: well below 1 means the process was
    paused or starved while timed, and the prompt is measured again."""


@dataclass
class Method:
    name: str
    family: str
    """``hf`` or ``ours``."""
    run: Callable[[list[int], float, int, int], Outcome]
    """(prompt_ids, temperature, max_new_tokens, seed) -> Outcome."""
    k: int | None = None
    headline: bool = True
    """Shown in the main table (sweep rows go to the k table)."""
    settings: dict | None = None
    """What the arm ran with beyond its method and k (``auto``: its policy and calibration),
    recorded under ``our_settings``."""


def hf_method(name: str, pair: ModelPair, counter: ForwardCounter, **extra) -> Method:
    tok = pair.tokenizer
    eos = pair.eos_token_ids
    eos_id = tok.eos_token_id if tok is not None and tok.eos_token_id is not None else (eos[0] if eos else None)
    pad_id = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else eos_id
    speculative = bool(extra)

    def run(prompt_ids: list[int], temperature: float, max_new_tokens: int, seed: int) -> Outcome:
        ids = torch.tensor([prompt_ids], dtype=torch.long)  # [1, n]
        kwargs = dict(
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
            **extra,
        )
        if temperature > 0:
            # top_k=0 turns off HF's default top-k (50): our engine samples the full softmax.
            kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        else:
            kwargs.update(do_sample=False)
        n0 = counter.n
        # HF's loop on the models as from_pretrained loads them (plain nn.Linear): the baseline a
        # user of HF gets. Our arms run on the served models (specops.core.cpu_linear's few-row products).
        with hf_spec_counting() as counts, torch.inference_mode(), stock_linear(pair.target, pair.draft):
            t0 = time.perf_counter()
            out = pair.target.generate(ids, **kwargs)
            wall = time.perf_counter() - t0
        new = out[0, len(prompt_ids) :].tolist()
        finish = "eos" if new and eos_id is not None and new[-1] == eos_id else "length"
        return Outcome(
            token_ids=new,
            wall_s=wall,
            num_target_forwards=counter.n - n0,
            num_drafted=counts.num_drafted if speculative else None,
            num_accepted=counts.num_accepted if speculative else None,
            num_verify_steps=counts.num_steps if speculative else None,
            finish_reason=finish,
        )

    return Method(name=name, family="hf", run=run)


def our_method(
    name: str,
    engine: SpecEngine,
    cfg: dict,
    k: int | None,
    headline: bool = True,
    resources: ProposerResources | None = None,
    settings: dict | None = None,
) -> Method:
    """One of our engine's arms; ``k=None``: the engine's default k for the method (for ``auto``
    the most the policy may pick; it picks each step's k itself)."""

    def run(prompt_ids: list[int], temperature: float, max_new_tokens: int, seed: int) -> Outcome:
        params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
        t0 = time.perf_counter()
        res = plain_generate(engine, prompt_ids, params, **cfg, k=k, resources=resources)
        wall = time.perf_counter() - t0
        s = res.stats
        spec = cfg["method"] != "target"
        return Outcome(
            token_ids=list(res.token_ids),
            wall_s=wall,
            num_target_forwards=s.num_target_forwards,
            num_drafted=s.num_drafted if spec else None,
            num_accepted=s.num_accepted if spec else None,
            num_verify_steps=s.num_verify_steps if spec else None,
            num_rejected_steps=s.num_rejected_steps if spec else None,
            finish_reason=s.finish_reason,
        )

    return Method(
        name=name,
        family="ours",
        run=run,
        k=None if cfg["method"] in ("target", "auto") else k,
        headline=headline,
        settings=settings,
    )


def auto_method(pair: ModelPair, engine: SpecEngine, cfg: BenchConfig) -> Method:
    """``auto`` as a replica runs it: one ``AutoPolicy`` for the whole run (it learns across
    requests, as a replica's does), longest draft ``min(auto_max_k, max_k)`` of serving's
    defaults, cost priors from ``calibrate`` at load (``auto_calibrate``), no fitted priors;
    each step's method and k are the policy's (the engine's default k is only the cap)."""
    from specops.core.auto_policy import AutoPolicy
    from specops.serving.proposers.auto import calibrate

    policy = AutoPolicy(seed=cfg.seed, max_k=min(serving_setting("auto_max_k"), serving_setting("max_k")))
    calibration = calibrate(policy, pair)
    settings = {"max_k": policy.max_k, "draft_max_k": policy.draft_max_k, "seed": cfg.seed, "calibration": calibration}
    res = ProposerResources(pair=pair, policy=policy)
    return our_method("auto", engine, dict(method="auto"), None, resources=res, settings=settings)


def build_methods(pair: ModelPair, cfg: BenchConfig, counter: ForwardCounter, draft32=None) -> list[Method]:
    """The arms; ``draft32``: the draft in float32 for a ``draft_float32`` arm (None: no such arm).
    ``auto`` always runs; serving's default method runs as its own arm (``draft``, ``pld``,
    ``auto``) or, for another method, as ``our_method`` at its default k."""
    engine = SpecEngine(pair)
    methods = [
        hf_method(REFERENCE, pair, counter),
        hf_method("hf_assisted", pair, counter, assistant_model=pair.draft),
        hf_method("hf_pld", pair, counter, prompt_lookup_num_tokens=HF_PLD_NUM_TOKENS),
        our_method("target", engine, dict(method="target"), cfg.k),
        our_method("draft", engine, dict(method="draft"), cfg.k),
        our_method("pld", engine, dict(method="pld"), DEFAULT_K["pld"]),
        auto_method(pair, engine, cfg),
    ]
    default = serving_setting("default_method")
    if default_arm(default) == "our_method":
        spec = dict(method=default)
        methods.append(our_method("our_method", engine, spec, DEFAULT_K[default], settings={"method": default}))
    if draft32 is not None:
        pair32 = ModelPair(
            target=pair.target, draft=draft32, tokenizer=pair.tokenizer, tokenizer_sha256=pair.tokenizer_sha256
        )
        methods.append(our_method("draft_float32", SpecEngine(pair32), dict(method="draft"), cfg.k, headline=False))
    for k in cfg.sweep:
        if k != cfg.k:
            methods.append(our_method(f"draft_k{k}", engine, dict(method="draft"), k, headline=False))
    if cfg.adaptive and cfg.sweep:
        k_max = max(cfg.sweep)
        methods.append(
            our_method(
                f"draft_adaptive_k{k_max}",
                engine,
                dict(method="draft", adaptive_k=True),
                k_max,
                headline=False,
            )
        )
    return methods


def hf_assisted_settings(pair: ModelPair) -> dict:
    """The assistant settings HF uses when none are given (its global generation defaults,
    overridden by anything in the draft's generation_config)."""
    from transformers import GenerationConfig

    defaults = GenerationConfig()._get_default_generation_params()
    draft_cfg = pair.draft.generation_config.to_dict() if pair.draft is not None else {}
    keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    out = {k: draft_cfg.get(k) if draft_cfg.get(k) is not None else defaults.get(k) for k in keys}
    try:
        import sklearn  # noqa: F401

        out["confidence_threshold_adapted"] = True
    except ImportError:
        out["confidence_threshold_adapted"] = False  # HF adapts it via an ROC curve only with scikit-learn
    return out
