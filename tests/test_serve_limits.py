"""``tracerl serve`` bounds what one caller can make it do (issue 9, item 5): request body size.

Real uvicorn on loopback, real sockets; the backend is test_remote_backend's recording stand-in.
"""

from __future__ import annotations

import json
import select
import socket

import httpx
import pytest
from test_remote_backend import RecordingBackend, _group, _model, upstream  # noqa: F401 - upstream is a fixture

import tracerl
from tracerl import RemoteBackendError
from tracerl.net.http_server import BackgroundUvicorn
from tracerl.serve.server import create_app

LIMIT = 1 << 20  # 1 MiB for the tests (the default is 32 MiB)
TRAIN = "/tracerl/v1/models/remote-tests/agent/train"


@pytest.fixture()
def limited(upstream):
    backend = RecordingBackend(upstream.base_url)
    http = BackgroundUvicorn(create_app(backend, max_body_bytes=LIMIT), name="tracerl-serve-limits")
    yield backend, http.start(), f"http://127.0.0.1:{http.port}"
    http.stop()


def _read_response(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def _content_length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 1 << 30


@pytest.mark.parametrize("path", [TRAIN, "/tracerl/v1/models/register", "/v1/chat/completions"])
def test_a_declared_oversize_body_is_answered_413_unread(limited, path):
    backend, port, _ = limited
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {48 << 20}\r\n\r\n"
        sock.sendall(head.encode() + b"[" * 65536)  # 64 KiB of the announced 48 MiB, then wait for the answer
        status, body = _read_response(sock)
    assert status == 413 and body["error"]["type"] == "BodyTooLargeError" and "--max-body-mb" in body["error"]["message"]
    assert backend.trained == []


def test_a_streamed_oversize_body_is_cut_off_at_the_limit(limited):
    backend, port, _ = limited
    chunk = b"x" * (128 << 10)
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"POST {TRAIN} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        while not select.select([sock], [], [], 0.2)[0]:  # keep streaming until the server answers
            assert sent < 16 * LIMIT, "the server kept reading far past its limit"
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
        status, body = _read_response(sock)
    assert status == 413 and body["error"]["type"] == "BodyTooLargeError"
    assert sent > LIMIT and backend.trained == []


async def test_remote_backend_gets_413_as_a_typed_error(limited):
    backend, _, url = limited
    model = _model()
    async with tracerl.RemoteBackend(url) as remote:
        await model.register(remote)
        big = _group()
        big.trajectories[0].metadata["blob"] = "y" * (2 * LIMIT)
        with pytest.raises(RemoteBackendError, match="max-body-mb") as caught:
            await remote.train(model, [big])  # the limit came with register's answer: refused before sending
        assert caught.value.status == 413 and caught.value.error_type == "BodyTooLargeError"
        assert (await remote.train(model, [_group()])).step == 1  # a normal body still trains
    assert len(backend.trained) == 1


async def test_a_body_under_the_limit_still_passes(limited):
    _, _, url = limited
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        register = {"name": "agent", "project": "remote-tests", "base_model": "smollm2-135m"}
        assert (await client.post("/tracerl/v1/models/register", json=register)).status_code == 200
        under = {"model": "agent@0", "messages": [{"role": "user", "content": "z" * (LIMIT // 2)}]}
        assert (await client.post("/v1/chat/completions", json=under)).status_code == 200
