"""The internal inference servers need their random per-process key (issue 9, item 5).

Light: the transformers server's real app (no model loaded: the key is checked before any route
runs) on real uvicorn; serve's proxy forwarding the key to it.  The same check against both real
servers, with the model, is ``test_inference_contract.py::test_a_caller_without_the_servers_key_gets_401``.
"""

from __future__ import annotations

import sys

import httpx
import pytest
from test_remote_backend import RecordingBackend

import tracerl
from tracerl.net.http_server import BackgroundUvicorn
from tracerl.inference.transformers_server import TransformersServer, build_app
from tracerl.redact import redact_text
from tracerl.serve.server import create_app


@pytest.fixture()
def keyed_server():
    server = TransformersServer("/models/unused", served_name="policy")
    http = BackgroundUvicorn(build_app(server), name="tracerl-keyed-transformers")
    url = f"http://127.0.0.1:{http.start()}"
    yield server, url
    http.stop()


def test_every_route_but_health_needs_the_key(keyed_server):
    server, url = keyed_server
    other = TransformersServer("/models/unused")
    assert len(server.api_key) >= 32 and server.api_key != other.api_key  # random per server
    assert server.api_key not in redact_text(f"the value {server.api_key} here")
    load = {"lora_name": "policy@evil", "lora_path": "/tmp/evil"}
    with httpx.Client(base_url=url, timeout=30) as client:
        assert client.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer tracerl"}, {"Authorization": f"Bearer {other.api_key}"}, {"Authorization": server.api_key}):
            for method, path, body in [("GET", "/v1/models", None), ("POST", "/v1/chat/completions", {"model": "policy"}),
                                       ("POST", "/v1/load_lora_adapter", load), ("POST", "/v1/unload_lora_adapter", load)]:  # fmt: skip
                response = client.request(method, path, json=body, headers=headers)
                assert response.status_code == 401, (path, headers)
                assert response.json()["error"]["code"] == "invalid_api_key"
        keyed = client.get("/v1/models", headers={"Authorization": f"Bearer {server.api_key}"})
        assert keyed.status_code == 200 and [m["id"] for m in keyed.json()["data"]] == ["policy"]


async def test_serve_forwards_the_models_key_not_the_callers_token(keyed_server):
    server, url = keyed_server

    class KeyedBackend(RecordingBackend):
        async def register(self, model):  # like LocalBackend: the model gets the server's URL and key
            await super().register(model)
            model.inference_base_url, model.inference_api_key = f"{url}/v1", server.api_key

    http = BackgroundUvicorn(create_app(KeyedBackend(None), token="caller-token"), name="tracerl-serve-keys")
    serve_url = f"http://127.0.0.1:{http.start()}"
    try:
        async with tracerl.RemoteBackend(serve_url, token="caller-token") as remote:
            model = tracerl.TrainableModel("policy", "keys", "smollm2-135m")
            await model.register(remote)
            assert model.inference_api_key == "caller-token"  # the client never learns the internal key
            listing = await model.openai_client().models.list()
            assert [m.id for m in listing.data] == ["policy"]  # the proxy's call passed the key check
    finally:
        http.stop()


def test_the_vllm_guard_keys_every_route_but_health(monkeypatch):
    """vllm_key_guard.py runs inside vLLM (its own venv): the key on /pause, /collective_rpc...,
    which vLLM's own VLLM_API_KEY check leaves open; fails closed without a key."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from tracerl.inference import vllm_key_guard
    from tracerl.inference.vllm_server import GUARD_MODULE, VLLMServer

    app = FastAPI()
    app.middleware("http")(vllm_key_guard.guard)
    for route in ("/health", "/pause", "/collective_rpc"):
        app.post(route)(lambda: {"ok": True})
    app.get("/health")(lambda: {"ok": True})
    client = TestClient(app)
    monkeypatch.setenv("VLLM_API_KEY", "k" * 40)
    assert client.get("/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k" * 40}):
        assert client.post("/collective_rpc", headers=headers).status_code == 401
        assert client.post("/pause", headers=headers).status_code == 401
    assert client.post("/pause", headers={"Authorization": "Bearer " + "k" * 40}).status_code == 200
    monkeypatch.delenv("VLLM_API_KEY")
    assert client.post("/pause", headers={"Authorization": "Bearer "}).status_code == 401  # no key: closed
    source = open(vllm_key_guard.__file__).read()
    assert "tracerl" not in [line.split()[1].split(".")[0] for line in source.splitlines() if line.startswith(("import ", "from "))]
    server = VLLMServer("/nonexistent", python=sys.executable)
    assert f"{GUARD_MODULE}.guard" in server.command(1234)
