"""The body of a completion or chat response (``specops.serving.http.api`` sends it): its choices (text,
log-probabilities, finish reason, token ids), usage, and the ``speculation`` block, summed over the
choices of an ``n`` > 1 request, whose ``best_of`` keeps the most probable."""

from __future__ import annotations

from specops.serving.engine.types import token_alpha
from specops.serving.http import logprobs as logprobs_fmt
from specops.serving.http.job import Job
from specops.serving.proposers.catalogue import CATALOGUE

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
"""Engine finish reasons as OpenAI names them."""


SUMMED = ("drafted", "accepted", "rejected_steps", "target_forwards")
"""Counts of the ``speculation`` block summed over a request's choices (``n`` > 1)."""


def speculation_block(job: Job, served) -> dict:
    """One choice's ``speculation`` block: its method, cluster and versions, its counts and the
    method's own block (LLMA's copies, ``auto``'s choices)."""
    plan, st = job.plan, served.result.stats
    # the artifacts of the method, or of the methods it decoded with (auto's steps)
    artifacts = {CATALOGUE[m].artifact for m in plan.spec.split(st) if m in CATALOGUE}
    speculation = {
        "method": st.method,
        "k": plan.k,
        "cluster": plan.cluster,
        "cluster_source": plan.cluster_source,
        "router_version": plan.router_version or None,
        "draft_model": served.draft_model if "draft" in artifacts else None,
        "draft_version": served.draft_version if "draft" in artifacts else None,
        "datastore_version": served.versions.get("datastore") if "datastore" in artifacts else None,
        "n_drafts": served.n_drafts or None,  # the rows drafted: asked for, or the datastore's measured shape
        "drafted": st.num_drafted,
        "accepted": st.num_accepted,
        "acceptance_rate": round(st.acceptance_rate, 4),
        "rejected_steps": st.num_rejected_steps,
        "alpha_token": round(st.alpha_token, 4),
        "target_forwards": st.num_target_forwards,
        "tokens_per_target_forward": round(st.tokens_per_target_forward, 4),
        "decode_s": round(st.time_s.get("total", 0.0), 4),
    }
    if served.engine:  # decoded by vLLM: its own per-request counts, or recomputed (specops.serving.vllm.replay)
        speculation.update(engine=served.engine, counts_source=served.counts_source or None)
        if st.method == "target":  # a target-only server drafts nothing: there is no α to report
            speculation.update(drafted=None, accepted=None, acceptance_rate=None, rejected_steps=None)
            speculation.update(alpha_token=None)
    block = plan.spec.stats_block(st)  # the method's own: LLMA's copies, auto's choices
    if block:
        speculation[plan.spec.name] = block
    if served.retrieval is not None and "kb" in served.versions:
        speculation["kb_version"] = served.versions.get("kb")
    if served.retrieval is not None and "knnlm" in served.versions:
        speculation["knnlm_version"] = served.versions.get("knnlm")
    return speculation


def merged(blocks: list[dict]) -> dict:
    """The request's ``speculation`` block over several choices: the first's, its counts summed
    over all and the rates recomputed from the sums, each choice's own under ``choices``."""
    out = dict(blocks[0])
    for key in SUMMED:
        vals = [b.get(key) for b in blocks]
        out[key] = None if any(v is None for v in vals) else sum(vals)
    if out["drafted"] is not None:
        out["acceptance_rate"] = round(out["accepted"] / out["drafted"], 4) if out["drafted"] else 0.0
        out["alpha_token"] = round(token_alpha(out["accepted"], out["rejected_steps"]), 4)
    out["decode_s"] = round(max(b["decode_s"] for b in blocks), 4)
    out["choices"] = [
        {"index": i, **{k: b.get(k) for k in ("method", "drafted", "accepted", "alpha_token", "decode_s")}}
        for i, b in enumerate(blocks)
    ]
    return out


def choice_body(job: Job, served, *, chat: bool, tokenizer, index: int) -> dict:
    """One choice of the response: its text (the prompt first with ``echo``), log-probabilities
    when asked for (the tokens behind the text: a stop sequence cuts them too), finish reason and
    token ids (``return_token_ids``)."""
    plan, st = job.plan, served.result.stats
    finish = "length" if job.score_only else "stop" if job.stopped else FINISH.get(st.finish_reason, st.finish_reason)
    logprobs = None
    if job.report_logprobs:
        lps = served.result.logprobs or []
        if job.stopped:
            lps = lps[: logprobs_fmt.covered(tokenizer, job.output_ids, len(job.text))]
        if job.score_only:
            lps = []
        items = logprobs_fmt.entries(tokenizer, [*(job.prompt_logprobs or []), *lps])
        logprobs = (
            logprobs_fmt.chat_shape(items) if chat else logprobs_fmt.completion_shape(items, top=plan.params.logprobs)
        )
    if chat:
        message = {"role": "assistant", "content": job.text}
        if job.tool_calls:  # the calls parsed out (specops.serving.http.tools); content: what was outside them
            message.update(content=job.text if job.text.strip() else None, tool_calls=job.tool_calls)
            finish = "tool_calls" if finish == "stop" else finish
        choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
    else:
        text = (plan.prompt_text or tokenizer.decode(list(plan.prompt_ids))) + job.text if job.echo else job.text
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if job.token_ids:
        choice.update(prompt_token_ids=list(plan.prompt_ids), token_ids=list(job.output_ids))
    return choice


def cumulative_logprob(served) -> float:
    """Σ log p of a choice's tokens under the target (raw): how ``best_of`` ranks its choices."""
    return sum(x.logprob for x in served.result.logprobs or () if x.logprob is not None)


def response_body(model: str, jobs: list[Job], served: list, *, chat: bool, tokenizer=None, n: int = 1) -> dict:
    """The response to one request: its ``n`` choices (with ``best_of`` > ``n``, the ``n`` of the
    highest cumulative log-probability, best first), usage over every choice decoded, the
    ``speculation`` block (summed over the choices when there are several)."""
    order = list(range(len(jobs)))
    if len(jobs) > n:
        order = sorted(order, key=lambda i: -cumulative_logprob(served[i]))[:n]
    job = jobs[0]
    generated = sum(0 if j.score_only else s.result.stats.num_generated for j, s in zip(jobs, served, strict=True))
    prompt_tokens = len(job.plan.prompt_ids)
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": generated,  # every choice decoded (best_of's too), as OpenAI bills them
        "total_tokens": prompt_tokens + generated,
    }
    blocks = [speculation_block(jobs[i], served[i]) for i in order]
    speculation = blocks[0] if len(blocks) == 1 else merged(blocks)
    choices = [choice_body(jobs[i], served[i], chat=chat, tokenizer=tokenizer, index=k) for k, i in enumerate(order)]
    obj, rid = ("chat.completion", "chatcmpl-") if chat else ("text_completion", "cmpl-")
    body = {
        "id": rid + job.public_id,
        "object": obj,
        "created": job.created,
        "model": model,
        "choices": choices,
        "usage": usage,
        "speculation": speculation,
    }
    first = served[order[0]]
    if first.retrieval is not None:
        body["knnlm" if "knnlm" in first.versions else "retrieval"] = first.retrieval
    return body
