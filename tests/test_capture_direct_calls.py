"""Model calls recorded without a span when tracerl listens alone (``integrations/direct_calls.py``).

The record must be the one the converter reads from the span the SDK would have made: every
rollout below runs three ways — alone (direct records), alone with direct records switched off
(capture-only spans) and with an exporter attached (SDK spans) — and the trajectories, metrics
included, must be equal.  Calls that cannot be described without a span (streamed ones) still
make one.
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
from tracerl.integrations import deferred, processor
from tracerl.integrations.spans import finish_chat_span, start_chat_span

from capture_helpers import LOOKUP_TOOL, litellm_tool_agent, openai_tool_agent

_RANDOM = re.compile(r"(chatcmpl|call)-?_?[0-9a-f]{10,32}")


@pytest.fixture()
def counts(monkeypatch):
    """How many calls took the direct path, and the chat spans tracerl's processor received."""
    seen = {"direct": 0, "chat_spans": 0}
    add_call = deferred.CaptureOnlyTracer.add_call
    on_end = processor.CaptureProcessor.on_end

    def count_call(self, context, parent, call):
        seen["direct"] += 1
        add_call(self, context, parent, call)

    def count_span(self, span):
        seen["chat_spans"] += span.name.startswith("chat")
        on_end(self, span)

    monkeypatch.setattr(deferred.CaptureOnlyTracer, "add_call", count_call)
    monkeypatch.setattr(processor.CaptureProcessor, "on_end", count_span)
    return seen


def _comparable(trajectory) -> str:
    return _RANDOM.sub("<id>", trajectory.model_dump_json(exclude={"id", "trace_id", "metadata"}))


async def _three_ways(provider, monkeypatch, counts, run: Callable[[], Any]) -> list[Any]:
    """``run()``'s trajectory alone (direct), alone with spans, and observed by an exporter."""
    out = []
    out.append(await run())
    direct = counts["direct"]
    with monkeypatch.context() as patch:
        patch.setattr(deferred.CaptureOnlyTracer, "records_directly", lambda self, parent: False)
        out.append(await run())
    assert counts["direct"] == direct  # switched off: capture-only spans instead
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    out.append(await run())
    assert counts["direct"] == direct and exporter.get_finished_spans()
    return out


async def test_a_tool_agent_alone_gets_the_trajectory_its_spans_give(served_fake, own_provider, monkeypatch, counts):
    client = AsyncOpenAI(base_url=served_fake.base_url, api_key="x", max_retries=0)

    async def run():
        async with ti.rollout(task="direct-1") as r:
            await openai_tool_agent(client, "direct-1")
        return r.trajectory

    direct, spans, sdk = await _three_ways(own_provider, monkeypatch, counts, run)
    calls = direct.metrics["capture_model_calls"]
    assert calls >= 2 and direct.metrics["capture_turns_with_token_ids"] == calls
    assert counts["direct"] == calls  # every call of the first run took the direct path...
    assert counts["chat_spans"] == 2 * calls  # ...and made no span (the other two runs made them)
    assert _comparable(direct) == _comparable(spans) == _comparable(sdk)


async def test_streamed_calls_still_make_spans(served_fake, own_provider, monkeypatch, counts):
    client = AsyncOpenAI(base_url=served_fake.base_url, api_key="x", max_retries=0)

    async def run():
        async with ti.rollout(task="direct-2") as r:
            await openai_tool_agent(client, "direct-2", stream=True)
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "direct-2 plain"}])
        return r.trajectory

    direct, spans, sdk = await _three_ways(own_provider, monkeypatch, counts, run)
    assert counts["direct"] == 1  # the one call not streamed
    assert direct.metrics["capture_model_calls"] >= 3
    assert _comparable(direct) == _comparable(spans) == _comparable(sdk)


async def test_litellm_calls_alike(served_fake, own_provider, monkeypatch, counts):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    ti.instrument("litellm", "openai")

    async def run():
        async with ti.rollout() as r:
            await litellm_tool_agent(litellm, served_fake.base_url, "direct-3", model="openai/m")
        return r.trajectory

    try:
        direct, spans, sdk = await _three_ways(own_provider, monkeypatch, counts, run)
    finally:
        ti.uninstrument("litellm")
    calls = direct.metrics["capture_model_calls"]
    assert calls >= 2 and counts["direct"] == calls + direct.metrics["capture_duplicate_calls"]
    assert _comparable(direct) == _comparable(spans) == _comparable(sdk)


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
async def test_a_completion_of_any_shape_is_read_alike(own_provider, monkeypatch, counts, name):
    completion = _COMPLETIONS[name]

    async def run():
        with ti.rollout() as r:
            first = start_chat_span("openai", {"model": "asked-m", "tools": [LOOKUP_TOOL], "temperature": 0.5}, provider="openai", messages=_ODD_MESSAGES[:2])
            finish_chat_span(first, {"id": "r0", "choices": [{"message": {"content": "first"}, "finish_reason": "stop"}]})
            span = start_chat_span("openai", {"model": None}, provider="openai", messages=_ODD_MESSAGES)
            finish_chat_span(span, completion)
        return r.trajectory

    direct, spans, sdk = await _three_ways(own_provider, monkeypatch, counts, run)
    assert counts["direct"] == 2
    assert _comparable(direct) == _comparable(spans) == _comparable(sdk)
    assert direct.metrics["capture_spans"] == 3  # the root and both chat spans, made or not
    if name == "no_choices":
        assert direct.metrics["capture_model_calls"] == 1


async def test_the_span_limit_counts_calls_without_spans(own_provider, monkeypatch, counts):
    previous = processor.get_processor().max_spans_per_rollout
    processor.get_processor().max_spans_per_rollout = 3
    try:

        async def run():
            with ti.rollout() as r:
                for index in range(5):
                    span = start_chat_span("openai", {"model": "m"}, provider="openai", messages=[{"role": "user", "content": f"q{index}"}])
                    finish_chat_span(span, {"id": f"r{index}", "choices": [{"message": {"content": f"a{index}"}}]})
            return r.trajectory

        direct, spans, sdk = await _three_ways(own_provider, monkeypatch, counts, run)
    finally:
        processor.get_processor().max_spans_per_rollout = previous
    assert direct.metrics["capture_spans_dropped"] == 3  # 3 calls kept, the root span dropped as it ended last
    assert _comparable(direct) == _comparable(spans) == _comparable(sdk)
