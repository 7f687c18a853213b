"""The per-process key on every route of the vLLM server but ``/health``; runs *inside* vLLM.

vLLM checks ``VLLM_API_KEY`` on ``/v1/*`` only.  tracerl starts vLLM with
``VLLM_SERVER_DEV_MODE`` (it needs ``/pause``, ``/resume``, ``/reset_prefix_cache`` and
``/collective_rpc`` for hot reloads), and those routes would otherwise answer any local user on
loopback — ``/collective_rpc`` calls arbitrary worker methods.  :class:`VLLMServer` copies this
file into a private directory on vLLM's ``PYTHONPATH`` and passes ``--middleware
tracerl_vllm_key_guard.guard``, so it must import nothing from tracerl (vLLM runs in its own
venv).  Fails closed: with no key set, only ``/health`` answers.
"""

from __future__ import annotations

import hmac
import os
from typing import Any, Awaitable, Callable

from starlette.responses import JSONResponse

OPEN_PATHS = frozenset({"/health"})
"""Unauthenticated: liveness only (tracerl's start-up wait and health checks use it)."""


async def guard(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    """Starlette HTTP middleware: ``Authorization: Bearer $VLLM_API_KEY`` or 401."""
    if request.url.path in OPEN_PATHS:
        return await call_next(request)
    key = os.environ.get("VLLM_API_KEY", "")
    given = request.headers.get("authorization", "")
    if key and hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
        return await call_next(request)
    body = {"error": {"message": "this server needs its per-process key", "type": "Unauthorized", "param": None, "code": 401}}
    return JSONResponse(body, status_code=401)
