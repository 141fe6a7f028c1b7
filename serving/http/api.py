"""The OpenAI-compatible HTTP API (FastAPI) over one :class:`~specops.serving.http.server.ServingState`.

Endpoints:

- ``POST /v1/completions`` and ``POST /v1/chat/completions``: OpenAI request and response
  shapes, ``stream=true`` as server-sent events ending in ``data: [DONE]``. Extensions:
  request fields ``speculation`` (``method``, ``k``) and ``cluster``; every response (the
  last chunk when streaming) carries a ``speculation`` block.
- ``GET /v1/policy``: the ``auto`` policy's state per cluster (acceptance estimates,
  decisions, the latest choice and its estimates, measured costs); admin tenants only.
- ``GET /v1/clusters``: the clusters served, the draft version of each, the router's
  version, and behind ``engine = "vllm"`` (admin tenants only) the vLLM servers, standbys and
  swaps; tenants that may route (or admin) only.
- ``GET /v1/models``; ``GET /healthz`` (liveness: 200 while loading, serving or draining, 503 once
  loading failed); ``GET /readyz`` (models loaded and not draining: 200, else 503 with the loading
  step or the error; no cluster names); ``GET /metrics`` (Prometheus).

Every request has a tenant (:mod:`specops.serving.http.tenancy`): the owner of its key, resolved by
:class:`~specops.serving.http.gate.Gate` and kept in the ASGI scope's state; its id goes with the request into
:meth:`ServingState.plan <specops.serving.http.server.ServingState.plan>`.

Every error is OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``, with
the status from :data:`specops.core.errors.HTTP_STATUS`. A request is refused before any work
when its body is too large (413), its key is missing (401) or wrong (403), or admission
is full (429, ``Retry-After``); then it is validated (400 naming the field to fix) and
only then queued for a decode worker. A body must arrive within ``body_timeout_s`` (408,
:mod:`specops.serving.http.read_timeouts`); :mod:`specops.serving.http.request_json` parses it, and a bug is a 500
of the same shape (uvicorn logs its traceback).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from specops.core.errors import (
    ForbiddenError,
    InvalidRequestError,
    ModelNotFoundError,
    NotReadyError,
    RequestTooLargeError,
    SpecOpsError,
    clip,
    echo,
    http_status,
)
from specops.core.models import render_chat
from specops.serving.engine.prefix import SharedPrefix
from specops.serving.http import logprobs as logprobs_fmt
from specops.serving.http import tools as tools_fmt
from specops.serving.http.errors import error_body
from specops.serving.http.gate import OPEN_PATHS, REQUEST_ID, Gate, error_response  # noqa: F401 (re-export)
from specops.serving.http.job import choice_plan
from specops.serving.http.latency import RequestTimer
from specops.serving.http.read_timeouts import BodyDeadline
from specops.serving.http.request_json import parse as parse_json
from specops.serving.http.responses import response_body
from specops.serving.http.schema import ChatCompletionRequest, CompletionRequest, FieldValueError
from specops.serving.http.server import ClientGone, Job, ServingState
from specops.serving.http.tenancy import ANONYMOUS, Tenant, Tenants

log = logging.getLogger(__name__)

POLICY_WAIT_S = 1.0
"""Longest ``GET /v1/policy`` waits for the ``auto`` policy's lock (a worker thread holds it) before a 503."""
TIMEOUT_GRACE_S = 1.0
"""The API's backstop answers a request ``request_timeout_s`` + this after it started when its decode
has not ended by then (a step that never returns: the worker only checks the deadline between steps)."""


