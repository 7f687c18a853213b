"""With the OpenInference OpenAI, LiteLLM and LangChain instrumentors also active, each
model call still appears exactly once in the trajectory (and keeps its token ids)."""

from __future__ import annotations

import os

import pytest
from capture_fake_server import FakeOpenAIServer
from capture_helpers import assert_tokens_match_server, openai_tool_agent, openinference_beside_tracerl, roles, sampled

import tracerl.integrations as ti

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
pytest.importorskip("openinference.instrumentation.openai")
pytest.importorskip("openinference.instrumentation.litellm")
pytest.importorskip("openinference.instrumentation.langchain")
pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture(scope="module")
def openinference():
    with openinference_beside_tracerl(), FakeOpenAIServer() as server:
        ti.register_endpoint(server.base_url)
        yield server
        ti.unregister_endpoint(server.base_url)


def _layers(t):
    return t.metrics["capture_model_calls"], t.metrics["capture_duplicate_calls"]


async def test_openai_client_calls_appear_once(openinference):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=openinference.base_url, api_key="x", max_retries=0)
    async with ti.rollout() as r:
        await openai_tool_agent(client, "oi-openai")
    t = r.trajectory
    assert roles(t.messages_and_choices) == ["system", "user", "assistant", "tool", "assistant"]
    assert _layers(t) == (2, 2)  # OpenInference's span of each call was folded into ours
    assert_tokens_match_server(t, openinference.responses)


async def test_litellm_calls_appear_once(openinference):
    import litellm

    async with ti.rollout() as r:
        for q in ("oi-litellm-1", "oi-litellm-2"):
            await litellm.acompletion(
                model="hosted_vllm/m", base_url=openinference.base_url, api_key="x", messages=[{"role": "user", "content": q}]
            )
    t = r.trajectory
    assert t.metrics["capture_model_calls"] == 2 and t.metrics["capture_duplicate_calls"] >= 2
    finals = sorted(h.messages_and_choices[-1].message["content"] for h in t.histories())
    assert finals == ["answer: oi-litellm-1", "answer: oi-litellm-2"]
    assert_tokens_match_server(t, openinference.responses)


async def test_langgraph_calls_appear_once_with_correct_parents(openinference):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langchain.agents import create_agent

    @tool
    def lookup(query: str) -> str:
        """Look something up."""
        return f"found {query}"

    llm = ChatOpenAI(model="policy", base_url=openinference.base_url, api_key="x", max_retries=0)
    agent = create_agent(llm, [lookup])
    async with ti.rollout() as r:
        await agent.ainvoke({"messages": [("user", "oi-graph")]})
    t = r.trajectory
    assert roles(t.messages_and_choices) == ["user", "assistant", "tool", "assistant"]
    assert sampled(t)[-1].message["content"] == "answer: found oi-graph"
    assert t.metrics["capture_model_calls"] == 2 and t.additional_histories == []
    assert_tokens_match_server(t, openinference.responses)
    # every span of the rollout, OpenInference's included, is in the rollout's trace
    assert t.metrics["capture_spans"] > 6
