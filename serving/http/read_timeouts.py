"""Read deadlines: a client has a bounded time to send its request, so a connection that
trickles its headers, or declares more body than it sends, does not stay open indefinitely.

Three settings of ``specops serve`` (:class:`~specops.serving.http.config.ServeConfig`):

1. ``header_timeout_s``: from a connection's opening, or on a kept-alive connection from the
   first byte of its next request, until that request's headers are complete. On expiry the
   connection is closed, after a 408 (``read_timeout``) when part of a request came. Trickling
   bytes does not extend it. :class:`GuardedH11Protocol` adds this timer to uvicorn's h11
   protocol: uvicorn 0.54 has none of its own (its ``timeout_keep_alive`` only covers the idle
   time after a response).
2. ``body_timeout_s``: from the headers until the body's last byte, while the API reads it
   (:class:`BodyDeadline`, ASGI): a 408 with ``Connection: close``. A body the API did not
   read because it answered first (401, 403, 404, 405, 413) must also end within this time
   after that answer, or the protocol closes the connection.
3. ``keep_alive_timeout_s``: an idle kept-alive connection between requests is closed
   (uvicorn's ``timeout_keep_alive``).

Not covered here: a client that reads its response slowly (writes wait on TCP flow control;
a client that disconnects stops its decode), and TLS handshakes (this server speaks plain
HTTP; put TLS in a proxy, which then also bounds what reaches it).
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from specops.core.errors import ReadTimeoutError
from specops.serving.http.errors import error_body

log = logging.getLogger(__name__)


class BodyDeadline:
    """ASGI middleware: the body must arrive within ``timeout_s`` of the headers, or reading it
    raises :class:`ReadTimeoutError` (the API answers 408 and closes the connection). Once the
    body's last message is in, ``receive`` is the server's own again, so a streamed response's
    wait for a disconnect is not limited."""

    def __init__(self, app, *, timeout_s: float) -> None:
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        body_done = False

        async def receive_by_deadline():
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise ReadTimeoutError(
                    f"the request body did not arrive within {self.timeout_s:g}s of its headers; "
                    "send the whole body at once"
                ) from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, receive_by_deadline, send)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a read timer (see the module docstring, 1. and 2.)."""

    header_timeout_s: float = 30.0
    body_timeout_s: float = 30.0

    def connection_made(self, transport) -> None:
        self._read_timer: asyncio.TimerHandle | None = None
        self._read_phase: str | None = None
        self._had_request = False
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_phase(None)
        super().connection_lost(exc)

    def _watch(self) -> None:
        """Start, keep or stop the timer for what the connection waits for now."""
        conn = self.conn
        self._had_request |= conn.their_state is not h11.IDLE
        phase = None
        if self.transport.is_closing():
            pass
        elif conn.their_state is h11.IDLE and (not self._had_request or conn.trailing_data[0]):
            phase = "headers"  # a new connection, or the first bytes of the next request (idle: keep-alive's)
        elif conn.their_state is h11.SEND_BODY and conn.our_state is h11.DONE:
            phase = "body"  # answered before the body was read: the rest must still come, promptly
        self._set_phase(phase)

    def _set_phase(self, phase: str | None) -> None:
        if phase == self._read_phase:
            return  # the same wait goes on: more bytes do not extend it
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        self._read_phase = phase
        if phase is not None:
            timeout = self.header_timeout_s if phase == "headers" else self.body_timeout_s
            self._read_timer = self.loop.call_later(timeout, self._expired, phase, timeout)

    def _expired(self, phase: str, timeout: float) -> None:
        self._read_timer, self._read_phase = None, None
        if self.transport.is_closing():
            return
        partial = phase == "headers" and bool(self.conn.trailing_data[0])
        if partial:
            self.transport.write(_response_408(f"the request headers did not arrive within {timeout:g}s"))
        client = "{}:{}".format(*self.client) if self.client else "a client"
        log.info(
            "closed the connection from %s: %s within %gs",
            client,
            "no complete request headers" if phase == "headers" else "the rest of an unread body not sent",
            timeout,
        )
        self.transport.close()


def guarded_h11(header_timeout_s: float, body_timeout_s: float) -> type[GuardedH11Protocol]:
    """The protocol class to give uvicorn (``uvicorn.Config(http=...)``) with these timeouts."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s},
    )


def _response_408(message: str) -> bytes:
    """A whole 408 response, written before h11 saw a request (h11 cannot frame a response to none)."""
    body = json.dumps(error_body(408, message, ReadTimeoutError.code)).encode()
    head = (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    )
    return head + body
