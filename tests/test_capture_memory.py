"""Bounded capture memory: a chat span stores only its new input messages (``input_delta.py``).

An agent resends its whole history each turn; spans that each held it made capture memory grow
with the square of the turns.  Conversion must rebuild exactly the trajectory it built from
full inputs, and what is exported must still carry each generation's full input.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import tracemalloc
from typing import Any

import pytest
from capture_helpers import openai_tool_agent
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tracerl.integrations as ti
from tracerl.integrations import input_delta, semconv as sc
from tracerl.integrations.messages import to_semconv
from tracerl.integrations.outbound import OutboundSpanExporter
from tracerl.integrations.processor import get_tracer_provider

session_loop = pytest.mark.asyncio(loop_scope="session")  # on the async tests only: a mark on sync ones warns


class Collect(SpanProcessor):
    """Keeps the spans that end while ``on`` (in end order, as exporters receive them)."""

    def __init__(self) -> None:
        self.on = False
        self.spans: list[Any] = []

    def on_end(self, span: Any) -> None:
        if self.on:
            self.spans.append(span)


@pytest.fixture(scope="module")
def server(unserved_fake):
    return unserved_fake  # no token ids asked: what is measured is the chat spans' inputs


@pytest.fixture()
def collect():
    processor = Collect()
    get_tracer_provider().add_span_processor(processor)
    processor.on = True
    yield processor
    processor.on, processor.spans = False, []


@pytest.fixture()
def client(server):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)


def _full_json(messages: list[dict[str, Any]]) -> str:
    """``gen_ai.input.messages`` as a span holding the whole input writes it."""
    return json.dumps([to_semconv(m) for m in messages], default=str, ensure_ascii=False)


async def chat_agent(client: Any, turns: int, *, chars: int = 200, tag: str = "", inputs: list[str] | None = None) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"{tag} turn {turn}: " + "x" * chars})
        if inputs is not None:
            inputs.append(_full_json(messages))
        response = await client.chat.completions.create(model="m", messages=messages)
        messages.append(response.choices[0].message.model_dump(exclude_none=True))


def _chats(spans: list[Any], trace_id: str) -> list[Any]:
    return [s for s in spans if f"{s.context.trace_id:032x}" == trace_id and s.name.startswith("chat ")]


@session_loop
async def test_chat_spans_store_each_turn_once(client, collect):
    inputs: list[str] = []
    async with ti.rollout() as r:
        await chat_agent(client, 40, inputs=inputs)
    assert r.trajectory.metrics["capture_model_calls"] == 40
    stored = sum(len(s.attributes[sc.INPUT_MESSAGES]) for s in _chats(collect.spans, r.trajectory.trace_id))
    assert stored <= 1.5 * len(inputs[-1])  # whole inputs would be ~20x the last one


async def _held_by_capture(client: Any, turns: int) -> int:
    """Memory held inside the rollout at its end plus the peak of ending it, above the agent's own."""
    gc.collect()
    tracemalloc.reset_peak()
    start = tracemalloc.get_traced_memory()[0]
    scope = ti.rollout()
    await scope.__aenter__()
    await chat_agent(client, turns)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    await scope.__aexit__(None, None, None)
    peak = tracemalloc.get_traced_memory()[1]
    assert scope.trajectory.metrics["capture_model_calls"] == turns
    return (held - start) + (peak - held)


@session_loop
async def test_capture_memory_grows_linearly_with_the_turns(client, server, monkeypatch):
    for name in ("requests", "responses"):  # the test server in this process would keep every request body
        monkeypatch.setattr(server, name, collections.deque(maxlen=1))
    tracemalloc.start()
    try:
        await _held_by_capture(client, 5)  # warm caches (SDK, pydantic) before measuring
        short, long = await _held_by_capture(client, 30), await _held_by_capture(client, 60)
    finally:
        tracemalloc.stop()
    assert long / short < 2.8, (short, long)  # linear: ~2; a square law: ~4


