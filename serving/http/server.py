"""The HTTP side of one replica: a request's validation into a plan, its admission slot, its
decode on a worker thread, streaming, stop sequences and deadlines.

:class:`ServingState` holds the replica (``specops.serving.replica.Replica``: the components, loaded in
the background) and what HTTP needs around it: admission (``specops.serving.http.admission``) and
the decode workers. A request goes:

1. :meth:`ServingState.plan` validates the body into one immutable
   :class:`~specops.serving.plan.DecodePlan`: tokenized, bound-checked, routed, the method looked up and
   its resources checked once, the mode chosen, the retrieval or kNN-LM artifact resolved
   (errors here are the caller's 4xx);
2. :meth:`ServingState.run` decodes it on a worker thread (``Replica.decode``), streaming text
   deltas through ``Job.on_delta`` and ending early on a stop sequence, a client that went
   away, or the request deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specops.core import limits
from specops.core.errors import (
    ForbiddenError,
    InvalidRequestError,
    PromptTooLongError,
    RequestTimeoutError,
    RequestTooLargeError,
    echo,
)
from specops.serving.engine import grammar, processors
from specops.serving.engine.types import SamplingParams
from specops.serving.fleet import planner
from specops.serving.http.admission import Admission
from specops.serving.http.config import ServeConfig
from specops.serving.http.job import (
    ClientGone,
    Job,
    delta_logprobs,
    find_stop,
    prompt_logprobs,
    send_echo,
    split_tools,
    streamable,
)
from specops.serving.http.schema import MAX_N
from specops.serving.http.tenancy import ANONYMOUS, Tenant
from specops.serving.metrics import CANCELLED, READY
from specops.serving.modes import mode_of
from specops.serving.plan import DecodePlan, KnnPlan, RetrievalPlan
from specops.serving.proposers.catalogue import CATALOGUE, MethodSpec
from specops.serving.replica import READ_THROUGH, Replica

__all__ = ["ClientGone", "Job", "ServingState"]

log = logging.getLogger(__name__)


class ServingState:
    """One replica behind the API: the :class:`~specops.serving.replica.Replica` it holds (``replica``),
    admission and the decode workers. ``start_loading`` returns at once; ``ready`` tells when done."""

    def __init__(
        self,
        cfg: ServeConfig,
        *,
        target_dir: Path,
        draft_dir: Path,
        cache_dir: Path,
        registry_factory: Callable[[], object | None] = lambda: None,
        stream_cfg=None,
    ) -> None:
        self.cfg = cfg
        adm = cfg.admission
        self.admission = Admission(adm.max_concurrency, adm.max_queue, adm.queue_timeout_s)
        self.executor = ThreadPoolExecutor(adm.max_concurrency, thread_name_prefix="decode")
        self.choice_pool = ThreadPoolExecutor(adm.max_concurrency * (MAX_N - 1), thread_name_prefix="choice")
        """Decodes a request's choices after its first (``n``, ``best_of``), beside the decode workers."""
        self.draining = threading.Event()
        """Set when shutdown starts: /readyz says 503 and new requests get 503 while in-flight ones finish."""
        self._running: dict[int, Job] = {}
        self._running_lock = threading.Lock()
        self.replica = Replica(
            cfg.replica(),
            target_dir=target_dir,
            draft_dir=draft_dir,
            cache_dir=cache_dir,
            registry_factory=registry_factory,
            stream_cfg=stream_cfg,
            load_snapshot=self.admission.snapshot,
        )

    def __getattr__(self, name: str):
        if name in READ_THROUGH and "replica" in self.__dict__:  # state.pair is state.replica.pair
            return getattr(self.replica, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def drain(self) -> None:
        """Stop admitting (``/readyz`` 503, new requests 503); what runs or waits for a worker goes on."""
        if self.draining.is_set():
            return
        self.draining.set()
        READY.set(0)
        snap = self.admission.snapshot()
        log.info(
            "draining: no new requests; %d running and %d waiting finish first (up to shutdown_timeout_s=%gs)",
            snap.running,
            snap.waiting,
            self.cfg.admission.shutdown_timeout_s,
        )

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop taking work, stop what still decodes, flush the stream (accepted records are not lost).

        The server calls this after its drain: whatever still decodes then outlived ``shutdown_timeout_s``
        and is stopped at its next step (counted as ``specops_requests_cancelled_total{reason="shutdown"}``)."""
        self.drain()
        self.replica.ready.clear()
        with self._running_lock:
            left = list(self._running.values())
        for job in left:
            job.shut_down = True
            job.cancel.set()
        if left:
            log.warning("stopping %d request(s) still decoding after the drain", len(left))
        self.executor.shutdown(wait=True, cancel_futures=False)
        self.replica.close(timeout_s)

    def status(self) -> dict:
        """``/readyz``'s body: readiness and load, no cluster names (the probe needs no key)."""
        snap = self.admission.snapshot()
        out = {
            "ready": self.replica.ready.is_set() and not self.draining.is_set(),
            "draining": self.draining.is_set(),
            "step": self.replica.loading_step,
            "running": snap.running,
            "waiting": snap.waiting,
            "load": round(snap.load, 3),
        }
        if self.replica.load_error:
            out["error"] = self.replica.load_error
        return out

    # ------------------------------------------------------------ 1. the plan
    def plan(
        self,
        prompt: str | list[int],
        req,
        *,
        chat: bool = False,
        tenant: Tenant = ANONYMOUS,
        request_id: str | None = None,
    ) -> DecodePlan:
        """Validate one request (``req``: the parsed ``specops.serving.http.schema`` body; ``prompt``: its
        prompt, the rendered chat for chat) into its plan; raises the caller's 4xx errors.
        ``tenant``: who sent it (``specops.serving.http.tenancy``; without keys, the one anonymous tenant)."""
        cfg, tok = self.cfg, self.pair.tokenizer
        sp = req.speculation
        method, k = (sp.method, sp.k) if sp else (None, None)
        n_drafts, options = (sp.n_drafts, sp.options) if sp else (None, {})
        retrieval, knnlm, references, cluster = req.retrieval, req.knnlm, req.references, req.cluster
        params = self._sampling(req)
        if cluster is not None and not tenant.may_route:
            raise ForbiddenError(
                "this API key may not choose its cluster: leave `cluster` out and the router "
                "decides (the server's route_tenants lists the tenants that may)",
                "cluster",
            )
        ids, text = self._prompt_ids(prompt, "messages" if chat else "prompt")
        if params.max_new_tokens > cfg.admission.max_tokens_limit:
            raise InvalidRequestError(
                f"max_tokens is {echo(params.max_new_tokens)}; this server allows at most {cfg.admission.max_tokens_limit}",
                "max_tokens",
            )
        if k is not None and k > cfg.admission.max_k:
            raise InvalidRequestError(
                f"speculation.k is {echo(k)}; this server allows at most {cfg.admission.max_k}", "speculation.k"
            )
        if n_drafts is not None and n_drafts > cfg.admission.max_n_drafts:
            raise InvalidRequestError(
                f"speculation.n_drafts is {echo(n_drafts)}; this server allows at most {cfg.admission.max_n_drafts}",
                "speculation.n_drafts",
            )
        method = self._mode_limits(params, req, method, k, n_drafts, options)
        default = self.node.fixed_method or cfg.engine.default_method  # vLLM: the method it runs
        choice = planner.choose_method(method, k, n_drafts, options, default=default, max_k=cfg.admission.max_k)
        spec = choice.spec
        turns = [m.text for m in req.messages[:-1]] if chat else None
        refs = self._references(references, turns if spec.copies_references else None, spec)
        where = planner.route(
            cluster,
            lambda: text if text is not None else tok.decode(ids),
            known=self.known_clusters,
            router=self.router,
            default_cluster=cfg.fleet.default_cluster,
        )
        planner.check_resources(spec, self.pair, where.cluster, self.datastores)  # the one check
        rag = self._retrieval(retrieval, spec)
        if rag is not None and rag.cfg.mode != "oneshot" and references:
            raise InvalidRequestError(
                f"retrieval.mode {rag.cfg.mode!r} re-retrieves as it decodes and copies from its "
                "passages through the context; references go with retrieval.mode 'oneshot' "
                "or without retrieval",
                "references",
            )
        knn = self._knnlm(knnlm, retrieval)
        where.count()
        scope = tenant.id if cfg.retrieval.session_sharing == "tenant" else ""  # "shared": the cluster's one scope
        plan = DecodePlan(
            tuple(ids),
            params,
            spec,
            choice.k,
            choice.options,
            mode=mode_of(retrieval and retrieval.mode, knn is not None),
            cluster=where.cluster,
            cluster_source=where.source,
            router_version=where.router_version,
            n_drafts=choice.n_drafts,
            references=refs,
            retrieval=rag,
            knnlm=knn,
            prompt_text=text or "",
            stop=tuple(req.stop or ()),
            tenant=tenant.id,
            session_scope=scope,
            # scoped by its tenant: two tenants' records never share an id (X-Request-Id has no "/")
            **({"request_id": f"{tenant.id}/{request_id}", "client_request_id": request_id} if request_id else {}),
        )
        self.node.check_plan(  # the engine's own limits (vLLM: no retrieval loop, its own speculation)
            plan,
            explicit_method=sp is not None and sp.method is not None,
            explicit_k=sp is not None and sp.k is not None,
        )
        if (
            ignored := req.ignored()
        ):  # the response's header names them too (specops.serving.http.schema.IGNORED_FIELDS)
            log.info("request %s: ignored %s (they do not change the output)", plan.request_id, ", ".join(ignored))
        return plan

    def _sampling(self, req) -> SamplingParams:
        """The request's sampling and limits (OpenAI's defaults where it says nothing); 400 naming the field."""
        cfg, tok = self.cfg, self.pair.tokenizer
        # OpenAI's defaults: temperature 1, top_p 1 (send temperature=0 for greedy decoding)
        params = SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=req.top_p if req.top_p is not None else 1.0,
            max_new_tokens=max(1, req.max_tokens if req.max_tokens is not None else cfg.admission.default_max_tokens),
            seed=req.seed,
            # vLLM's "off" values (-1, 0) and a top_k past the vocabulary are 0: off
            top_k=req.top_k if req.top_k is not None and 0 < req.top_k < self.pair.vocab_size else 0,
            min_p=req.min_p or 0.0,
            logprobs=req.logprobs_n(),
            prompt_logprobs=req.logprobs_n() if getattr(req, "echo", False) else None,
            logprobs_mode="processed" if req.logprobs_mode == "processed_logprobs" else "raw",
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty if req.repetition_penalty is not None else 1.0,
            logit_bias=self._logit_bias(req.logit_bias),
            min_tokens=req.min_tokens or 0,
            ignore_eos=req.ignore_eos,
            grammar=req.grammar(tok),
        )
        if params.grammar is not None:  # a 400 naming the field before anything streams
            grammar.for_tokenizer(tok, self.pair.vocab_size, self.pair.eos_token_ids).check(params.grammar)
        if params.min_tokens > params.max_new_tokens:
            raise InvalidRequestError(
                f"min_tokens ({echo(params.min_tokens)}) is more than max_tokens ({echo(params.max_new_tokens)})",
                "min_tokens",
            )
        return params

    def _mode_limits(self, params: SamplingParams, req, method, k, n_drafts, options) -> str | None:
        """What kNN-LM and the retrieval loop cannot honour (400 naming the field); the method then (kNN-LM: target)."""
        retrieval, knnlm, references = req.retrieval, req.knnlm, req.references
        looping = retrieval is not None and retrieval.mode != "oneshot"
        if (knnlm is not None or looping) and (processors.adjusts(params) or params.grammar is not None):
            field = params.grammar.field if params.grammar is not None else processors.adjusting_field(params)
            why = (
                "kNN-LM mixes the target with its datastore and does not apply them"
                if knnlm is not None
                else "the retrieval loop restarts its context at each retrieval and would not count the output "
                "before it (retrieval.mode 'oneshot' applies them)"
            )
            raise InvalidRequestError(
                f"{field} with {'knnlm' if knnlm is not None else 'retrieval.mode ' + repr(retrieval.mode)}: {why}; "
                "leave it out",
                field,
            )
        if params.logprobs is not None and (knnlm is not None or looping):
            path = "knnlm" if knnlm is not None else "retrieval.mode"
            raise InvalidRequestError(
                f"logprobs with {path}: not supported yet; kNN-LM mixes the target with its datastore and the "
                "retrieval loop withdraws tokens, so neither reports per-token log-probabilities (retrieval.mode "
                "'oneshot' does); leave logprobs out",
                "logprobs",
            )
        if knnlm is not None:
            _refuse_ignored(
                "knnlm",
                "kNN-LM decodes with the target and its datastore alone and drafts nothing (its "
                "own speculation is knnlm.speculative and knnlm.speculation_stride; knnlm.k counts its "
                "neighbours)",
                method=method,
                k=k,
                n_drafts=n_drafts,
                options=options,
                references=references,
            )
            method = "target"
        elif retrieval is not None and retrieval.mode != "oneshot":
            _refuse_ignored(
                f"retrieval.mode {retrieval.mode!r}",
                "the retrieval loop drafts one chain per step with "
                "the method's default settings (retrieval.mode 'oneshot' takes them)",
                n_drafts=n_drafts,
                options=options,
            )
        return method

    def _logit_bias(self, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        """OpenAI's ``logit_bias`` (token id strings) as ``(id, bias)`` pairs; 400 naming a key that
        is not a token id of this model."""
        out = []
        for key, value in (bias or {}).items():
            if not key.isdigit() or int(key) >= self.pair.vocab_size:
                raise InvalidRequestError(
                    f"logit_bias: {echo(key)} is not a token id of this model (0..{self.pair.vocab_size - 1})",
                    "logit_bias",
                )
            out.append((int(key), float(value)))
        return tuple(out)

    def _prompt_ids(self, prompt: str | list[int], field: str = "prompt") -> tuple[list[int], str | None]:
        """The prompt's token ids (and its text, when it came as text), within the server's limits; errors
        name ``field``, what the client sent (``messages`` for a chat, whose rendered text is ``prompt``)."""
        cfg, tok = self.cfg.admission, self.pair.tokenizer
        limit = min(cfg.max_prompt_tokens, self.context_size - 1)  # the one limit enforced, and the one stated
        what = "prompt" if field == "prompt" else f"{field} (rendered)"
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError(f"{what} is empty: give at least one character", field)
            if len(prompt) > limit * 32:  # refuse before tokenizing megabytes
                raise PromptTooLongError(f"{what} has {len(prompt)} characters; the limit is {limit} tokens", field)
            try:
                ids = tok(prompt, add_special_tokens=False, verbose=False)["input_ids"]
            except (TypeError, ValueError) as exc:  # text the tokenizer refuses is the caller's to fix
                raise InvalidRequestError(
                    f"{what} cannot be tokenized ({type(exc).__name__}): send valid Unicode text", field
                ) from None
            text = prompt
        else:
            ids, text = list(prompt), None
        if not ids and text is not None:
            raise InvalidRequestError(f"{what} tokenizes to nothing: give at least one token", field)
        limits.check_prompt(
            ids, vocab_size=self.pair.vocab_size, context=self.context_size, limit=cfg.max_prompt_tokens, field=field
        )
        return ids, text

    def _references(
        self, texts: list[str] | None, turns: list[str] | None, spec: MethodSpec
    ) -> tuple[tuple[int, ...], ...]:
        """The references to copy, tokenized: the request's texts, then the earlier chat turns
        (400 when the method does not copy, 413 beyond the server's limits, naming the field)."""
        cfg, tok = self.cfg.admission, self.pair.tokenizer
        if texts and not spec.copies_references:
            copiers = " or ".join(repr(n) for n, s in CATALOGUE.items() if s.copies_references)
            raise InvalidRequestError(
                f"references are copied by speculation.method {copiers} only; method "
                f"{spec.name!r} ignores them: set speculation.method to {copiers}, or "
                "leave references out",
                "references",
            )
        texts = list(texts or [])
        if len(texts) > cfg.max_references:
            raise RequestTooLargeError(
                f"references has {len(texts)} texts; this server allows at most {cfg.max_references}", "references"
            )
        budget, out = cfg.max_reference_tokens, []
        for i, text in enumerate(texts + [t for t in (turns or []) if t]):
            where = f"references[{i}]" if i < len(texts) else "messages"
            if i < len(texts) and not text:
                raise InvalidRequestError(f"{where} is empty: give some text or leave it out", where)
            if len(text) > budget * 32 + 32:  # refuse before tokenizing megabytes
                ids = None
            else:
                try:
                    ids = tok(text, add_special_tokens=False, verbose=False)["input_ids"]
                except (TypeError, ValueError) as exc:
                    raise InvalidRequestError(
                        f"{where} cannot be tokenized ({type(exc).__name__}): send valid Unicode text", where
                    ) from None
            if ids is None or len(ids) > budget:
                if i >= len(texts):
                    break  # earlier turns beyond the budget are not copied from; the request is still served
                raise RequestTooLargeError(
                    f"references hold more than {cfg.max_reference_tokens} tokens together "
                    f"(at {where}); send fewer or shorter texts",
                    "references",
                )
            budget -= len(ids)
            out.append(tuple(ids))
        return tuple(out)

    def _knnlm(self, knnlm, retrieval) -> KnnPlan | None:
        """The request's kNN-LM config and the datastore it names (4xx naming the field)."""
        if knnlm is None:
            return None
        from specops.serving.ralm.knnlm.decode import KnnConfig

        if retrieval is not None:
            raise InvalidRequestError("send one of retrieval and knnlm, not both", "knnlm")
        cfg = KnnConfig(
            mode="speculative" if knnlm.speculative else "baseline",
            k=knnlm.k,
            lam=knnlm.lam,
            speculation_stride=knnlm.speculation_stride,
        )
        if self.knnlms is None:
            raise InvalidRequestError("knnlm: this server has no kNN-LM datastores", "knnlm.datastore")
        return KnnPlan(cfg, self.knnlms.get(knnlm.datastore))

    def _retrieval(self, retrieval, spec: MethodSpec) -> RetrievalPlan | None:
        """The request's retrieval loop: its config, the KB it names and the retriever (4xx naming the field)."""
        if retrieval is None:
            return None
        from specops.serving.ralm.types import RalmConfig

        if retrieval.mode != "oneshot" and not spec.retrieval_loop:
            usable = [n for n, s in CATALOGUE.items() if s.retrieval_loop and s.parts is None]
            usable = ", ".join(usable[:-1]) + " or " + usable[-1]
            raise InvalidRequestError(
                f"speculation.method {spec.name!r} drafts from the cluster's datastore, which "
                f"the retrieval loop does not support yet; use {usable}",
                "speculation.method",
            )
        ralm = RalmConfig(
            mode=retrieval.mode,
            interval=retrieval.stride,
            query_tokens=retrieval.query_tokens,
            speculation_stride=retrieval.speculation_stride,
            prefetch=retrieval.prefetch,
            asynchronous=retrieval.asynchronous,
            speculation_off=retrieval.speculation_off,
            reverify=retrieval.reverify,
            passages=retrieval.passages,
        )
        if self.kbs is None:
            raise InvalidRequestError("retrieval: this server has no knowledge bases", "retrieval.kb")
        kb = self.kbs.get(retrieval.kb)
        if retrieval.retriever not in kb.artifact.retrievers:
            raise InvalidRequestError(
                f"retrieval.retriever {retrieval.retriever!r} is not built for knowledge base "
                f"{retrieval.kb!r} (built: {', '.join(kb.artifact.retrievers)})",
                "retrieval.retriever",
            )
        return RetrievalPlan(ralm, kb, retrieval.retriever)

    # ------------------------------------------------------------ 2. the decode
    def abandon(self, job: Job) -> RequestTimeoutError:
        """The API's backstop for a decode that outlived ``request_timeout_s`` inside one step
        (the worker checks the deadline only between steps): mark ``job`` cancelled, so its
        worker stops at its next step if it ever reaches one, and return the 504 to answer now.
        The worker's admission slot comes back only when it returns."""
        job.abandoned = True
        job.cancel.set()
        CANCELLED.labels("timeout").inc()
        log.warning(
            "request %s is still decoding after request_timeout_s=%gs within one step; answered with the timeout",
            job.request_id,
            self.cfg.admission.request_timeout_s,
        )
        return RequestTimeoutError(f"request decoded for more than {self.cfg.admission.request_timeout_s:g}s")

    def run_many(self, jobs: list[Job]) -> list:
        """Decode a request's choices: the first on this (worker) thread, the others on the choice
        pool at the same time (the batcher batches their steps); one admission slot, given back
        when all are done. A choice that fails cancels the others (they share ``cancel``) and its
        error is the request's."""
        with self._running_lock:
            for job in jobs:
                self._running[id(job)] = job
        try:
            rest = [self.choice_pool.submit(self._run, job) for job in jobs[1:]]
            out, err = [], None
            for i, run in enumerate([lambda: self._run(jobs[0]), *(f.result for f in rest)]):
                try:
                    out.append(run())
                except BaseException as exc:  # noqa: BLE001 - re-raised below, once every choice ended
                    jobs[i].cancel.set()
                    err = err or exc
            if err is not None:
                raise err
            return out
        finally:
            with self._running_lock:
                for job in jobs:
                    self._running.pop(id(job), None)
            self.admission.release()

    def run(self, job: Job):
        """Decode ``job`` on this (worker) thread; always gives the admission slot back."""
        with self._running_lock:
            self._running[id(job)] = job
        try:
            return self._run(job)
        finally:
            with self._running_lock:
                self._running.pop(id(job), None)
            self.admission.release()

    def _run(self, job: Job):
        tok = self.replica.pair.tokenizer
        deadline = time.monotonic() + self.cfg.admission.request_timeout_s
        stops = list(job.plan.stop)

        def on_step(emitted: list[int]) -> bool:
            if job.cancel.is_set():
                if job.shut_down or (self.draining.is_set() and not job.abandoned):
                    CANCELLED.labels("shutdown").inc()  # the drain ran out of shutdown_timeout_s
                    log.warning(
                        "request %s stopped by the shutdown after %d tokens", job.request_id, len(job.output_ids)
                    )
                elif not job.abandoned:  # (an abandoned request was counted as a timeout)
                    CANCELLED.labels("client_gone").inc()
                raise ClientGone(job.request_id)
            if time.monotonic() > deadline:
                CANCELLED.labels("timeout").inc()
                raise RequestTimeoutError(f"request decoded for more than {self.cfg.admission.request_timeout_s:g}s")
            if job.echo and getattr(emitted, "prompt_logprobs", None) is not None:
                job.prompt_logprobs = prompt_logprobs(job, emitted.prompt_logprobs, emitted.context_len)
            send_echo(job, tok)
            if job.score_only:
                return True  # its token is not the client's: the prompt alone was asked for
            job.output_ids.extend(emitted)
            if getattr(emitted, "logprobs", None) is not None:  # specops.serving.engine.types.Emitted
                job.logprobs.extend(emitted.logprobs)
            if emitted and job.on_emit is not None:
                job.on_emit()
            if job.on_delta is None and not stops:
                return False  # nothing to stream or stop on: the text is decoded once, at the end
            text = tok.decode(job.output_ids, skip_special_tokens=True)
            stop_at = find_stop(text, stops)
            job.stopped = stop_at is not None
            job.text = streamable(job, text[:stop_at] if job.stopped else text, [] if job.stopped else stops)
            if job.on_delta is not None and len(job.text) > job.sent:
                job.on_delta(job.text[job.sent :], delta_logprobs(job, tok, whole=len(job.text) == len(text)))
                job.sent = len(job.text)
            return job.stopped

        served = self.replica.decode(job.plan, on_step)
        res = served.result
        if job.echo and job.prompt_logprobs is None and res.prompt_logprobs is not None:
            job.prompt_logprobs = prompt_logprobs(job, res.prompt_logprobs, res.stats.num_prompt_tokens)
        send_echo(job, tok)  # when no step handed tokens on
        if job.score_only:
            job.output_ids, job.logprobs, job.text = [], [], ""
            return served
        if job.stopped and job.tools is not None:  # what the stop sequence kept, its calls parsed
            text = tok.decode(job.output_ids, skip_special_tokens=True)
            job.text = split_tools(job, text[: find_stop(text, stops)])
        if not job.stopped:  # the whole output, the held-back tail included
            job.text = split_tools(job, tok.decode(served.result.token_ids, skip_special_tokens=True))
            if job.on_delta is not None and (len(job.text) > job.sent or job.sent_tokens < len(job.logprobs)):
                job.on_delta(job.text[job.sent :], delta_logprobs(job, tok, whole=True))
                job.sent = len(job.text)
        return served


def _refuse_ignored(
    path: str,
    why: str,
    *,
    method: str | None = None,
    k: int | None = None,
    n_drafts: int | None = None,
    options: dict | None = None,
    references: list[str] | None = None,
) -> None:
    """A 400 naming the first field ``path`` (kNN-LM, a retrieval loop) would silently ignore; ``why`` says why."""
    drafts = method is not None and (method not in CATALOGUE or CATALOGUE[method].drafts)
    given = {
        "speculation.method": drafts,
        "speculation.k": k is not None,
        "speculation.n_drafts": n_drafts is not None,
        **{f"speculation.{name}": True for name in options or {}},  # the method's own options
        "references": bool(references),
    }
    for name, sent in given.items():
        if sent:
            raise InvalidRequestError(f"{name} does not apply to {path}: {why}; leave {name} out", name)
