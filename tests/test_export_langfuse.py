"""What Langfuse shows for tracerl's traces: one generation per model request, trace-level
fields on every observation, the RULER judge, scores and training steps.

Every check goes through the loopback collector that decodes OTLP protobuf and maps each
span the way Langfuse's v4 ingestion does (``langfuse_mapping.py``); the agents are real
(a LangGraph ReAct agent with ``ChatOpenAI`` and one ``@tool``, LiteLLM, the OpenAI SDK)
against an OpenAI-compatible stand-in that reports usage like a hosted model.
"""

from __future__ import annotations

import os
import warnings

import pytest
from capture_fake_server import FakeOpenAIServer
from otlp_collector import OTLPCollector

import tracerl.integrations as ti
from tracerl.integrations import export

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
pytest.importorskip("langgraph")
pytestmark = pytest.mark.asyncio(loop_scope="session")  # langchain-openai caches one async client per process
PK, SK = "pk-lf-test", "sk-lf-test"


@pytest.fixture(scope="module")
def hosted():
    """A stand-in for a hosted model (not a tracerl endpoint): usage in every response."""
    ti.instrument("openai", "langchain", "litellm")
    with FakeOpenAIServer() as server:
        yield server


@pytest.fixture(scope="module")
def collector():
    with OTLPCollector(PK, SK) as c:
        yield c


@pytest.fixture()
def langfuse(collector, monkeypatch):
    for name in ("LANGFUSE_TRACING_ENVIRONMENT", "LANGFUSE_RELEASE"):
        monkeypatch.delenv(name, raising=False)
    ti.reset_error_counts()
    processor = ti.export_to_langfuse(collector.url, PK, SK)
    yield processor
    for active in list(export._active.values()):
        active.shutdown()


def react_agent(base_url: str):
    """A LangGraph ReAct agent built the LangGraph way: ``ChatOpenAI`` + one ``@tool``."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def lookup(query: str) -> str:
        """Look something up."""
        return f"found {query}"

    llm = ChatOpenAI(model="gpt-4o-mini", base_url=base_url, api_key="x", max_retries=0)
    try:
        from langchain.agents import create_agent  # LangChain 1.x
    except ImportError:
        from langgraph.prebuilt import create_react_agent as create_agent
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return create_agent(llm, [lookup])


def _served(server, first: int) -> tuple[int, int, int]:
    responses = server.responses[first:]
    return (
        len(responses),
        sum(r["usage"]["prompt_tokens"] for r in responses),
        sum(r["usage"]["completion_tokens"] for r in responses),
    )


async def test_react_agent_exports_one_generation_per_model_request(hosted, collector, langfuse):
    """Reported: 2 rollouts, 4 model requests -> 8 generations and twice the input tokens."""
    agent = react_agent(hosted.base_url)
    first = len(hosted.responses)
    trace_ids = []
    for question in ("one generation a", "one generation b"):
        async with ti.rollout(task=question, group="g-react") as r:
            await agent.ainvoke({"messages": [("user", question)]})
        trace_ids.append(r.trajectory.trace_id)
    assert langfuse.force_flush()
    requests, prompt_tokens, completion_tokens = _served(hosted, first)
    assert requests == 4
    generations = collector.generations(trace_ids)
    assert len(generations) == requests, [(g.name, g.parent_id) for g in generations]
    usage = collector.summed_usage(trace_ids)
    assert usage["input"] == prompt_tokens and usage["output"] == completion_tokens
    assert not [o.name for o in collector.observations(trace_ids) if o.would_tokenize]
