"""The converter on its own: foreign spans (OpenInference only, LangChain only), public API."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import tracerl
import tracerl.integrations as ti
from tracerl.integrations import semconv
from tracerl.integrations.processor import get_tracer

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # offline: instrument() may import litellm


def test_public_api_is_pinned_and_import_is_light():
    assert sorted(ti.__all__) == [
        "CaptureProcessor", "CaptureWarning", "OutboundSpanExporter", "Rollout", "TokenRecord", "capture_error_counts", "configure_tracing", "current_rollout",
        "export_scores", "export_to_langfuse", "export_to_otlp", "get_tracer_provider", "instrument", "is_tracerl_endpoint", "langgraph", "register_endpoint",
        "reset_error_counts", "rollout", "spans_to_trajectory", "trajectory", "trajectory_group", "uninstrument",
        "unregister_endpoint",
    ]
    code = "import sys, tracerl.integrations; print(sorted(m for m in ('litellm', 'langchain_core', 'torch', 'mcp', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_openinference_only_spans_still_make_a_trajectory():
    """No tracerl hook active: OpenInference-style LLM spans are read (no token ids then)."""
    tracer = get_tracer()
    with ti.rollout() as r:
        for turn, (question, answer) in enumerate([("oi q1", "oi a1"), ("oi q2", "oi a2")]):
            with tracer.start_as_current_span("ChatCompletion") as span:
                span.set_attribute(semconv.OI_SPAN_KIND, "LLM")
                span.set_attribute("llm.model_name", "gpt-x")
                span.set_attribute("llm.input_messages.0.message.role", "user")
                span.set_attribute("llm.input_messages.0.message.content", "oi q1")
                if turn:
                    span.set_attribute("llm.input_messages.1.message.role", "assistant")
                    span.set_attribute("llm.input_messages.1.message.content", "oi a1")
                    span.set_attribute("llm.input_messages.2.message.role", "user")
                    span.set_attribute("llm.input_messages.2.message.content", question)
                span.set_attribute("llm.output_messages.0.message.role", "assistant")
                span.set_attribute("llm.output_messages.0.message.content", answer)
                span.set_attribute("output.value", json.dumps({"id": f"resp-{turn}", "choices": []}))
    t = r.trajectory
    assert [m["content"] for m in t.messages()] == ["oi q1", "oi a1", "oi q2", "oi a2"]
    assert [c.response_id for c in t.sampled_turns()] == ["resp-0", "resp-1"]
    assert t.metrics["capture_turns_without_token_ids"] == 2 and t.metadata["models"] == ["gpt-x"]


async def test_langchain_layer_alone_captures_non_openai_chat_models():
    pytest.importorskip("langchain_core")
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage

    ti.instrument("langchain")
    model = GenericFakeChatModel(messages=iter([AIMessage(content="fake one"), AIMessage(content="fake two")]))
    async with ti.rollout() as r:
        first = await model.ainvoke([("system", "s"), ("user", "lc q")])
        await model.ainvoke([("system", "s"), ("user", "lc q"), first, ("user", "again")])
    t = r.trajectory
    assert [m["role"] for m in t.messages()] == ["system", "user", "assistant", "user", "assistant"]
    assert [c.message["content"] for c in t.sampled_turns()] == ["fake one", "fake two"]


def test_rollout_objects_are_single_use_and_nested_rollouts_are_separate():
    scope = ti.rollout()
    with scope:
        with ti.rollout() as inner:
            assert ti.current_rollout() is inner
        assert ti.current_rollout() is scope
    assert ti.current_rollout() is None
    assert inner.trajectory.trace_id != scope.trajectory.trace_id
    with pytest.raises(RuntimeError):
        scope.__enter__()
    assert isinstance(scope.trajectory, tracerl.Trajectory)


def test_instrument_is_idempotent_and_each_hook_works_alone():
    from openai.resources.chat.completions import AsyncCompletions

    active = ti.instrument()
    assert {"openai", "langchain", "mcp"} <= set(active)
    wrapped = AsyncCompletions.create
    assert ti.instrument("openai") == ["openai"] and AsyncCompletions.create is wrapped
    original = wrapped.__tracerl_original__
    assert not hasattr(original, "__tracerl_original__")  # never wrapped twice
    ti.uninstrument("openai")
    assert AsyncCompletions.create is original
    ti.instrument("openai")
    with pytest.raises(ValueError):
        ti.instrument("nonexistent")
