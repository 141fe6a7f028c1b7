"""The catalogue of decoding modes, beside the catalogue of methods
(``specops.serving.proposers.catalogue``): a method says how to draft, a mode says what the decode
around it is.

- ``plain``: the prompt, decoded with the plan's method (``ServingNode.decode``);
- ``oneshot``: one-shot RAG, the top passages of a knowledge base put before the prompt (and,
  for a method that copies references, copied from), then a plain decode;
- ``ralm``: RaLMSeq / RaLMSpec, re-retrieving every few tokens (``specops.serving.ralm.loop``), decoding
  between retrievals with the plan's method;
- ``knnlm``: kNN-LM over a datastore of the target's hidden states (``specops.serving.ralm.knnlm.decode``).

The serving node (``specops.serving.fleet.node.ServingNode``, the ``node`` each runner takes) dispatches
once, ``mode_spec(plan.mode).run(node, plan, on_step, pool)``,
and then hands the result to the stream logger itself, in one place for every mode. A runner
calls only the node's members that :class:`~specops.serving.served.ModeHost` lists (typed; the
modes import no node), and the node imports the modes: the modes sit a floor below the fleet. Adding
a mode is one :class:`ModeSpec` here (its runner, its metrics, whether it feeds the trainer)
and the field of the request that selects it (``specops.serving.http.server.ServingState.plan``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from specops.serving.engine.types import GenerationResult
from specops.serving.metrics import count_knnlm, count_retrieval
from specops.serving.plan import DecodePlan
from specops.serving.served import Decoded, ModeHost, OnStep, ServedResult

__all__ = ["MODES", "Decoded", "ModeHost", "ModeSpec", "ServedResult", "mode_of", "mode_spec"]


@dataclass(frozen=True)
class ModeSpec:
    """One decoding mode."""

    name: str
    description: str
    run: Callable[[ModeHost, DecodePlan, OnStep, object], Decoded]
    """Decode ``plan`` on the node: ``run(node, plan, on_step, pool)`` (``pool``: RaLMSpec's
    verification threads). It returns the served result and what the stream logger gets."""
    count: Callable[[dict | None], None] = lambda block: None
    """The mode's own metrics, from the response's ``retrieval`` (or ``knnlm``) block."""


def _plain(node: ModeHost, plan: DecodePlan, on_step: OnStep, pool) -> Decoded:
    return node.decode(plan, plan.prompt_ids, on_step=on_step)


def _passages(knowledge) -> Callable[[list[int]], list[str]]:
    return lambda ids: [p.text for p in knowledge.passages(ids)]


def _oneshot(node: ModeHost, plan: DecodePlan, on_step: OnStep, pool) -> Decoded:
    """The top ``passages`` of the knowledge base for the prompt go before it
    (``specops.serving.ralm.oneshot.oneshot_context``), then a plain decode; a method that copies
    references also copies from them (``retrieved``). The ``retrieval`` block names them."""
    from specops.serving.ralm.oneshot import oneshot_context

    ret = plan.retrieval
    kb, knowledge = ret.kb, ret.kb.artifact
    shot = oneshot_context(
        knowledge.retriever(ret.retriever), _passages(knowledge), node.pair.tokenizer, list(plan.prompt_ids), ret.cfg
    )
    decoded = node.decode(
        plan,
        shot.context_ids,
        on_step=on_step,
        context_spans=shot.spans,
        retrieved=shot.passage_tokens if plan.spec.copies_references else (),
    )
    served = decoded.served
    cited = [{"id": p.id, "title": p.title} for p in knowledge.passages(shot.passage_ids)]
    block = {
        "kb": kb.name,
        "kb_version": kb.version,
        "retriever": ret.retriever,
        "mode": "oneshot",
        "passages": cited,
        "kb_calls": 1,
        "kb_queries": 1,
        "speculations": 0,
        "mismatches": 0,
        "context_tokens": len(shot.context_ids) - len(plan.prompt_ids),
        "time_s": {
            "embed": 0.0,
            "cache": 0.0,
            "kb_wait": round(shot.search_s, 6),
            "generate": round(served.result.stats.time_s.get("total", 0.0), 6),
            "async_overlap": 0.0,
        },
    }
    return replace(decoded, served=replace(served, versions={**served.versions, "kb": kb.version}, retrieval=block))


def _ralm(node: ModeHost, plan: DecodePlan, on_step: OnStep, pool) -> Decoded:
    """RaLMSeq or RaLMSpec over the plan's knowledge base, decoding between retrievals with the
    plan's method and the cluster's current draft. ``on_step(final)`` gets verified output only."""
    from specops.serving.engine.types import RequestStats
    from specops.serving.proposers.catalogue import ProposerResources
    from specops.serving.ralm.loop import Drafting, RalmGenerator

    ret = plan.retrieval
    started_at = time.time()
    handle, pair = node.draft_pair(plan.cluster)
    engine = node.engine(pair, logged=False)
    versions = {"draft": handle.version, "kb": ret.kb.version}
    knowledge = ret.kb.artifact
    resources = ProposerResources(pair=pair, cluster=plan.cluster, versions=versions)
    gen = RalmGenerator(
        engine,
        knowledge.retriever(ret.retriever),
        _passages(knowledge),
        pair.tokenizer,
        ret.cfg,
        drafting=Drafting(lambda: plan.proposer(resources), plan.k),
        pool=pool,
        concurrency=node.decoding,
    )
    with node.batched():
        out = gen.generate(list(plan.prompt_ids), plan.params, on_final=on_step)
    stats = RequestStats(
        method=plan.method,
        num_prompt_tokens=len(plan.prompt_ids),
        num_generated=len(out.token_ids),
        num_drafted=out.num_drafted,
        num_accepted=out.num_accepted,
        num_target_forwards=out.num_target_forwards,
        finish_reason=out.finish_reason,
    )
    stats.time_s["total"] = out.stats.time_s["total"]
    result = GenerationResult(token_ids=out.token_ids, stats=stats, text=out.text)
    if out.num_drafted:
        node.record(plan, handle, versions, stats)
    used = list(dict.fromkeys(out.passages))  # in order of first use
    cited = [{"id": p.id, "title": p.title} for p in knowledge.passages(used)]
    block = {
        "kb": ret.kb.name,
        "kb_version": ret.kb.version,
        "retriever": ret.retriever,
        "passages": cited,
        "interval_passages": list(out.passages),
        **out.stats.to_dict(),
    }
    served = ServedResult(
        plan.request_id, plan.cluster, handle.model_name, handle.version, result, started_at, versions, 0, block
    )
    # the finished generation feeds the trainer like any other (the draft that served it named)
    return Decoded(served, plan.prompt_ids, node.meta(plan, handle, {}))


def _knnlm(node: ModeHost, plan: DecodePlan, on_step: OnStep, pool) -> Decoded:
    """kNN-LM over the plan's datastore: baseline or speculative, the same output. It drafts
    nothing and is not logged for the trainer (no draft served it)."""
    from specops.serving.engine.types import RequestStats
    from specops.serving.ralm.knnlm.decode import KnnLM

    knn, store, pair = plan.knnlm.cfg, plan.knnlm.store, node.pair
    started_at = time.time()
    out = KnnLM(pair.target, store.artifact, knn, eos_token_ids=pair.eos_token_ids, tokenizer=pair.tokenizer).generate(
        list(plan.prompt_ids), plan.params, on_final=on_step
    )
    reason = "eos" if out.finish_reason == "stop" else out.finish_reason
    stats = RequestStats(
        method=plan.method,
        num_prompt_tokens=len(plan.prompt_ids),
        num_generated=len(out.token_ids),
        finish_reason=reason,
    )
    stats.time_s["total"] = out.stats.total_s
    result = GenerationResult(token_ids=out.token_ids, stats=stats, text=out.text)
    block = {"datastore": store.name, "version": store.version, "lambda": knn.lam, **out.stats.to_dict()}
    served = ServedResult(plan.request_id, plan.cluster, "", "", result, started_at, {"knnlm": store.version}, 0, block)
    return Decoded(served)


MODES: dict[str, ModeSpec] = {
    mode.name: mode
    for mode in (
        ModeSpec("plain", "decode the prompt with the request's method", _plain),
        ModeSpec(
            "oneshot",
            "one-shot RAG: retrieved passages before the prompt, then a plain decode",
            _oneshot,
            count=count_retrieval,
        ),
        ModeSpec(
            "ralm",
            "RaLMSeq / RaLMSpec: retrieve every few tokens, decode between retrievals",
            _ralm,
            count=count_retrieval,
        ),
        ModeSpec(
            "knnlm",
            "kNN-LM: the target's next-token distribution mixed with its datastore neighbours'",
            _knnlm,
            count=count_knnlm,
        ),
    )
}


def mode_spec(name: str) -> ModeSpec:
    """The mode ``name`` (an internal name: the HTTP layer chose it, so an unknown one is a bug)."""
    assert name in MODES, f"unknown decoding mode {name!r}"
    return MODES[name]


def mode_of(retrieval_mode: str | None, knnlm: bool) -> str:
    """The mode a request selects: its ``knnlm`` block, else its ``retrieval.mode``, else plain."""
    if knnlm:
        return "knnlm"
    if retrieval_mode is None:
        return "plain"
    return "oneshot" if retrieval_mode == "oneshot" else "ralm"