@session_loop
async def test_conversion_and_export_rebuild_the_full_inputs_exactly(client, collect):
    """Two conversations interleaved in one rollout, plus a tool loop: deltas pick the right base;
    the converter and the exporter both rebuild exactly the inputs a whole-input span held."""
    inputs_a: list[str] = []
    inputs_b: list[str] = []
    async with ti.rollout() as r:
        await asyncio.gather(chat_agent(client, 6, tag="A", inputs=inputs_a), chat_agent(client, 5, tag="B", inputs=inputs_b))
        await openai_tool_agent(client, "tools too")
    spans = [s for s in collect.spans if f"{s.context.trace_id:032x}" == r.trajectory.trace_id]
    chats = _chats(spans, r.trajectory.trace_id)
    assert sum(sc.INPUT_BASE_SPAN_ID in s.attributes for s in chats) >= 9  # most calls stored a delta

    exported = InMemorySpanExporter()
    assert OutboundSpanExporter(exported).export(spans) is SpanExportResult.SUCCESS
    full = [s for s in exported.get_finished_spans() if s.name.startswith("chat ")]
    assert all(sc.INPUT_BASE_SPAN_ID not in s.attributes and sc.INPUT_PREFIX_LENGTH not in s.attributes for s in full)
    exported_inputs = [s.attributes[sc.INPUT_MESSAGES] for s in full]
    assert [i for i in exported_inputs if '"A turn' in i] == inputs_a
    assert [i for i in exported_inputs if '"B turn' in i] == inputs_b

    from_deltas = ti.spans_to_trajectory(spans)
    from_full = ti.spans_to_trajectory(exported.get_finished_spans())
    assert from_deltas.model_dump(exclude={"id"}) == from_full.model_dump(exclude={"id"})
    assert from_deltas.metrics["capture_histories"] == 3 and from_deltas.metrics["capture_errors"] == 0
    assert [h.messages() for h in from_deltas.histories()] == [h.messages() for h in r.trajectory.histories()]


@session_loop
async def test_a_missing_base_is_counted_and_the_rest_is_kept(client, collect):
    async with ti.rollout() as r:
        await chat_agent(client, 3)
    chats = _chats(collect.spans, r.trajectory.trace_id)
    without_first = [s for s in chats if s is not chats[0]]
    trajectory = ti.spans_to_trajectory(without_first)
    assert trajectory.metrics["capture_model_calls"] == 2 and trajectory.metrics["capture_errors"] >= 1

    exported = InMemorySpanExporter()
    OutboundSpanExporter(exported).export(without_first)  # the base never reached this exporter
    second = exported.get_finished_spans()[0]
    assert sc.INPUT_BASE_SPAN_ID in second.attributes  # left as a delta, marked as one


@session_loop
async def test_export_memory_is_bounded(client, collect):
    async with ti.rollout() as r:
        await chat_agent(client, 12, chars=1000)
    spans = [s for s in collect.spans if f"{s.context.trace_id:032x}" == r.trajectory.trace_id]

    class Sizes(InMemorySpanExporter):
        slices: list[int] = []

        def export(self, batch):
            self.slices.append(sum(len(s.attributes.get(sc.INPUT_MESSAGES, "")) for s in batch))
            return super().export(batch)

    inner = Sizes()
    outbound = OutboundSpanExporter(inner, max_batch_chars=20_000)
    outbound.expander.max_entries = 4
    assert outbound.export(spans) is SpanExportResult.SUCCESS
    assert len(inner.slices) > 1 and max(inner.slices) <= 20_000 + 14_000  # one span may overshoot a slice
    assert len(outbound.expander._inputs) == 4  # remembered inputs are bounded too
    assert outbound.expander.missing == 0  # each base was still remembered when its successor came
    assert len(inner.get_finished_spans()) == len(spans)


def test_recent_calls_compared_are_bounded():
    history = input_delta.InputHistory()
    for index in range(20):
        history.open("openai", [{"role": "user", "content": str(index)}], index + 1)
    assert len(history._recent["openai"]) == input_delta.RECENT_CALLS


@session_loop
async def test_a_base_that_ends_last_is_still_exported_first(collect):
    """Two calls in flight at once: the second continues the first's input (the shared system
    message) and returns first.  The exporter still receives the base before the delta."""
    from tracerl.integrations.spans import ChatAnswer, end_chat_span, start_chat_span

    system = {"role": "system", "content": "be brief"}
    async with ti.rollout() as r:
        first = start_chat_span("openai", {"model": "m", "messages": [system, {"role": "user", "content": "one"}]}, provider="openai")
        second = start_chat_span("openai", {"model": "m", "messages": [system, {"role": "user", "content": "two"}]}, provider="openai")
        assert second.request.base == (first.context.span_id, 1)
        for span in (second, first):
            end_chat_span(span, ChatAnswer([{"role": "assistant", "content": "ok"}], ["stop"]))
    chats = _chats(collect.spans, r.trajectory.trace_id)
    exported = InMemorySpanExporter()
    outbound = OutboundSpanExporter(exported)
    assert outbound.export(chats) is SpanExportResult.SUCCESS and outbound.expander.missing == 0
    inputs = [json.loads(s.attributes[sc.INPUT_MESSAGES]) for s in exported.get_finished_spans()]
    assert sorted(m[1]["parts"][0]["content"] for m in inputs) == ["one", "two"] and all(len(m) == 2 for m in inputs)
