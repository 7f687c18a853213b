"""A user's own exporter, wrapped in ``OutboundSpanExporter``, gets the spans as tracerl's do.

Real pieces: tracerl's hooks on the OpenAI SDK, OpenTelemetry's httpx instrumentation
(which records every request the process makes), ``export_to_langfuse`` to the loopback
Langfuse endpoint, and two exporters of the user's on the same provider: one bare, one
wrapped.  A secret is planted in the user's question and in the tool's result.  The bare
exporter shows what the wrapper is for (the secret, chat inputs as deltas, the HTTP span of
a request to Langfuse); the wrapped one gets none of it.
"""

from __future__ import annotations

import json

import httpx
import pytest
from capture_fake_server import FakeOpenAIServer
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otlp_collector import OTLPCollector

import tracerl.integrations as ti
from tracerl.integrations import OutboundSpanExporter
from tracerl.integrations import processor as capture
from tracerl.integrations import semconv as sc

httpx_instrumentation = pytest.importorskip("opentelemetry.instrumentation.httpx")
pytestmark = pytest.mark.asyncio(loop_scope="session")
SECRET = "sk-proj-" + "Q7f2Lx9RmT4vWc8NbZ1kHs6YpD3gJa5E"
PK, SK = "pk-lf-outbound", "sk-lf-outbound"


def _text(span) -> str:
    """Every string a span carries (name, attributes, events, status), for scanning."""
    parts = [span.name, json.dumps(dict(span.attributes or {}), default=str), span.status.description or ""]
    parts += [json.dumps({"name": e.name, **dict(e.attributes or {})}, default=str) for e in span.events]
    return "\n".join(parts)


def _urls(spans) -> list[str]:
    return [str(s.attributes.get("url.full") or s.attributes.get("http.url")) for s in spans if s.attributes.get("url.full") or s.attributes.get("http.url")]


async def test_a_users_own_exporter_wrapped_gets_no_secret_full_inputs_and_no_internal_spans(monkeypatch):
    from openai import AsyncOpenAI

    monkeypatch.setattr(capture, "_provider", capture._provider)  # restored after the test
    monkeypatch.setattr(capture, "_tracer", capture._tracer)
    provider = TracerProvider()
    ti.configure_tracing(provider)
    ti.instrument("openai")
    bare, wrapped = InMemorySpanExporter(), InMemorySpanExporter()
    outbound = OutboundSpanExporter(wrapped)
    provider.add_span_processor(SimpleSpanProcessor(bare))
    provider.add_span_processor(SimpleSpanProcessor(outbound))
    instrumentor = httpx_instrumentation.HTTPXClientInstrumentor()
    instrumentor.instrument(tracer_provider=provider)

    def reply(body):
        from capture_fake_server import Reply

        results = [m for m in body["messages"] if m["role"] == "tool"]
        if not results:
            return Reply(tool_calls=[("lookup", {"query": "the key"})])
        return Reply(content="done")

    try:
        with FakeOpenAIServer(reply) as server, OTLPCollector(PK, SK) as collector:
            processor = ti.export_to_langfuse(collector.url, PK, SK, tracer_provider=provider)
            try:
                client = AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
                tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
                async with ti.rollout(task="outbound", group="g-outbound") as r:
                    messages = [{"role": "user", "content": f"my key is {SECRET}, look it up"}]
                    first = await client.chat.completions.create(model="m", messages=messages, tools=tools)
                    call = first.choices[0].message.tool_calls[0]
                    messages += [first.choices[0].message.model_dump(exclude_none=True),
                                 {"role": "tool", "tool_call_id": call.id, "content": f"found {SECRET}"}]  # fmt: skip
                    await client.chat.completions.create(model="m", messages=messages, tools=tools)
                    r.reward = 1.0
                # a score POST as tracerl sends it, from a thread whose instrumentation is not
                # suppressed (what an instrumentation that ignores the suppression records) ...
                score = {"traceId": r.trajectory.trace_id, "name": "by hand", "value": 1.0, "dataType": "NUMERIC"}
                httpx.post(collector.url + "/api/public/scores", json=score, auth=(PK, SK))
                httpx.get(collector.url + "/api/public/v2/prompts/support")  # ... and the user's other calls
                httpx.get(server.base_url + "/models")
                assert processor.force_flush()
                collector.wait_for(lambda: any(s.get("traceId") == r.trajectory.trace_id for s in collector.scores))
            finally:
                processor.shutdown()
    finally:
        instrumentor.uninstrument()
    trace_id = int(r.trajectory.trace_id, 16)
    chats = lambda spans: sorted((s for s in spans if s.name == "chat m"), key=lambda s: s.start_time)  # noqa: E731
    seen_bare, seen_wrapped = bare.get_finished_spans(), wrapped.get_finished_spans()
    # what the wrapper is for: the bare exporter gets the secret, a delta input, the request to Langfuse
    assert any(SECRET in _text(s) for s in seen_bare)
    assert sc.INPUT_BASE_SPAN_ID in chats(seen_bare)[1].attributes
    assert [u for u in _urls(seen_bare) if u.startswith(collector.url)] == [
        collector.url + "/api/public/scores", collector.url + "/api/public/v2/prompts/support"
    ]  # tracerl's own score POST (the reward) and export requests never became spans: sent suppressed
    # wrapped: no secret anywhere, the second call's whole input, no internal span; the rest all there
    assert not [s.name for s in seen_wrapped if SECRET in _text(s)]
    second = chats(seen_wrapped)[1]
    assert sc.INPUT_BASE_SPAN_ID not in second.attributes
    assert [m["role"] for m in json.loads(second.attributes[sc.INPUT_MESSAGES])] == ["user", "assistant", "tool"]
    assert [u for u in _urls(seen_wrapped) if u.startswith(collector.url)] == [collector.url + "/api/public/v2/prompts/support"]
    assert outbound.dropped_internal == 1
    assert {s.context.span_id for s in seen_wrapped} == {s.context.span_id for s in seen_bare} - {
        s.context.span_id for s in seen_bare if _urls([s]) == [collector.url + "/api/public/scores"]
    }
    assert any(s.context.trace_id == trace_id and s.parent is None for s in seen_wrapped)
    assert any(u.startswith(server.base_url) for u in _urls(seen_wrapped))  # the user's other HTTP calls stay
