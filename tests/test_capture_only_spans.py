"""Spans made without the SDK's live-span machinery when tracerl's processor listens alone.

The capture-only path (:class:`tracerl.integrations.deferred.CaptureOnlyTracer`) must give
the processor what the SDK path gives it — the same spans (names, ids, parents, kinds,
times, attributes) and so the same trajectory — and must step aside the moment anyone
else listens, or a span needs what only the SDK does (events, status, a dropping sampler).
"""

from __future__ import annotations

import json
import re

import pytest
from openai import AsyncOpenAI
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, Decision, ParentBased, Sampler, SamplingResult

import tracerl.integrations as ti
from tracerl.integrations import deferred, processor

from capture_helpers import openai_tool_agent

_RANDOM = re.compile(r"(chatcmpl|call)-?_?[0-9a-f]{10,32}")


@pytest.fixture()
def seen(monkeypatch):
    """Every span tracerl's processor receives, and which path made the chat spans."""
    spans: list[ReadableSpan] = []
    capture_only: list[str] = []
    on_end = processor.CaptureProcessor.on_end
    finish = deferred.CaptureOnlyTracer._finish

    def record(self, span):
        spans.append(span)
        on_end(self, span)

    def record_finish(self, span):
        capture_only.append(span.name)
        finish(self, span)

    monkeypatch.setattr(processor.CaptureProcessor, "on_end", record)
    monkeypatch.setattr(deferred.CaptureOnlyTracer, "_finish", record_finish)
    # calls that need no span at all skip it (test_capture_direct_calls.py): here they make one
    monkeypatch.setattr(deferred.CaptureOnlyTracer, "records_directly", lambda self, parent: False)
    return spans, capture_only


async def _run(client: AsyncOpenAI, question: str):
    async with ti.rollout(task=question) as r:
        await openai_tool_agent(client, question)
    return r.trajectory


def _comparable_trajectory(trajectory) -> str:
    dumped = trajectory.model_dump_json(exclude={"id", "trace_id", "metadata"})
    return _RANDOM.sub("<id>", dumped)


def _as_json(value: object) -> object:
    """A message list a capture-only span holds as itself, written as the SDK path's JSON."""
    if isinstance(value, tuple) and value and isinstance(value[0], dict):
        return json.dumps(list(value), default=str, ensure_ascii=False)
    return value


def _comparable_spans(spans: list[ReadableSpan]) -> list[tuple]:
    root = next(s for s in spans if s.parent is None)
    ids = {root.context.span_id: "root"}
    for index, span in enumerate(s for s in spans if s is not root):
        ids[span.context.span_id] = f"span{index}"
    out = []
    for span in spans:
        attributes = {k: _as_json(v) for k, v in span.attributes.items()}
        attributes = {
            k: ids.get(int(v, 16), v) if k.endswith("base_span_id") else _RANDOM.sub("<id>", v) if isinstance(v, str) else v
            for k, v in attributes.items()
        }
        attributes.pop("tracerl.rollout.id", None)
        attributes.pop("tracerl.rollout.task", None)
        assert span.start_time <= span.end_time
        assert span.context.trace_id == root.context.trace_id
        out.append(
            (
                span.name, span.kind, ids[span.context.span_id], ids.get(span.parent.span_id) if span.parent else None,
                span.resource.attributes.get("service.name"), span.instrumentation_scope.name, sorted(attributes.items()),
                [e.name for e in span.events], span.status.status_code,
            )
        )  # fmt: skip
    return out


