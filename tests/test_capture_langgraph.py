"""LangGraph / LangChain agents run unchanged; their model calls and tool runs are captured."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from capture_fake_server import FakeOpenAIServer, Reply
from capture_helpers import assert_tokens_match_server, parallel_branches_graph, roles, sampled

import tracerl
import tracerl.integrations as ti

pytest.importorskip("langgraph")
# langchain-openai caches one async HTTP client per process: keep this module on one event loop
pytestmark = pytest.mark.asyncio(loop_scope="session")
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from langchain.agents import create_agent  # noqa: E402


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def word_length(word: str) -> int:
    """Number of letters in a word."""
    return len(word)


def two_tool_script(body: dict[str, Any]) -> Reply:
    messages = body["messages"]
    results = [m for m in messages if m["role"] == "tool"]
    question = next(m["content"] for m in messages if m["role"] == "user")
    if body.get("tools") and len(results) == 0:
        return Reply(tool_calls=[("add", {"a": 2, "b": 3})])
    if body.get("tools") and len(results) == 1:
        return Reply(tool_calls=[("word_length", {"word": question.split()[-1]})])
    return Reply(content="done: " + ",".join(str(m["content"]) for m in results) + f" for {question}")


@pytest.fixture(scope="module")
def server():
    ti.instrument("openai", "langchain")
    with FakeOpenAIServer(two_tool_script) as srv:
        ti.register_endpoint(srv.base_url)
        yield srv
        ti.unregister_endpoint(srv.base_url)


def make_agent(server) -> Any:
    llm = ChatOpenAI(model="policy", base_url=server.base_url, api_key="x", max_retries=0)
    return create_agent(llm, [add, word_length], system_prompt="Use the tools.")


def check_react_trajectory(t: tracerl.Trajectory, question: str, server) -> None:
    assert roles(t.messages_and_choices) == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    first, second, final = sampled(t)
    items = t.messages_and_choices
    assert first.message["tool_calls"][0]["function"]["name"] == "add"
    assert items[3]["content"] == "5" and items[3]["tool_call_id"] == first.message["tool_calls"][0]["id"]
    assert second.message["tool_calls"][0]["function"]["name"] == "word_length"
    assert json.loads(second.message["tool_calls"][0]["function"]["arguments"]) == {"word": question.split()[-1]}
    assert items[5]["content"] == str(len(question.split()[-1]))
    assert final.message["content"] == f"done: 5,{len(question.split()[-1])} for {question}"
    assert_tokens_match_server(t, server.responses)
    assert {s["function"]["name"] for s in t.tools} == {"add", "word_length"}
    assert t.metrics["capture_model_calls"] == 3 and t.metrics["capture_duplicate_calls"] == 3  # langchain + openai
    assert t.metrics["capture_tool_runs"] == 2 and t.additional_histories == []


async def test_react_agent_runs_unchanged_and_is_captured_once(server):
    agent = make_agent(server)
    async with ti.rollout(task="react") as r:
        result = await agent.ainvoke({"messages": [("user", "how long is marker")]})
    assert result["messages"][-1].content == "done: 5,6 for how long is marker"
    check_react_trajectory(r.trajectory, "how long is marker", server)


async def test_sync_graph_in_a_worker_thread(server):
    agent = make_agent(server)
    async with ti.rollout() as r:
        await asyncio.to_thread(agent.invoke, {"messages": [("user", "sync threaded")]})
    check_react_trajectory(r.trajectory, "sync threaded", server)


async def test_streamed_graph_run(server):
    agent = make_agent(server)
    async with ti.rollout() as r:
        async for _ in agent.astream({"messages": [("user", "streamed run")]}, stream_mode="messages"):
            pass
    check_react_trajectory(r.trajectory, "streamed run", server)


async def test_concurrent_graph_rollouts_stay_apart(server):
    agent = make_agent(server)
    questions = [f"q{i} word{i}" for i in range(6)]

    async def run(q: str) -> None:
        await agent.ainvoke({"messages": [("user", q)]})

    group = await ti.trajectory_group([run(q) for q in questions], task="many")
    finals = sorted(sampled(t)[-1].message["content"] for t in group)
    assert finals == sorted(f"done: 5,{len(q.split()[-1])} for {q}" for q in questions)


async def test_parallel_branches_become_additional_histories(server):
    llm = ChatOpenAI(model="policy", base_url=server.base_url, api_key="x", max_retries=0)
    app = parallel_branches_graph(llm)
    async with ti.rollout() as r:
        await app.ainvoke({"topic": "cats"})
    t = r.trajectory
    assert len(t.additional_histories) == 1
    finals = sorted(h.messages_and_choices[-1].message["content"] for h in t.histories())
    assert finals == ["done:  for branch A cats", "done:  for branch B cats"]
    assert_tokens_match_server(t, server.responses)


async def test_init_chat_model_binds_a_trainable_model(server):
    model = tracerl.TrainableModel("agent", "capture", "smollm2-135m", inference_base_url=server.base_url)
    model._step_cache = 3
    from tracerl.integrations.langgraph import init_chat_model

    llm = init_chat_model(model)
    assert isinstance(llm, ChatOpenAI) and llm.model_name == "agent@3"
    assert ti.is_tracerl_endpoint(server.base_url)


async def test_subgraph_agent_inside_a_graph_becomes_an_additional_history(server):
    from langgraph.graph import END, START, StateGraph
    from typing_extensions import TypedDict

    llm = ChatOpenAI(model="policy", base_url=server.base_url, api_key="x", max_retries=0)
    sub_agent = make_agent(server)  # a compiled ReAct graph used as a node of the outer graph

    class State(TypedDict, total=False):
        question: str
        messages: list
        final: str

    async def prepare(state: State) -> State:
        return {"messages": [("user", f"research {state['question']}")]}

    async def answer(state: State) -> State:
        return {"final": (await llm.ainvoke(f"summarize {state['messages'][-1].content}")).content}

    graph = StateGraph(State)
    graph.add_node("prepare", prepare)
    graph.add_node("research", sub_agent)
    graph.add_node("answer", answer)
    graph.add_edge(START, "prepare")
    graph.add_edge("prepare", "research")
    graph.add_edge("research", "answer")
    graph.add_edge("answer", END)
    app = graph.compile()
    async with ti.rollout() as r:
        out = await app.ainvoke({"question": "topic"})
    t = r.trajectory
    assert out["final"] == "done:  for summarize done: 5,5 for research topic"
    # the last call (the summary) is the main history; the sub-agent's conversation is kept beside it
    assert [m["role"] for m in t.messages()] == ["user", "assistant"]
    [sub] = t.additional_histories
    assert [m["role"] for m in sub.messages()] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert_tokens_match_server(t, server.responses)
