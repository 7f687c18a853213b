"""Idle connections outlive the client's keep-alive expiry on every HTTP server tracerl runs.

The fault this guards against (seen in ``bench/time_to_reward.py``: "APIConnectionError:
Connection error." on the first held-out rollout after a training step): uvicorn and vLLM
close an idle connection after 5 s, exactly when httpx (under the OpenAI SDK) stops reusing
it, so a request sent on a connection idle for ~5 s — the length of a small training step —
races the server's close and is lost.  The model's client does not retry (``max_retries=0``:
a retried sample would be a different sample), so the server must be the one that waits longer.
"""

from __future__ import annotations

import socket
import time

import httpx
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from tracerl.net.http_server import KEEP_ALIVE_S, BackgroundUvicorn
from tracerl.inference.vllm_server import VLLMServer


def _get(sock: socket.socket) -> bytes:
    sock.sendall(b"GET /ping HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    data = b""
    while b"pong" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return data  # the server closed the connection
        data += chunk
    return data


def test_an_idle_connection_is_still_served_after_httpx_would_have_expired_it() -> None:
    app = Starlette(routes=[Route("/ping", lambda request: PlainTextResponse("pong"))])
    server = BackgroundUvicorn(app)
    port = server.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            assert b"200 OK" in _get(sock)
            time.sleep(httpx.Limits().keepalive_expiry + 1.0)  # idle past the client's own expiry
            assert b"200 OK" in _get(sock), "the server closed an idle connection the client could still use"
    finally:
        server.stop()


def test_vllm_keeps_idle_connections_longer_than_httpx_expires_them() -> None:
    env = VLLMServer("/models/m", python="/usr/bin/python3").environment()
    assert int(env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]) == int(KEEP_ALIVE_S) > httpx.Limits().keepalive_expiry
