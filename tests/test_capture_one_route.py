"""One route: a hooked model call is a record (``integrations/recorded.py``), and the span made
from it for exporters says the same thing.

Every rollout below runs with an exporter attached; the trajectory built from the hooks' records
must equal, metrics included, the trajectory the converter reads back from the exported spans
(the token records joined by span id, as for any instrumentor's spans).  So what Langfuse or an
OTLP backend shows is what training got.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable

import pytest
from openai import AsyncOpenAI
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tracerl.integrations as ti
from tracerl.integrations import processor
from tracerl.integrations.convert import spans_to_trajectory
from tracerl.integrations.spans import finish_chat_span, start_chat_span

from capture_helpers import LOOKUP_TOOL, litellm_tool_agent, openai_tool_agent

_RANDOM = re.compile(r"(chatcmpl|call)-?_?[0-9a-f]{10,32}")


def _comparable(trajectory) -> str:
    return _RANDOM.sub("<id>", trajectory.model_dump_json(exclude={"id", "trace_id", "metadata", "logs"}))


async def _both_ways(provider, monkeypatch, run: Callable[[], Any]) -> tuple[Any, Any]:
    """``run()``'s trajectory, and the one its exported spans give."""
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    buffers = []
    end = processor.CaptureProcessor.end

    def keep(self, trace_id):
        buffer = end(self, trace_id)
        buffers.append(buffer)
        return buffer

    monkeypatch.setattr(processor.CaptureProcessor, "end", keep)
    trajectory = await run()
    (buffer,) = buffers
    spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == buffer.trace_id]
    records = [ended.call.record for ended in buffer.calls if ended.call is not None and ended.call.record is not None]
    again = spans_to_trajectory(spans, records, dropped_spans=buffer.dropped_spans)
    again.reward = trajectory.reward
    return trajectory, again


async def test_a_tool_agent(served_fake, own_provider, monkeypatch):
    client = AsyncOpenAI(base_url=served_fake.base_url, api_key="x", max_retries=0)

    async def run():
        async with ti.rollout(task="route-1") as r:
            await openai_tool_agent(client, "route-1")
        return r.trajectory

    recorded, exported = await _both_ways(own_provider, monkeypatch, run)
    calls = recorded.metrics["capture_model_calls"]
    assert calls >= 2 and recorded.metrics["capture_turns_with_token_ids"] == calls
    assert _comparable(recorded) == _comparable(exported)


async def test_streamed_calls(served_fake, own_provider, monkeypatch):
    client = AsyncOpenAI(base_url=served_fake.base_url, api_key="x", max_retries=0)

    async def run():
        async with ti.rollout(task="route-2") as r:
            await openai_tool_agent(client, "route-2", stream=True)
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "route-2 plain"}])
        return r.trajectory

    recorded, exported = await _both_ways(own_provider, monkeypatch, run)
    assert recorded.metrics["capture_model_calls"] >= 3
    assert _comparable(recorded) == _comparable(exported)


async def test_litellm_calls(served_fake, own_provider, monkeypatch):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    ti.instrument("litellm", "openai")

    async def run():
        async with ti.rollout() as r:
            await litellm_tool_agent(litellm, served_fake.base_url, "route-3", model="openai/m")
        return r.trajectory

    try:
        recorded, exported = await _both_ways(own_provider, monkeypatch, run)
    finally:
        ti.uninstrument("litellm")
    assert recorded.metrics["capture_model_calls"] >= 2
    assert _comparable(recorded) == _comparable(exported)


# -- the hook's own functions, on requests and completions no server sends us ------------------
_ODD_MESSAGES = [
    {"role": "system", "content": "rules", "name": "house"},
    {"role": "user", "content": [{"type": "text", "text": "look at "}, {"type": "image_url", "image_url": {"url": "x"}}]},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"b": 1,  "a": 2}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "done"},
    {"role": "user"},
]
_COMPLETIONS = {
    "tokens_on_the_response": {
        "id": "r1", "model": "served-m", "prompt_token_ids": [1, 2],
        "choices": [{"message": {"content": "hi"}, "finish_reason": "stop", "token_ids": [5, 6],
                     "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}]}}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 2},
    },
    "tool_call_no_model_no_usage": {
        "choices": [{"message": {"content": None, "tool_calls": [{"id": "c2", "function": {"name": "g", "arguments": "{}"}}]}}],
    },
    "usage_not_numbers": {"id": "r3", "choices": [{"message": {"content": "x"}}], "usage": {"prompt_tokens": "7", "completion_tokens": None}},
    "two_choices": {"id": "r4", "choices": [{"message": {"content": "a"}, "finish_reason": "length"}, {"message": {"content": "b"}}]},
    "no_choices": {"id": "r5", "choices": []},
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_COMPLETIONS))
async def test_a_completion_of_any_shape_is_read_alike(own_provider, monkeypatch, name):
    completion = _COMPLETIONS[name]

    async def run():
        with ti.rollout() as r:
            first = start_chat_span("openai", {"model": "asked-m", "tools": [LOOKUP_TOOL], "temperature": 0.5}, provider="openai", messages=_ODD_MESSAGES[:2])
            finish_chat_span(first, {"id": "r0", "choices": [{"message": {"content": "first"}, "finish_reason": "stop"}]})
            span = start_chat_span("openai", {"model": None}, provider="openai", messages=_ODD_MESSAGES)
            finish_chat_span(span, completion)
        return r.trajectory

    recorded, exported = await _both_ways(own_provider, monkeypatch, run)
    assert _comparable(recorded) == _comparable(exported)
    assert recorded.metrics["capture_spans"] == 3  # the root and both calls
    if name == "no_choices":
        assert recorded.metrics["capture_model_calls"] == 1


async def test_the_span_limit_counts_calls(own_provider, monkeypatch):
    previous = processor.get_processor().max_spans_per_rollout
    processor.get_processor().max_spans_per_rollout = 3
    try:

        async def run():
            with ti.rollout() as r:
                for index in range(5):
                    span = start_chat_span("openai", {"model": "m"}, provider="openai", messages=[{"role": "user", "content": f"q{index}"}])
                    finish_chat_span(span, {"id": f"r{index}", "choices": [{"message": {"content": f"a{index}"}}]})
            return r.trajectory

        recorded, _ = await _both_ways(own_provider, monkeypatch, run)
    finally:
        processor.get_processor().max_spans_per_rollout = previous
    assert recorded.metrics["capture_spans_dropped"] == 3  # 3 calls kept, the root span dropped as it ended last
    assert recorded.metrics["capture_model_calls"] == 3