def create_app(state: ServingState) -> FastAPI:
    """The API over ``state``; loading starts when the app starts (and ``state.close`` runs at shutdown)."""
    cfg = state.cfg

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start_loading()
        yield
        await asyncio.to_thread(state.close)

    app = FastAPI(
        title="specops",
        version="1",
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
        description="OpenAI-compatible completions with speculative decoding by drafts that learn online.",
    )
    app.state.serving = state
    tenants = Tenants.from_config(cfg.api)

    # ------------------------------------------------------------ gatekeeping, in order
    app.add_middleware(BodyDeadline, timeout_s=cfg.api.body_timeout_s)
    app.add_middleware(Gate, cfg=cfg.api, tenants=tenants)

    @app.exception_handler(SpecOpsError)
    async def _specops_error(request: Request, err: SpecOpsError):
        return error_response(err)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect):
        client = "{}:{}".format(*request.client) if request.client else "a client"
        log.info("%s went away while sending the body of %s %s", client, request.method, clip(request.url.path))
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request", for the metrics

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):  # uvicorn still logs the traceback: it is a bug
        return JSONResponse(
            error_body(500, f"internal error: {type(exc).__name__}; the server log has the details", "internal"),
            status_code=500,
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _validation_response(exc.errors())

    @app.exception_handler(404)
    async def _not_found(request: Request, exc):
        return JSONResponse(error_body(404, f"no route {request.method} {clip(request.url.path)}", "not_found"), 404)

    @app.exception_handler(405)
    async def _bad_method(request: Request, exc):
        return JSONResponse(
            error_body(405, f"{request.method} is not allowed on {clip(request.url.path)}", "method_not_allowed"), 405
        )

    # ------------------------------------------------------------ probes and metrics
    @app.get("/healthz")
    async def healthz():
        # liveness: up while loading, loaded or draining; 503 once loading failed, so the pod is restarted
        if state.load_error:
            return JSONResponse({"status": "failed", "error": state.load_error}, status_code=503)
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz():
        status = state.status()
        return JSONResponse(status, status_code=200 if status["ready"] else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/policy")
    async def policy(request: Request):
        if not _tenant(request).admin:  # every cluster's decisions: an operator's view
            raise ForbiddenError("GET /v1/policy is for admin tenants (the server's admin_tenants)")
        _ensure_ready(state)
        # off the event loop, and never waiting on the policy's lock for long (503 then)
        snap = await asyncio.to_thread(state.policy.snapshot, timeout_s=POLICY_WAIT_S)
        per_request = getattr(state.node, "request_policy", None)  # vLLM: auto chooses a server per request
        if per_request is not None:
            snap = {**snap, "vllm": await asyncio.to_thread(per_request.summary)}
        return snap

    @app.get("/v1/clusters")
    async def clusters(request: Request):
        tenant = _tenant(request)
        if not (tenant.may_route or tenant.admin):
            raise ForbiddenError(
                "GET /v1/clusters is for tenants that may send `cluster` (the server's route_tenants) or admin tenants"
            )
        _ensure_ready(state)
        body = state.clusters()
        if not tenant.admin:  # the vLLM servers (names, draft paths, swap history) are an operator's view
            body.pop("vllm", None)
        return body

    def _model_card() -> dict:
        return {"id": cfg.api.served_model_name, "object": "model", "created": 0, "owned_by": "specops"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):  # OpenAI clients' models.retrieve (a name with a "/" included)
        if model_id != cfg.api.served_model_name:
            return JSONResponse(
                error_body(
                    404,
                    f"the model {model_id!r} does not exist here; this server serves {cfg.api.served_model_name!r}",
                    "model_not_found",
                    param="model",
                ),
                404,
            )
        return _model_card()

    # ------------------------------------------------------------ completions
    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _parse(request, CompletionRequest)
        return await _serve(state, req, req.prompt, chat=False, request_id=_request_id(request), request=request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _parse(request, ChatCompletionRequest)
        prompt = await asyncio.to_thread(_render_chat, state, req)
        return await _serve(state, req, prompt, chat=True, request_id=_request_id(request), request=request)

    @app.get("/", response_class=PlainTextResponse)
    async def root():
        return "specops: OpenAI-compatible API at /v1 (see /docs); /healthz, /readyz, /metrics\n"

    return app


# ---------------------------------------------------------------- request helpers
def _tenant(request: Request) -> Tenant:
    """The request's tenant, as :class:`Gate` resolved it (every route that asks is behind the key check)."""
    tenant = request.scope.get("state", {}).get("tenant")
    assert isinstance(tenant, Tenant), "a route that needs a tenant is open without a key"
    return tenant


async def _parse(request: Request, model):
    limit = request.app.state.serving.cfg.api.max_body_bytes
    body = bytearray()
    async for chunk in request.stream():  # bounded even without a Content-Length header
        body += chunk
        if len(body) > limit:
            raise RequestTooLargeError(f"request body is over the limit of {limit} bytes")
    data = parse_json(bytes(body))  # a 400 naming the field for anything JSON, Unicode or nesting
    try:
        req = model.model_validate(data)
    except ValidationError as exc:
        raise _FirstValidationError(exc.errors()) from None
    req.unsupported()
    return req


class _FirstValidationError(InvalidRequestError):
    def __init__(self, errors: list) -> None:
        e = errors[0]
        loc = tuple(e.get("loc", ()))
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, FieldValueError):  # a model-level check: pydantic's location is the model's
            loc += tuple(cause.field.split("."))
        param = clip(".".join(str(p) for p in loc))
        msg = e.get("msg", "invalid value")
        if e.get("type") == "value_error" and isinstance(cause, ValueError):
            msg = str(cause)  # not pydantic's "Value error, ..."
        if e.get("type") == "extra_forbidden":
            msg = f"unrecognized request argument: {param}"
        elif e.get("type") == "missing":
            msg = f"missing required field: {param}"
        else:  # quote the value, clipped: a 500 KB stop string is not sent back
            scalar = "input" in e and (e["input"] is None or isinstance(e["input"], (str, int, float)))  # JSON's
            msg = (f"{param}: {msg}" if param else msg) + (f" (got {echo(e['input'])})" if scalar else "")
        more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
        super().__init__(msg + more, param or None)


def _validation_response(errors: list) -> JSONResponse:
    return error_response(_FirstValidationError(errors))


def _render_chat(state: ServingState, req: ChatCompletionRequest) -> str:
    _ensure_ready(state)
    tok = state.pair.tokenizer
    messages, extra = tools_fmt.messages_for(tok, [m.as_dict() for m in req.messages], req.tool_dicts())
    return render_chat(tok, messages, **extra)


def _ensure_ready(state: ServingState) -> None:
    if state.draining.is_set():
        raise NotReadyError("this replica is shutting down; send the request again (another replica takes it)")
    if not state.ready.is_set():
        why = f"failed to load: {state.load_error}" if state.load_error else f"loading ({state.loading_step})"
        raise NotReadyError(f"the server is not ready yet: {why}; poll /readyz")


def _request_id(request: Request) -> str | None:
    """The caller's ``X-Request-Id``, if it sent one: the response's id and ``X-Request-Id`` header
    carry it as sent; the logged records carry it under the tenant's id (``DecodePlan.request_id``)."""
    rid = request.headers.get("x-request-id")
    if rid is not None and not REQUEST_ID.fullmatch(rid):
        raise InvalidRequestError("X-Request-Id must be 1-128 characters of letters, digits and _.:-", "X-Request-Id")
    return rid


async def _cancel_on_disconnect(request: Request, future, job: Job, every_s: float = 0.25) -> None:
    """A non-streaming client that went away stops its decode at the next step (its slot comes back)."""
    while not future.done():
        if await request.is_disconnected():
            job.cancel.set()
            return
        await asyncio.sleep(every_s)


async def _serve(
    state: ServingState, req, prompt, *, chat: bool, request_id: str | None = None, request: Request | None = None
):
    cfg = state.cfg
    _ensure_ready(state)
    if req.model != cfg.api.served_model_name:
        raise ModelNotFoundError(
            f"model {echo(req.model)} is not served here; use {cfg.api.served_model_name!r}", "model"
        )
    tenant = _tenant(request) if request is not None else ANONYMOUS
    plan = await asyncio.to_thread(state.plan, prompt, req, chat=chat, tenant=tenant, request_id=request_id)
    echoed = bool(getattr(req, "echo", False))
    n = req.n
    best_of = getattr(req, "best_of", None) or n  # choices decoded; the n best returned (completions' best_of)
    cancel = threading.Event()  # one request: a client that goes away stops every choice
    prefix = SharedPrefix(wait_s=cfg.admission.request_timeout_s) if best_of > 1 else None  # choice 0 prefills for all
    jobs = [
        Job(
            choice_plan(plan, i, rank=best_of > n, prefix=prefix),
            token_ids=req.return_token_ids,
            echo=echoed,
            score_only=echoed and req.max_tokens == 0,
            index=i,
            cancel=cancel,
            report_logprobs=plan.params.logprobs is not None,
            tools=tools_fmt.format_for(state.pair.tokenizer) if chat and req.calls_tools() else None,
            parallel_tools=getattr(req, "parallel_tool_calls", None) is not False,
        )
        for i in range(best_of)
    ]
    job = jobs[0]
    arrived = request.scope.get("state", {}).get("arrived") if request is not None else None
    timer = RequestTimer(arrived or time.perf_counter(), plan.cluster, plan.method)
    headers = {"X-Request-Id": job.public_id, **req.ignored_header()}  # schema.IGNORED_FIELDS it sent, if any
    await state.admission.acquire()
    loop = asyncio.get_running_loop()
    run = (lambda: [state.run(job)]) if len(jobs) == 1 else (lambda: state.run_many(jobs))

    def abandon() -> SpecOpsError:  # one request's timeout, however many choices it decodes
        for j in jobs[1:]:
            j.abandoned = True
        return state.abandon(job)

    if not req.stream:
        job.on_emit = timer.tokens  # the client gets them with the response; the decode's steps time them
        future = loop.run_in_executor(state.executor, run)
        watch = asyncio.create_task(_cancel_on_disconnect(request, future, job)) if request is not None else None
        try:
            served = await asyncio.wait_for(asyncio.shield(future), cfg.admission.request_timeout_s + TIMEOUT_GRACE_S)
        except ClientGone:  # nobody is listening; 499 is nginx's "client closed request", for the access log
            return Response(status_code=499)
        except TimeoutError:
            if future.done():  # the decode's own error, not the backstop
                raise
            future.add_done_callback(_settle)  # a step that never returned: answer now (504)
            raise abandon() from None
        finally:
            if watch is not None:
                watch.cancel()
        timer.finished()
        body = response_body(cfg.api.served_model_name, jobs, served, chat=chat, tokenizer=state.pair.tokenizer, n=n)
        return JSONResponse(body, headers=headers)
    queue: asyncio.Queue = asyncio.Queue()
    for j in jobs:
        j.on_delta = lambda text, lps, i=j.index: loop.call_soon_threadsafe(queue.put_nowait, (i, text, lps))
    future = loop.run_in_executor(state.executor, run)
    future.add_done_callback(lambda _: queue.put_nowait(None))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    deadline = loop.time() + cfg.admission.request_timeout_s + TIMEOUT_GRACE_S
    return StreamingResponse(
        _sse(
            cfg.api.served_model_name,
            jobs,
            future,
            queue,
            chat=chat,
            include_usage=include_usage,
            deadline=(deadline, abandon),
            timer=timer,
            tokenizer=state.pair.tokenizer,
        ),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
    )


async def _sse(
    model: str,
    jobs: list[Job],
    future,
    queue: asyncio.Queue,
    *,
    chat: bool,
    include_usage: bool,
    deadline: tuple[float, Callable[[], SpecOpsError]] | None = None,
    timer: RequestTimer | None = None,
    tokenizer=None,
) -> AsyncIterator[str]:
    """The stream of one request: its choices' chunks as they come, each naming its ``index``
    (OpenAI's interleaving for ``n`` > 1). ``deadline``: the event loop's time at which a decode
    that has not ended is abandoned, and what abandons it (the error the stream then ends with);
    ``timer``: its latency histograms (each chunk of tokens, and the end)."""
    job = jobs[0]
    obj = "chat.completion.chunk" if chat else "text_completion"
    rid = ("chatcmpl-" if chat else "cmpl-") + job.public_id

    def chunk(choices: list, **extra) -> str:
        body = {"id": rid, "object": obj, "created": job.created, "model": model, "choices": choices, **extra}
        return f"data: {json.dumps(body)}\n\n"

    offset = dict.fromkeys(range(len(jobs)), 0)  # completions: each choice's text offset of its next token

    def shaped(lps, index: int) -> dict | None:
        if lps is None:
            return None
        items = logprobs_fmt.entries(tokenizer, lps)
        if chat:
            return logprobs_fmt.chat_shape(items)
        out = logprobs_fmt.completion_shape(items, top=job.plan.params.logprobs, offset=offset[index])
        offset[index] += sum(len(e.text) for e in items)
        return out

    def choice(text: str | None, finish: str | None, index: int = 0, role: bool = False, lps=None) -> dict:
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            return {"index": index, "delta": delta, "logprobs": shaped(lps, index), "finish_reason": finish}
        return {"index": index, "text": text or "", "logprobs": shaped(lps, index), "finish_reason": finish}

    outcome_read = False
    try:
        if chat:
            for j in jobs:
                yield chunk([choice(None, None, j.index, role=True)])
        loop = asyncio.get_running_loop()
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), None if deadline is None else deadline[0] - loop.time())
            except TimeoutError:  # a step that never returned: end the stream with the request timeout
                err = deadline[1]()
                yield f"data: {json.dumps(error_body(http_status(err), str(err), err.code, err.param))}\n\n"
                return
            if item is None:
                break
            index, text, lps = item
            if timer is not None:
                timer.tokens()
            yield chunk([choice(text, None, index, lps=lps)])
        outcome_read = True
        try:
            served = future.result()
        except (SpecOpsError, ClientGone) as err:
            status = http_status(err) if isinstance(err, SpecOpsError) else 499
            yield f"data: {json.dumps(error_body(status, str(err), getattr(err, 'code', 'cancelled')))}\n\n"
            return
        except Exception as err:  # a bug: say so in-band, the status line is long gone
            log.exception("request %s failed while streaming", job.request_id)
            yield f"data: {json.dumps(error_body(500, f'internal error: {type(err).__name__}', 'internal'))}\n\n"
            return
        body = response_body(model, jobs, served, chat=chat, tokenizer=tokenizer, n=len(jobs))
        for j in jobs:  # parsed at the end: each call whole, in one delta (OpenAI's shape)
            calls = [{"index": k, **c} for k, c in enumerate(j.tool_calls)]
            if calls:
                yield chunk(
                    [{"index": j.index, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None}]
                )
        for j, done in zip(jobs, body["choices"], strict=True):
            last = choice(None if chat else "", done["finish_reason"], j.index)
            if j.token_ids:  # the choice's ids, once, on its finishing chunk
                last.update(prompt_token_ids=list(j.plan.prompt_ids), token_ids=list(j.output_ids))
            extra = {"speculation": body["speculation"]} if j is jobs[-1] else {}
            yield chunk([last], **extra)
        if include_usage:
            yield chunk([], usage=body["usage"])
        yield "data: [DONE]\n\n"
        if timer is not None:
            timer.finished()
    finally:
        job.cancel.set()  # a client that went away stops the decode at its next step (every choice's)
        if not outcome_read:  # ... and nobody reads its outcome: settle it here, not as "never retrieved"
            future.add_done_callback(_settle)


def _settle(future) -> None:
    """The outcome of a decode whose streaming client went away: ClientGone is expected, anything else is logged."""
    err = None if future.cancelled() else future.exception()
    if err is not None and not isinstance(err, (ClientGone, SpecOpsError)):
        log.error("a request failed after its client went away", exc_info=err)
