"""ASGI middleware of ``tracerl serve``: a request body limit and an access log.

Plain ASGI (not Starlette's ``BaseHTTPMiddleware``) so that streamed proxy answers pass through
untouched and the limit applies before any endpoint reads a byte.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Awaitable, Callable, TextIO

from ..errors import ConfigError, TracerlError

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_BODY_MB = 32.0
"""A train call of 64 groups × 8 long trajectories is a few MiB of JSON; 32 MiB leaves room and
keeps one caller from making the server buffer an arbitrary amount of memory."""

log = logging.getLogger("tracerl.serve")


class BodyTooLargeError(TracerlError):
    """A request body is larger than the server accepts (answered 413).

    Not a ``ValueError``: an endpoint that turns unreadable JSON into a 400 must not catch it."""


def too_large_message(limit: int) -> str:
    return f"the request body is larger than this server's limit of {limit} bytes (--max-body-mb)"


class BodyLimit:
    """Answer 413 to a body over ``max_bytes``: at once when ``Content-Length`` says so, else as soon as
    the streamed (chunked) bytes read so far pass it; the rest of the body is never read.

    The connection is then closed with the rest unread, so a client that insists on writing it all
    before reading (httpx does) may see the connection reset instead of the 413; ``RemoteBackend``
    therefore learns the limit at ``register`` and refuses an oversize body before sending it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ConfigError(f"the body limit must be at least 1 byte, got {max_bytes}")
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _send_413(send, self.max_bytes)
            return
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLargeError(too_large_message(self.max_bytes))
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLargeError:
            if started:
                raise
            await _send_413(send, self.max_bytes)


async def _send_413(send: Send, limit: int) -> None:
    body = json.dumps(
        {"error": {"type": "BodyTooLargeError", "message": too_large_message(limit), "param": None, "code": 413}}
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


class AccessLog:
    """One line per request: time, client, method, path, status, duration, bytes sent.

    Only these: never a header (``Authorization`` carries the token), a query string or a body.
    """

    def __init__(self, app: ASGIApp, stream: TextIO) -> None:
        self.app, self.stream = app, stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 0
        sent = 0

        async def recording_send(message: Message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            self._write(scope, status or 500, time.monotonic() - started, sent)

    def _write(self, scope: Scope, status: int, seconds: float, sent: int) -> None:
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        line = f"{when} {who} {scope.get('method', '-')} {scope.get('path', '-')} {status} {seconds * 1000:.1f}ms {sent}B\n"
        try:
            self.stream.write(line)
            self.stream.flush()
        except (OSError, ValueError) as error:  # a full disk or a closed file must not fail the request
            log.warning("tracerl serve: cannot write the access log: %s", error)
