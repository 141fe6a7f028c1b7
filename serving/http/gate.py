"""The API's front door, in front of every route: size and key checks, counts, timing and the access log.

:class:`Gate` refuses a body that is too large (413) and a missing (401) or wrong (403) key
before any route runs, counts requests by endpoint and status, times them to their last byte,
writes one access-log line each (``specops.serving.http.latency.log_access``; probes and scrapes at DEBUG) and puts the request's
:class:`~specops.serving.http.tenancy.Tenant` and arrival time in the ASGI scope's state.
:func:`error_response` is every API error's response (``specops.serving.http.api`` uses it too).
"""

from __future__ import annotations

import logging
import re
import time

from fastapi.responses import JSONResponse
from prometheus_client import Counter, Histogram

from specops.core.errors import (
    AuthenticationError,
    PermissionDeniedError,
    RequestTooLargeError,
    SpecOpsError,
    http_status,
)
from specops.serving.http.errors import error_body
from specops.serving.http.latency import log_access
from specops.serving.http.tenancy import ANONYMOUS, Tenant, Tenants

API_REQUESTS = Counter("specops_api_requests_total", "HTTP requests by endpoint and status", ["endpoint", "status"])
API_SECONDS = Histogram(
    "specops_api_request_seconds",
    "HTTP request time (to the last byte for streams)",
    ["endpoint"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128),
)

OPEN_PATHS = ("/healthz", "/readyz")
REQUEST_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
"""What an ``X-Request-Id`` may be (the caller's is refused otherwise)."""


def error_response(err: SpecOpsError) -> JSONResponse:
    status = http_status(err)
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    if status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    if status == 408:  # the rest of the request may still be on its way: do not read it as the next request
        headers = {"Connection": "close"}
    return JSONResponse(error_body(status, str(err), err.code, err.param), status_code=status, headers=headers)


class Gate:
    """Pure ASGI middleware, in front of everything: body size (413) and key (401/403) checks,
    then request counts by status and time to the last byte. Pure ASGI, not Starlette's
    ``BaseHTTPMiddleware``, so the route still sees the client's disconnect. The key's
    :class:`~specops.serving.http.tenancy.Tenant` goes in ``scope["state"]["tenant"]`` (``ANONYMOUS``
    without keys; none on a path open without a key)."""

    ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics", *OPEN_PATHS)

    def __init__(self, app, *, cfg, tenants: Tenants) -> None:
        self.app, self.cfg, self.tenants = app, cfg, tenants

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        scope.setdefault("state", {})["arrived"] = t0  # the request timer's start (specops.serving.http.latency)
        path = scope["path"]
        endpoint = path if path in self.ENDPOINTS else "other"
        seconds = API_SECONDS.labels(endpoint)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        status, sent, request_id = 500, 0, headers.get("x-request-id", "")
        request_id = request_id if REQUEST_ID.fullmatch(request_id) else None  # ours replaces it when sent

        def access() -> None:
            tenant = scope["state"].get("tenant")
            client = "{}:{}".format(*scope["client"]) if scope.get("client") else None
            log_access(
                scope["method"],
                path,
                status,
                time.perf_counter() - t0,
                request_id=request_id,
                tenant=tenant.id if tenant is not None else None,
                num_bytes=sent,
                client=client,
                level=logging.DEBUG if endpoint in OPEN_PATHS or endpoint == "/metrics" else logging.INFO,
            )

        try:
            _check_size(headers, self.cfg.max_body_bytes)
            tenant = None if self.tenants.required else ANONYMOUS
            if self.tenants.required and path not in OPEN_PATHS and (path != "/metrics" or self.cfg.auth_metrics):
                tenant = _check_key(headers, self.tenants)
            if tenant is not None:
                scope.setdefault("state", {})["tenant"] = tenant
        except SpecOpsError as err:
            response = error_response(err)
            status, sent = response.status_code, len(response.body)
            await response(scope, receive, send)
            API_REQUESTS.labels(endpoint, str(status)).inc()
            seconds.observe(time.perf_counter() - t0)
            access()
            return

        timed = False

        async def send_and_count(message) -> None:
            nonlocal status, timed, sent, request_id
            if message["type"] == "http.response.start":
                status = message["status"]
                rid = next((v for k, v in message.get("headers", []) if k.lower() == b"x-request-id"), None)
                request_id = rid.decode("latin-1") if rid is not None else request_id
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                seconds.observe(time.perf_counter() - t0)  # the last byte went out
                timed = True

        try:
            await self.app(scope, receive, send_and_count)
        finally:
            API_REQUESTS.labels(endpoint, str(status)).inc()
            if not timed:  # the client left before the end
                seconds.observe(time.perf_counter() - t0)
            access()


def _check_size(headers: dict[str, str], limit: int) -> None:
    length = headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise RequestTooLargeError(f"request body is {int(length)} bytes; the limit is {limit}")


def _check_key(headers: dict[str, str], tenants: Tenants) -> Tenant:
    header = headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
    tenant = tenants.lookup(token.strip().encode())
    if tenant is None:
        raise PermissionDeniedError("the API key is not valid for this server")
    return tenant
