"""Capture with the real SmolLM2-135M served by tracerl's transformers server.

A LangGraph ReAct agent with two tools (``examples/langgraph_agent.py``), its
``ChatOpenAI`` pointed at the served model and the graph left unchanged, yields
trajectories whose sampled turns carry exactly the token ids and logprobs the server
sent, tool calls and tool results in order; one GRPO step then trains on them.

Run with:  flock /tmp/tracerl-heavy.lock .venv/bin/python -m pytest -m real_model tests/test_capture_real_model.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

import tracerl
from capture_helpers import served_and_recorded
import tracerl.integrations as ti

pytestmark = [pytest.mark.real_model, pytest.mark.asyncio(loop_scope="session")]
pytest.importorskip("langgraph")
pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import langgraph_agent  # noqa: E402


@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    """A trainable model on a LocalBackend (transformers server); every answer the server gives, recorded."""
    async with served_and_recorded("capture-react", tmp_path_factory.mktemp("runs")) as served:
        yield served


@pytest.fixture(scope="module")
async def captured(served):
    model, backend, responses = served
    from langchain_openai import ChatOpenAI

    groups: list[tracerl.TrajectoryGroup] = []
    # The untrained 135M model calls a tool only sometimes: sample until it has, cooling the
    # temperature if needed (capture and the token checks do not depend on it).
    for temperature in (1.0, 1.0, 0.7, 0.5, 0.3, 0.3):
        # the user's graph, unchanged: a plain ChatOpenAI pointed at the served model
        llm = ChatOpenAI(
            model=model.get_inference_name(), base_url=model.inference_base_url, api_key=model.inference_api_key,
            temperature=temperature, max_tokens=40, max_retries=0,
        )
        agent = langgraph_agent.build_agent(llm)
        groups += await langgraph_agent.collect(agent, model, rollouts_per_question=3, recursion_limit=5)
        if any(_tool_calls(t) for g in groups for t in g.trajectories):
            break
    return groups


def _tool_calls(t: tracerl.Trajectory) -> int:
    return sum(len(c.message.get("tool_calls") or ()) for c in t.sampled_turns())


def _check_order(items: list[Any]) -> int:
    """Every tool call is answered by tool messages (same ids, same order) right after it."""
    tool_calls_seen = 0
    for index, item in enumerate(items):
        if isinstance(item, tracerl.Choice) and item.message.get("tool_calls"):
            ids = [call["id"] for call in item.message["tool_calls"]]
            following = [m.get("tool_call_id") for m in items[index + 1 : index + 1 + len(ids)] if isinstance(m, dict)]
            if following:  # the last turn's calls may be unanswered when the step limit hit
                assert following == ids[: len(following)]
            tool_calls_seen += len(ids)
    return tool_calls_seen


async def test_react_agent_trajectories_carry_the_servers_exact_tokens(served, captured):
    model, backend, responses = served
    by_id = {r["id"]: r for r in responses}
    trajectories = [t for g in captured for t in g.trajectories]
    assert len(trajectories) % 6 == 0 and not any(g.exceptions for g in captured)
    turns = tool_calls = 0
    for t in trajectories:
        print("roles:", [m["role"] for m in t.messages()], "reward:", t.reward, "last:", repr(t.messages()[-1].get("content"))[:80])
        items = t.messages_and_choices
        assert items[0]["role"] == "system" and items[1]["role"] == "user"
        assert {tool["function"]["name"] for tool in t.tools} == {"add", "multiply"}
        for choice in t.sampled_turns():
            response = by_id[choice.response_id]
            server_choice = response["choices"][0]
            assert choice.token_ids == server_choice["token_ids"]
            assert choice.prompt_token_ids == response["prompt_token_ids"]
            assert choice.logprobs == [e["logprob"] for e in server_choice["logprobs"]["content"]]
            assert len(choice.token_ids) == len(choice.logprobs) > 0
            turns += 1
        tool_calls += _check_order(items)
        assert t.metrics["capture_turns_without_token_ids"] == 0
    # every model call the server answered is in exactly one trajectory, once
    assert turns == len(responses)
    print(f"{len(trajectories)} trajectories, {turns} sampled turns, {tool_calls} tool calls")
    assert tool_calls >= 1, "no tool call sampled in 6 rounds: the tool-call path was not exercised"
    answered = [
        (t.messages_and_choices[i], t.messages_and_choices[i + 1])
        for t in trajectories
        for i, item in enumerate(t.messages_and_choices[:-1])
        if isinstance(item, tracerl.Choice) and item.message.get("tool_calls")
    ]
    for call_turn, result in answered:  # the tool result that follows is the graph's ToolMessage
        assert isinstance(result, dict) and result["role"] == "tool"
        assert result["tool_call_id"] == call_turn.message["tool_calls"][0]["id"]


async def test_one_training_step_on_captured_trajectories(served, captured):
    model, backend, _ = served
    groups = captured
    for group in groups:  # make sure GRPO sees variance even if the small model scored flat
        if len({t.reward for t in group}) == 1:
            for i, t in enumerate(group.trajectories):
                t.reward = float(i % 2)
    result = await backend.train(model, groups, learning_rate=1e-5)
    assert result.step == 1 and Path(result.checkpoint_path).exists()
    assert result.metrics.get("num_groups_trainable", 0) >= 1
    assert result.metrics.get("trained_tokens", 0) > 0
    # the next rollouts sample from the new adapter through the same capture
    client = model.openai_client()
    async with ti.rollout(model) as r:
        await client.chat.completions.create(
            model=model.get_inference_name(), messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
    assert r.trajectory.sampled_turns()[0].token_ids
    assert model.get_inference_name() == "capture-react@1"
