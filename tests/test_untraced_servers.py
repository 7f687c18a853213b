"""tracerl's own HTTP servers never trace themselves into the user's tracer provider.

The fault, reproduced for real: a process whose global tracer provider is an SDK one (as with
Langfuse, Phoenix, OpenInference or ``opentelemetry-instrument``) runs ``tracerl serve``, the
vLLM proxy or the transformers server.  FastAPI's built-in telemetry, and OpenTelemetry's
contrib FastAPI / httpx instrumentation when it is on, turned every request to them (and serve's
forwarded request upstream) into spans exported with the user's traces.  The user's own FastAPI
app, served the same way beside them, must still be traced.
"""

from __future__ import annotations

import types

import httpx
import pytest
from capture_fake_server import FakeOpenAIServer
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_remote_backend import RecordingBackend

from tracerl.net.http_server import BackgroundUvicorn
from tracerl.inference.vllm_proxy import build_proxy
from tracerl.inference.policy_gate import PolicyGate
from tracerl.inference.transformers_server import TransformersServer, build_app
from tracerl.inference.turns import TurnReader
from tracerl.serve.server import create_app
from tracerl.net.untraced import untraced_fastapi

CHAT = {"model": "m", "messages": [{"role": "user", "content": "self-tracing?"}]}


@pytest.fixture(scope="module")
def user_spans():
    """The user's exporter on the global SDK provider (what Langfuse / OTLP would receive)."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())
    exporter = InMemorySpanExporter()
    trace.get_tracer_provider().add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()  # a provider cannot drop a processor; a shut exporter keeps nothing


@pytest.fixture(scope="module")
def upstream():
    with FakeOpenAIServer() as server:
        yield server


@pytest.fixture(params=["fastapi-native", "contrib-instrumentation"])
def instrumentation(request, user_spans):
    """FastAPI's own telemetry alone, or also OpenTelemetry's contrib FastAPI + httpx instrumentors."""
    if request.param == "fastapi-native":
        yield request.param
        return
    fastapi_instrumentation = pytest.importorskip("opentelemetry.instrumentation.fastapi")
    httpx_instrumentation = pytest.importorskip("opentelemetry.instrumentation.httpx")
    instrumentors = [fastapi_instrumentation.FastAPIInstrumentor(), httpx_instrumentation.HTTPXClientInstrumentor()]
    for instrumentor in instrumentors:
        instrumentor.instrument()
    yield request.param
    for instrumentor in instrumentors:
        instrumentor.uninstrument()


def _served(app):
    http = BackgroundUvicorn(app, name="untraced-test")
    return http, f"http://127.0.0.1:{http.start()}"


def _ours(spans, port: int, upstream_port: int) -> list[str]:
    """Spans our server (port) made: its request spans, and its forwarded calls upstream."""
    found = []
    for span in spans:
        attributes = dict(span.attributes or {})
        at_server = attributes.get("server.port") == port or f":{port}" in str(attributes.get("url.full", ""))
        upstream_call = f":{upstream_port}" in str(attributes.get("url.full", attributes.get("http.url", "")))
        if span.kind == trace.SpanKind.SERVER and at_server or span.instrumentation_scope.name == "fastapi" or upstream_call:
            found.append(f"{span.instrumentation_scope.name}: {span.name}")
    return found


def _vllm_proxy(upstream):
    turns = TurnReader(tokenizer=None, tool_call_format="hermes", reasoning=False)  # what VLLMServer.start sets
    server = types.SimpleNamespace(vllm_url=f"http://127.0.0.1:{upstream.port}", served_name="m", model_path="/models/m", api_key="k",
                                   aliases=set(), gate=PolicyGate(), turns=turns)  # fmt: skip
    return build_proxy(server)


APPS = {
    "tracerl serve": lambda upstream: create_app(RecordingBackend(upstream.base_url)),
    "vLLM proxy": _vllm_proxy,
    "transformers server": lambda upstream: build_app(TransformersServer("/models/unused")),
}


@pytest.mark.parametrize("name", sorted(APPS))
def test_tracerl_servers_emit_no_spans_into_the_user_provider(name, instrumentation, user_spans, upstream):
    http, url = _served(APPS[name](upstream))
    try:
        user_spans.clear()
        with httpx.Client(base_url=url, timeout=30) as client:
            if name == "tracerl serve":
                register = {"name": "agent", "project": "p", "base_model": "smollm2-135m"}
                assert client.post("/tracerl/v1/models/register", json=register).status_code == 200
                assert client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"]
            elif name == "vLLM proxy":
                assert client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer k"}).status_code == 200
            else:
                assert client.get("/health").json() == {"status": "ok"}
                client.post("/v1/chat/completions", json={"model": "m"})  # an error answer is traced too, if at all
    finally:
        http.stop()  # a request span ends after its response is sent: stop the server before looking
    assert _ours(user_spans.get_finished_spans(), http.port, upstream.port) == []


def test_the_users_own_fastapi_app_is_still_traced(instrumentation, user_spans, upstream):
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/hello")
    async def hello() -> dict[str, str]:
        return {"hello": "world"}

    http, url = _served(app)
    try:
        user_spans.clear()
        assert httpx.get(f"{url}/hello", timeout=30).json() == {"hello": "world"}
    finally:
        http.stop()
    servers = [s for s in user_spans.get_finished_spans() if s.kind == trace.SpanKind.SERVER]
    assert [s.name for s in servers] == ["GET /hello"]


def test_untraced_app_is_a_fastapi_app_with_telemetry_off():
    from fastapi import FastAPI

    app = untraced_fastapi(title="x")
    assert isinstance(app, FastAPI) and app.title == "x"
    assert getattr(app, "_telemetry", {}).get("tracing", False) is False
