"""OpenInference's instrumentors beside ours: still one Langfuse generation per model request.

Their OpenAI span nests inside ours, their LiteLLM span around ours, and their LangChain
span stands beside ours (never current): each of these layers is exported as a plain
span, and only the call closest to the wire is the generation carrying the usage.
"""

from __future__ import annotations

import os

import pytest
from capture_fake_server import FakeOpenAIServer
from capture_helpers import openinference_beside_tracerl
from otlp_collector import OTLPCollector
from test_export_langfuse import PK, SK, _served, react_agent

import tracerl.integrations as ti
from tracerl.integrations import export

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
pytest.importorskip("openinference.instrumentation.openai")
pytest.importorskip("openinference.instrumentation.litellm")
pytest.importorskip("openinference.instrumentation.langchain")
pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture(scope="module")
def hosted():
    with openinference_beside_tracerl(), FakeOpenAIServer() as server:
        yield server


@pytest.fixture()
def collector(hosted):
    with OTLPCollector(PK, SK) as c:
        processor = ti.export_to_langfuse(c.url, PK, SK)
        yield c
        processor.shutdown()
    assert not export.otlp.active()


async def test_react_agent_with_openinference_is_one_generation_per_request(hosted, collector):
    agent = react_agent(hosted.base_url)
    first = len(hosted.responses)
    async with ti.rollout(task="oi react", group="g-oi") as r:
        await agent.ainvoke({"messages": [("user", "oi react")]})
    assert export.otlp.active() and all(p.force_flush() for p in export.otlp.active())
    requests, prompt_tokens, completion_tokens = _served(hosted, first)
    trace_id = r.trajectory.trace_id
    kinds = {s.scope for s in collector.trace(trace_id)}
    assert any(k.startswith("openinference.instrumentation.langchain") for k in kinds)  # their spans are exported too
    generations = collector.generations(trace_id)
    assert requests == 2 and len(generations) == requests, [(g.name, g.id, g.parent_id) for g in generations]
    usage = collector.summed_usage(trace_id)
    assert usage["input"] == prompt_tokens and usage["output"] == completion_tokens
    assert not [o.name for o in collector.observations(trace_id) if o.would_tokenize]
    assert {(o.trace_name, o.session_id) for o in collector.observations(trace_id)} == {("rollout", "g-oi")}


async def test_litellm_with_openinference_is_one_generation_per_request(hosted, collector):
    import litellm

    first = len(hosted.responses)
    async with ti.rollout(task="oi litellm") as r:
        for q in ("oi litellm 1", "oi litellm 2"):
            await litellm.acompletion(
                model="openai/gpt-4o-mini", api_base=hosted.base_url, api_key="x", messages=[{"role": "user", "content": q}]
            )
    assert all(p.force_flush() for p in export.otlp.active())
    requests, prompt_tokens, _ = _served(hosted, first)
    trace_id = r.trajectory.trace_id
    assert r.trajectory.metrics["capture_duplicate_calls"] >= 2  # OpenInference's LiteLLM and OpenAI spans
    assert len(collector.generations(trace_id)) == requests == 2
    assert collector.summed_usage(trace_id)["input"] == prompt_tokens
    assert not [o.name for o in collector.observations(trace_id) if o.would_tokenize]
