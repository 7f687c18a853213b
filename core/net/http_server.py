"""HTTP plumbing shared by the servers: OpenAI-style errors and an in-process uvicorn thread."""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import socket
import threading
import time
from typing import Any, Callable

from ..errors import InferenceServerError

KEEP_ALIVE_S = 75.0
"""Seconds tracerl's HTTP servers (router, proxies, the transformers server; vLLM through
``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``) keep an idle client connection open.  Longer than httpx's own
keep-alive expiry (5 s): with uvicorn's default, also 5 s, a request sent on a connection idle
for ~5 s (a training step, a turn) raced the server's close and was lost — 3-4 of 1,000 rollouts
in ``bench/scale_sim.py``, and a held-out rollout right after a step in ``bench/time_to_reward.py``."""


def fast_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop event loop when uvloop is installed (the ``ray`` extra), else asyncio's own.

    Why: a proxy's CPU per request is mostly event-loop and socket work; uvloop roughly halves it
    (bench/RESULTS.md, "Scale in simulation")."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class OpenAIError(Exception):
    """An error answered as OpenAI's ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.upstream: bytes | None = None
        """The error body an upstream server sent, when this error relays one (answered as it was)."""

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def install_error_handlers(app: Any) -> None:
    """Answer every error of ``app`` (ours, validation, unexpected) in OpenAI's shape."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request: Any, error: OpenAIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Any, error: RequestValidationError) -> JSONResponse:
        details = error.errors()
        first = details[0] if details else {}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = "; ".join(
            f"{'.'.join(str(p) for p in d.get('loc', ()) if p != 'body') or 'body'}: {d.get('msg')}" for d in details
        )
        wrapped = OpenAIError(message or "invalid request", param=".".join(location) or None)
        return JSONResponse(wrapped.body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Any, error: HTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        wrapped = OpenAIError(str(error.detail), status=error.status_code, type=kind, code=error.status_code)
        return JSONResponse(wrapped.body(), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(_request: Any, error: Exception) -> JSONResponse:
        wrapped = OpenAIError(f"{type(error).__name__}: {error}", status=500, type="internal_error")
        return JSONResponse(wrapped.body(), status_code=500)


def new_api_key() -> str:
    """A random per-process key for an internal server, registered with :mod:`tracerl.redact`
    so it never appears in spans, logs or written files."""
    from ..redact import register_secret

    key = secrets.token_urlsafe(32)
    register_secret(key)
    return key


def presented_key(headers: Any) -> str:
    """The API key a request presents: ``Authorization: Bearer KEY`` (OpenAI's SDKs) or ``x-api-key: KEY``
    (Anthropic's SDK); ``""`` when it presents none.  ``headers``: ASGI ``(name, value)`` byte pairs or a mapping."""
    items = headers.items() if hasattr(headers, "items") else headers
    bearer = api_key = ""
    for name, value in items:
        name = (name.decode("latin-1") if isinstance(name, bytes) else name).lower()
        value = value.decode("latin-1") if isinstance(value, bytes) else value
        if name == "authorization" and value[:7].lower() == "bearer ":
            bearer = value[7:]
        elif name == "x-api-key":
            api_key = value
    return bearer or api_key


def key_matches(headers: Any, key: str) -> bool:
    """Whether the request presents ``key`` (compared in constant time)."""
    return hmac.compare_digest(presented_key(headers).encode(), key.encode())


class BearerAuth:
    """ASGI middleware: every path but ``open_paths`` needs the server's key, else 401.

    The key is accepted as ``Authorization: Bearer <key>`` or as ``x-api-key: <key>`` (how the
    Anthropic SDK sends it).  The internal servers listen on loopback, where any local user can
    connect: without the key one could generate with, or swap, the adapter being trained
    (``/v1/load_lora_adapter``)."""

    def __init__(self, app: Any, key: str, open_paths: tuple[str, ...] = ("/health",)) -> None:
        self.app, self.key, self.open_paths = app, key, open_paths

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in self.open_paths or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        if key_matches(scope.get("headers") or (), self.key):
            await self.app(scope, receive, send)
            return
        error = OpenAIError("missing or wrong API key for this tracerl inference server", status=401, code="invalid_api_key")
        body = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})


def free_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening-ready bound socket (port 0 picks a free one); handing it to uvicorn avoids races.

    Created with ``IPPROTO_TCP`` explicitly: asyncio turns Nagle off (``TCP_NODELAY``) only on
    sockets whose ``proto`` says TCP, and accepted sockets inherit the listener's.  With ``proto=0``
    every keep-alive answer (headers, then body: two writes) waited ~40 ms for the client's
    delayed ACK — measured 43 ms per request on loopback, 3 ms with this."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class BackgroundUvicorn:
    """Run an ASGI app with uvicorn on a daemon thread with its own event loop."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0, name: str = "tracerl-http",
                 loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop, http: str = "auto",
                 keep_alive_s: float = KEEP_ALIVE_S) -> None:
        """``loop_factory``: the thread's event loop (``fast_event_loop`` for uvloop); ``http``: uvicorn's
        HTTP implementation (``auto``: httptools when installed, else h11); ``keep_alive_s``: how long
        an idle client connection is kept open (uvicorn's ``timeout_keep_alive``)."""
        self.app = app
        self._loop_factory = loop_factory
        self._http = http
        self._keep_alive_s = keep_alive_s
        self.host = host
        self._requested_port = port
        self.port: int | None = None
        self._name = name
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self, timeout: float = 30.0) -> int:
        import uvicorn

        sock = free_socket(self.host, self._requested_port)
        self.port = int(sock.getsockname()[1])
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False, http=self._http,
                                timeout_keep_alive=self._keep_alive_s)
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # type: ignore[method-assign]

        def serve() -> None:
            self.loop = self._loop_factory()
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(self._server.serve(sockets=[sock]))
            finally:
                sock.close()
                self.loop.close()

        self._thread = threading.Thread(target=serve, name=self._name, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise InferenceServerError(f"the HTTP server thread {self._name!r} exited during start-up")
            if time.monotonic() > deadline:
                raise InferenceServerError(f"the HTTP server {self._name!r} did not start within {timeout:.0f} s")
            time.sleep(0.01)
        return self.port

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive() and self._server is not None:
                self._server.force_exit = True
                self._thread.join(timeout)
        self._thread = None