async def test_alone_the_spans_and_trajectory_are_the_sdks(served_fake, own_provider, seen):
    spans, capture_only = seen
    client = AsyncOpenAI(base_url=served_fake.base_url, api_key="x", max_retries=0)
    alone = await _run(client, "capture-only-marker")
    alone_spans = list(spans)
    assert capture_only == ["chat m"] * alone.metrics["capture_model_calls"]  # the fast path made every chat span
    assert alone.metrics["capture_model_calls"] >= 2 and alone.metrics["capture_turns_with_token_ids"] >= 2

    exporter = InMemorySpanExporter()
    own_provider.add_span_processor(SimpleSpanProcessor(exporter))  # someone else listens now
    spans.clear()
    capture_only.clear()
    observed = await _run(client, "capture-only-marker")
    assert capture_only == []  # the SDK made them
    assert len(exporter.get_finished_spans()) == len(spans)

    assert _comparable_trajectory(alone) == _comparable_trajectory(observed)
    assert _comparable_spans(alone_spans) == _comparable_spans(list(spans))
    for span in alone_spans:
        assert all(not isinstance(v, list) for v in span.attributes.values())  # lists as tuples, as the SDK keeps them
    chats = [s for s in alone_spans if s.name.startswith("chat")]
    for span in chats:  # the messages stay objects (no JSON round trip); the SDK's spans hold JSON
        assert isinstance(span.attributes["gen_ai.output.messages"], tuple)
        assert isinstance(span.attributes["gen_ai.input.messages"], tuple)
    assert all(isinstance(s.attributes["gen_ai.output.messages"], str) for s in spans if s.name.startswith("chat"))


class _DropChat(Sampler):
    """Records every span but model calls (a user's sampler the fast path must obey)."""

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None):
        if name.startswith("chat"):
            return SamplingResult(Decision.DROP)
        return ALWAYS_ON.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return "DropChat"


@pytest.mark.parametrize("sampler", [_DropChat(), ParentBased(ALWAYS_ON, local_parent_sampled=_DropChat())], ids=["own", "parent_based"])
async def test_a_sampler_that_drops_is_obeyed(served_fake, seen, sampler):
    spans, capture_only = seen
    previous = ti.get_tracer_provider()
    ti.configure_tracing(TracerProvider(sampler=sampler))
    try:
        client = AsyncOpenAI(base_url=served_fake.base_url, api_key="x", max_retries=0)
        trajectory = await _run(client, "dropped")
    finally:
        ti.configure_tracing(previous)
    assert capture_only == []
    assert [s.name for s in spans] == ["rollout"]
    assert trajectory.metrics["capture_model_calls"] == 0


def test_a_span_with_events_or_status_takes_the_sdk_path(own_provider):
    """Anything but attributes recorded on a deferred span, or a call not ended yet: the SDK makes it."""
    calls: list[object] = []
    errors_before = sum(ti.capture_error_counts().values())

    def start(*, context=None, start_time=None, tracer=None):
        calls.append(tracer)
        return (tracer or processor.get_tracer()).start_span("chat x", context=context, start_time=start_time)

    with ti.rollout() as r:
        pending = r.pending_spans
        plain = pending.open(start)
        plain.set_attribute("a", 1)
        plain.end()
        failed = pending.open(start)
        failed.record_exception(ValueError("boom"))
        failed.end()
        running = pending.open(start)  # a call still running at materialisation (a stream not read yet)
        pending.materialize()
        running.record_exception(ValueError("the stream broke later"))  # reaches an SDK span
        running.end()
    assert isinstance(calls[0], deferred.CaptureOnlyTracer)
    assert calls[1] is None and calls[2] is None
    assert r.trajectory is not None
    assert sum(ti.capture_error_counts().values()) == errors_before  # nothing failed inside capture


async def test_moving_capture_back_to_a_provider_does_not_attach_it_twice(served_fake):
    """configure_tracing(A), (B), (A) again: each span still reaches its rollout once."""
    previous = ti.get_tracer_provider()
    first, second = TracerProvider(), TracerProvider()
    client = AsyncOpenAI(base_url=served_fake.base_url, api_key="x", max_retries=0)
    try:
        for provider in (first, second, first):
            ti.configure_tracing(provider)
            trajectory = await _run(client, "moved")
            assert trajectory.metrics["capture_duplicate_calls"] == 0
            assert trajectory.metrics["capture_spans"] == trajectory.metrics["capture_model_calls"] + 1  # + the root
        assert len(first._active_span_processor._span_processors) == 1
    finally:
        ti.configure_tracing(previous)
