"""Model calls are records (``integrations/recorded.py``); spans for exporters are made from them.

Those spans must look exactly as if they had been created at call time: the same span id
their children already point to, the call's own start/end times, the request as it was when
the call was made (not after the agent appended to its message list).  Nobody listening, no
span is made at all.
"""

from __future__ import annotations

import json

import pytest
from openai import AsyncOpenAI
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tracerl.integrations as ti
from tracerl.integrations import processor, recorded, semconv


@pytest.fixture(scope="module")
def server(unserved_fake):
    return unserved_fake


@pytest.fixture()
def exported():
    exporter = InMemorySpanExporter()
    ti.get_tracer_provider().add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()  # the processor stays attached but exports nothing more


async def test_the_span_made_from_a_record_keeps_its_id_times_and_children(server, exported):
    client = AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    tracer = trace.get_tracer("test.lower.layer", tracer_provider=ti.get_tracer_provider())
    original = client.chat.completions._post  # a lower layer: a span made inside the SDK call

    async def post_with_child(*args, **kwargs):
        with tracer.start_as_current_span("lower layer"):
            return await original(*args, **kwargs)

    client.chat.completions._post = post_with_child
    messages = [{"role": "user", "content": "marker-D1"}]
    async with ti.rollout(task="d") as r:
        await client.chat.completions.create(model="m", messages=messages)
        messages.append({"role": "assistant", "content": "appended after the call"})
        assert [s.name for s in exported.get_finished_spans()] == ["lower layer"]  # chat span not made yet
    spans = {s.name: s for s in exported.get_finished_spans()}
    chat, child, root = spans["chat m"], spans["lower layer"], spans["rollout"]
    assert child.parent.span_id == chat.context.span_id  # the id the child saw during the call
    assert chat.parent.span_id == root.context.span_id
    assert chat.context.trace_id == root.context.trace_id == child.context.trace_id
    assert chat.start_time <= child.start_time <= child.end_time <= chat.end_time <= root.end_time
    sent = json.loads(chat.attributes[semconv.INPUT_MESSAGES])
    assert [m["parts"][0]["content"] for m in sent] == ["marker-D1"]  # snapshot, not the later list
    assert r.trajectory.metrics["capture_model_calls"] == 1


async def test_outside_a_rollout_spans_are_made_at_call_time(server, exported):
    client = AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "outside"}])
    assert [s.name for s in exported.get_finished_spans()] == ["chat m"]


async def test_long_rollouts_lose_nothing(server):
    client = AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    messages: list[dict] = []
    async with ti.rollout() as r:
        for i in range(11):  # one conversation of 11 turns
            messages.append({"role": "user", "content": f"q{i}"})
            response = await client.chat.completions.create(model="m", messages=messages)
            messages.append({"role": "assistant", "content": response.choices[0].message.content})
    contents = [c.message["content"] for c in r.trajectory.sampled_turns()]
    assert contents == [f"answer: q{i}" for i in range(11)]


async def test_a_call_still_running_when_the_rollout_ends_is_kept(server, exported):
    client = AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    async with ti.rollout() as r:
        stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "late"}], stream=True)
    chunks = [c async for c in stream]  # consumed after the rollout ended: the span is real by now
    assert chunks
    chat = [s for s in exported.get_finished_spans() if s.name == "chat m"]
    assert len(chat) == 1 and semconv.OUTPUT_MESSAGES in chat[0].attributes
    assert r.trajectory is not None


async def test_nobody_listening_no_span_is_made(server, monkeypatch):
    """On tracerl's own provider with no processor added, calls are records only."""
    made = []
    monkeypatch.setattr(recorded.ModelCallSpan, "emit", lambda self, tracer, ids: made.append(self))
    before = ti.get_tracer_provider()
    quiet = recorded.CaptureTracerProvider()
    processor.configure(quiet)
    try:
        client = AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        async with ti.rollout() as r:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "outside"}])
        assert not recorded.listening(quiet) and made == []
        assert r.trajectory.metrics["capture_model_calls"] == 1
        quiet.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))  # now someone listens
        async with ti.rollout():
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
        assert recorded.listening(quiet) and len(made) == 1
    finally:
        processor.configure(before)
