"""Failures inside capture never reach the agent: they are counted and logged once."""

from __future__ import annotations

import logging

import pytest
from openai import AsyncOpenAI
from opentelemetry import trace

import tracerl.integrations as ti
from tracerl.integrations import semconv, spans
from tracerl.integrations.processor import get_tracer


@pytest.fixture(scope="module")
def server(served_fake):
    return served_fake


async def test_malformed_span_attribute_is_counted_and_logged_once(server, caplog):
    ti.reset_error_counts()
    client = AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    caplog.set_level(logging.WARNING, logger="tracerl.integrations")
    async with ti.rollout() as r:
        for _ in range(2):  # a foreign instrumentor writing garbage where JSON belongs
            with get_tracer().start_as_current_span("chat broken") as span:
                span.set_attribute(semconv.OPERATION_NAME, "chat")
                span.set_attribute(semconv.OUTPUT_MESSAGES, "{not json")
        response = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "ok"}])
    assert response.choices[0].message.content == "answer: ok"
    assert r.trajectory.messages_and_choices[-1].message["content"] == "answer: ok"
    assert r.trajectory.metrics["capture_errors"] == 2
    assert ti.capture_error_counts() == {"convert_span": 2}
    assert len([rec for rec in caplog.records if "convert_span" in rec.getMessage()]) == 1


async def test_exception_in_a_hook_never_reaches_the_agent(server, monkeypatch, caplog):
    ti.reset_error_counts()
    caplog.set_level(logging.WARNING, logger="tracerl.integrations")

    def explode(*args, **kwargs):
        raise RuntimeError("capture bug")

    monkeypatch.setattr(spans, "new_model_call", explode)  # response side: the call's record
    client = AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    async with ti.rollout() as r:
        for i in range(3):
            response = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q{i}"}])
            assert response.choices[0].message.content == f"answer: q{i}"
    assert ti.capture_error_counts() == {"openai_response": 3}
    assert len([rec for rec in caplog.records if "openai_response" in rec.getMessage()]) == 1
    assert r.trajectory is not None  # empty, but the rollout completed
    monkeypatch.setattr(spans, "new_span_id", explode)  # request side
    for i in range(3):
        response = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"o{i}"}])
        assert response.choices[0].message.content == f"answer: o{i}"
    assert ti.capture_error_counts() == {"openai_response": 3, "openai_request": 3}
    assert len([rec for rec in caplog.records if "openai_request" in rec.getMessage()]) == 1


async def test_processor_never_raises_into_span_end(monkeypatch):
    ti.reset_error_counts()
    processor = ti.configure_tracing()

    class Broken:
        context = None  # on_end reads span.context.trace_id

    processor.on_end(Broken())  # type: ignore[arg-type]
    assert ti.capture_error_counts() == {"processor_on_end": 1}


async def test_converter_failure_still_gives_a_trajectory(server, monkeypatch):
    ti.reset_error_counts()
    import tracerl.integrations.convert as convert

    monkeypatch.setattr(convert, "spans_to_trajectory", lambda *a, **k: 1 / 0)
    async with ti.rollout() as r:
        r.reward = 0.25
    assert r.trajectory.metrics["capture_failed"] == 1 and r.trajectory.reward == 0.25
    assert ti.capture_error_counts() == {"rollout_end": 1}


def test_spans_follow_genai_semconv(server):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider: TracerProvider = ti.get_tracer_provider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    from openai import OpenAI

    OpenAI(base_url=server.base_url, api_key="x").chat.completions.create(
        model="m", messages=[{"role": "user", "content": "semconv"}]
    )
    [span] = [s for s in exporter.get_finished_spans() if s.name == "chat m"]
    a = span.attributes
    assert span.kind == trace.SpanKind.CLIENT
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "openai"
    assert a["gen_ai.request.model"] == "m" and a["gen_ai.response.id"].startswith("chatcmpl-")
    assert a["gen_ai.response.finish_reasons"] == ("stop",)
    assert '"parts"' in a["gen_ai.input.messages"] and "semconv" in a["gen_ai.output.messages"]
    assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] > 0
