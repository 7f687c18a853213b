"""``tracerl serve``'s ``/v1`` proxy never waits forever on a hung inference server (issue 9, item 3).

The upstream is a real TCP server that accepts the proxied request, reads it, and never answers;
the proxy, real uvicorn on loopback, must answer 504 with a typed error after its timeout.
"""

from __future__ import annotations

import socket
import threading

import httpx
import pytest
from test_remote_backend import RecordingBackend

import tracerl
from tracerl.net.http_server import BackgroundUvicorn
from tracerl.serve.server import create_app


class SilentServer:
    """Accepts connections and reads requests, answers nothing (a hung inference server)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="silent-upstream").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)
            self.received.append(conn.recv(65536))

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture()
def hung_proxy():
    upstream = SilentServer()
    backend = RecordingBackend(f"http://127.0.0.1:{upstream.port}/v1")
    http = BackgroundUvicorn(create_app(backend, inference_timeout=1.0), name="tracerl-serve-timeouts")
    url = f"http://127.0.0.1:{http.start()}"
    yield upstream, url
    http.stop()
    upstream.close()


async def test_a_hung_inference_server_is_a_504_inference_timeout(hung_proxy):
    upstream, url = hung_proxy
    async with tracerl.RemoteBackend(url) as remote:
        model = tracerl.TrainableModel("agent", "timeouts", "smollm2-135m")
        await model.register(remote)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for route in ("/v1/chat/completions", "/v1/completions"):
            response = await client.post(route, json={"model": "agent@0", "messages": [{"role": "user", "content": "hi"}]})
            assert response.status_code == 504, response.text
            error = response.json()["error"]
            assert error["type"] == "InferenceTimeoutError" and "--inference-timeout" in error["message"]
        listing = await client.get("/v1/models")
        assert listing.status_code == 504
    assert any(b"POST /v1/chat/completions" in r for r in upstream.received)  # it really reached the upstream


def test_the_timeout_is_checked():
    with pytest.raises(tracerl.ConfigError):
        create_app(RecordingBackend(None), inference_timeout=0)
