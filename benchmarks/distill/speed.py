"""The OSD benchmark's speed: tokens/s of the draft method with each arm's final draft against
target-only (the real engine, arms interleaved), the draft/target cost ratio and the cost of
training at every output position."""

from __future__ import annotations

import copy
import statistics
import time

import torch

from benchmarks.distill import scope
from benchmarks.distill.served import Outcome, Served, logged_result, serve
from specops.core.models import ModelPair
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.fleet.stream_logger import RequestMeta
from specops.serving.plan import plain_generate


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
            plain_generate(
                engines["static"],
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
                res = plain_generate(
                    engines[draft],
                    s.prompt.token_ids,
                    params,
                    method="auto",
                    resources=ProposerResources(pair=pairs[draft], cluster=cluster, policy=policy),
                )
                for m, v in ((res.stats.policy or {}).get("methods") or {}).items():
                    steps[name][m] = steps[name].get(m, 0) + v["steps"]
            else:
                eng = engines.get(name) or next(iter(engines.values()))
                res = plain_generate(
                    eng, s.prompt.token_ids, params, method="target" if name == "target" else "draft", k=args.k
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


def positions_cost(pair: ModelPair, streams: dict, args) -> dict:
    """What training at every position costs: bytes per MissRecord when serving logs every
    position (against the rejected ones only), and seconds of the trainer's teacher forward."""
    from specops.serving.fleet.stream_logger import build_records
    from specops.streams import codec
    from specops.trainer.data import TargetTeacher

    sample = [s for d in scope.DOMAINS for s in streams[d][:8]]
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
