"""A rollout's own address on tracerl's endpoint, for agents in other processes or languages.

A rollout opens a gateway token (``POST /v1/tracerl/rollouts``) and hands its agent
``{root}/rollouts/{token}/v1`` as the OpenAI (or Anthropic) base URL, or the header
``X-Tracerl-Rollout: {token}`` on the plain ``/v1`` routes.  Every model call that arrives with the
token, whatever process or language sent it, is kept under it: the chat request as it was
sampled (Responses and Messages calls translated onto it) and the completion with its token ids
and logprobs.  The rollout closes the token when it ends (``DELETE /v1/tracerl/rollouts/{token}``)
and receives the calls, which become its records like any hooked call's.

The endpoint's API key is still required on every route (the token only says which rollout a
call belongs to); tokens are unguessable (``secrets.token_urlsafe``); an unknown or finished token
gets a 404 that says so, never another rollout's trajectory.  Bounded: open tokens, calls per
token and a token's lifetime.
"""

from __future__ import annotations

import re
import secrets
import threading
import time
from collections import OrderedDict
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from ..net.http_server import OpenAIError

ROLLOUT_HEADER = "x-tracerl-rollout"
ROLLOUTS_PATH = "/v1/tracerl/rollouts"
_PATH = re.compile(r"^/rollouts/([A-Za-z0-9_-]{1,128})(/v1/.*)$")
MAX_OPEN = 10_000
MAX_CALLS = 20_000
LIFETIME_S = 24 * 3600.0

_current: ContextVar[str | None] = ContextVar("tracerl_gateway_token", default=None)


@dataclass
class _Open:
    opened: float
    calls: list[dict[str, Any]] = field(default_factory=list)
    dropped: int = 0


class Gateway:
    """The open rollout tokens of one server and the calls made with each."""

    def __init__(self, *, max_open: int = MAX_OPEN, max_calls: int = MAX_CALLS, lifetime_s: float = LIFETIME_S) -> None:
        self.max_open, self.max_calls, self.lifetime_s = max_open, max_calls, lifetime_s
        self._open: OrderedDict[str, _Open] = OrderedDict()
        self._lock = threading.Lock()

    def open(self) -> str:
        now = time.monotonic()
        with self._lock:
            while self._open and now - next(iter(self._open.values())).opened > self.lifetime_s:
                self._open.popitem(last=False)  # forgotten by a rollout that never ended
            if len(self._open) >= self.max_open:
                raise OpenAIError(f"{self.max_open} rollouts already hold a gateway token on this server; "
                                  "finish some first", status=429, type="rate_limit_error")  # fmt: skip
            token = secrets.token_urlsafe(24)
            self._open[token] = _Open(now)
            return token

    def close(self, token: str) -> dict[str, Any]:
        """The token's calls (it is unknown from now on); 404 for an unknown token."""
        with self._lock:
            state = self._open.pop(token, None)
        if state is None:
            raise _unknown(token)
        return {"calls": state.calls, "dropped_calls": state.dropped}

    def wrap(self, complete: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]:
        """``complete`` (a chat request body -> its completion) that admits and records gateway calls: a
        request with a token that is not open gets a 404; past ``max_calls`` a call is counted, not kept."""

        async def gated(body: dict[str, Any]) -> dict[str, Any]:
            token = _current.get()
            if token is None:
                return await complete(body)
            if token not in self._open:
                raise _unknown(token)
            request, start = dict(body), time.time_ns()  # as sent: ``complete`` may rewrite the body
            completion = await complete(body)
            call = {"request": request, "completion": completion, "start_ns": start, "end_ns": time.time_ns()}
            with self._lock:
                state = self._open.get(token)  # None: closed while the call ran (the rollout ended, the call is not its)
                if state is not None and len(state.calls) >= self.max_calls:
                    state.dropped += 1
                elif state is not None:
                    state.calls.append(call)
            return completion

        return gated


def _unknown(token: str) -> OpenAIError:
    return OpenAIError(f"unknown or finished rollout token {token[:6]}…: the rollout it belonged to has ended "
                       "(or never opened here); open a new one", status=404, type="not_found_error", code="unknown_rollout")  # fmt: skip


class GatewayMiddleware:
    """ASGI: ``/rollouts/{token}/v1/...`` is ``/v1/...`` with the token; the token (from the path or
    ``X-Tracerl-Rollout``) is the current request's (checked by :meth:`Gateway.wrap`'s calls, after auth)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        match = _PATH.match(scope.get("path") or "")
        if match is not None:
            token = match.group(1)
            scope = {**scope, "path": match.group(2), "raw_path": match.group(2).encode(),
                     "headers": [*scope.get("headers", ()), (ROLLOUT_HEADER.encode(), token.encode())]}  # fmt: skip
        else:
            token = next((v.decode("latin-1") for n, v in scope.get("headers") or () if n.lower() == ROLLOUT_HEADER.encode()), None)
        if token is None:
            await self.app(scope, receive, send)
            return
        reset = _current.set(token)
        try:
            await self.app(scope, receive, send)
        finally:
            _current.reset(reset)


def add_gateway_routes(app: Any, gateway: Gateway) -> None:
    """Open and close rollout tokens on ``app`` (behind its API key, as every ``/v1`` route)."""

    @app.post(ROLLOUTS_PATH)
    async def open_rollout() -> dict[str, Any]:
        return {"token": gateway.open(), "lifetime_s": gateway.lifetime_s}

    @app.delete(ROLLOUTS_PATH + "/{token}")
    async def close_rollout(token: str) -> dict[str, Any]:
        return gateway.close(token)

    app.add_middleware(GatewayMiddleware)
