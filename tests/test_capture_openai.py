"""Capture through the OpenAI SDK hook against a local OpenAI-compatible server (real HTTP)."""

from __future__ import annotations

import asyncio

import pytest
from capture_fake_server import FakeOpenAIServer
from capture_helpers import LOOKUP_TOOL, assert_tokens_match_server, openai_tool_agent, roles, sampled
from openai import AsyncOpenAI, OpenAI

import tracerl
import tracerl.integrations as ti


@pytest.fixture(scope="module")
def server(served_fake):
    return served_fake


@pytest.fixture()
def client(served_client):
    return served_client


async def test_multi_turn_tool_agent_becomes_one_trajectory_with_exact_tokens(server, client):
    async with ti.rollout(task="q1") as r:
        answer = await openai_tool_agent(client, "marker-Q1")
    t = r.trajectory
    assert answer == "answer: looked up: marker-Q1"
    assert roles(t.messages_and_choices) == ["system", "user", "assistant", "tool", "assistant"]
    first, second = sampled(t)
    assert first.message["tool_calls"][0]["function"]["name"] == "lookup"
    assert t.messages_and_choices[3]["tool_call_id"] == first.message["tool_calls"][0]["id"]
    assert second.message["content"] == answer
    assert_tokens_match_server(t, server.responses)
    assert t.tools == [LOOKUP_TOOL]
    assert t.additional_histories == []
    assert t.metrics["capture_model_calls"] == 2 and t.metrics["capture_turns_with_token_ids"] == 2
    assert t.metadata["task"] == "q1" and t.trace_id


async def test_streamed_calls_are_reassembled(server, client):
    async with ti.rollout() as r:
        answer = await openai_tool_agent(client, "marker-S", stream=True)
    t = r.trajectory
    assert answer == "answer: looked up: marker-S"
    first, second = sampled(t)
    call = first.message["tool_calls"][0]
    assert call["function"]["name"] == "lookup" and call["function"]["arguments"] == '{"query": "marker-S"}'
    assert second.message["content"] == answer
    assert_tokens_match_server(t, server.responses)


def test_sync_client_sync_rollout_and_streaming(server):
    client = OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    with ti.rollout() as r:
        response = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "sync-1"}])
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "sync-2"}], stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert response.choices[0].message.content == "answer: sync-1" and text == "answer: sync-2"
    t = r.trajectory
    assert len(t.additional_histories) == 1  # two unrelated conversations
    contents = sorted(h.messages_and_choices[-1].message["content"] for h in t.histories())
    assert contents == ["answer: sync-1", "answer: sync-2"]
    assert_tokens_match_server(t, server.responses)


async def test_token_ids_are_requested_only_from_tracerl_endpoints(server):
    other = FakeOpenAIServer(token_truth=False).start()  # any other OpenAI-compatible server
    try:
        plain = AsyncOpenAI(base_url=other.base_url, api_key="x", max_retries=0)
        async with ti.rollout() as r:
            await plain.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert "return_token_ids" not in other.requests[-1] and "logprobs" not in other.requests[-1]
        choice = sampled(r.trajectory)[0]
        assert choice.token_ids is None and choice.message["content"] == "answer: hi"
        assert r.trajectory.metrics["capture_turns_without_token_ids"] == 1
    finally:
        other.stop()
    ours = AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    await ours.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], extra_body={"seed": 1})
    assert server.requests[-1]["return_token_ids"] is True and server.requests[-1]["logprobs"] is True
    assert server.requests[-1]["seed"] == 1


async def test_raw_response_path_is_captured(server, client):
    async with ti.rollout() as r:
        raw = await client.chat.completions.with_raw_response.create(model="m", messages=[{"role": "user", "content": "raw"}])
        assert raw.parse().choices[0].message.content == "answer: raw"
    assert sampled(r.trajectory)[0].message["content"] == "answer: raw"
    assert_tokens_match_server(r.trajectory, server.responses)


async def test_decorator_trajectory_and_group_forms(server, client):
    @ti.rollout(task="deco")
    async def agent(question: str) -> float:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}])
        return 0.5

    t = await agent("deco-1")
    assert isinstance(t, tracerl.Trajectory) and t.reward == 0.5 and t.metadata["task"] == "deco"

    async def attempt(question: str) -> str:
        response = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}])
        return response.choices[0].message.content

    t2 = await ti.trajectory(attempt("coro-1"), task="coro")
    assert t2.metadata["output"] == "answer: coro-1" and sampled(t2)[0].message["content"] == "answer: coro-1"

    async def failing() -> None:
        raise RuntimeError("boom")

    group = await ti.trajectory_group([attempt("g-1"), attempt("g-2"), failing()], task="g")
    assert len(group.trajectories) == 2 and len(group.exceptions) == 1
    assert group.exceptions[0].type == "RuntimeError"
    assert sorted(sampled(t)[0].message["content"] for t in group) == ["answer: g-1", "answer: g-2"]


async def test_reward_metrics_and_agent_errors_pass_through(server, client):
    bad = AsyncOpenAI(base_url=server.base_url.replace("/v1", "/nope"), api_key="x", max_retries=0)
    with pytest.raises(Exception) as info:
        async with ti.rollout() as r:
            r.reward = 1.0
            r.metrics["turns"] = 1
            await bad.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert "404" in str(info.value) or "Not Found" in str(info.value)
    assert r.trajectory is not None and r.trajectory.reward == 1.0 and r.trajectory.metrics["turns"] == 1


async def test_gather_and_tasks_inherit_the_rollout(server, client):
    async def one(q: str) -> None:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": q}])

    async with ti.rollout() as r:
        await asyncio.gather(one("a"), asyncio.create_task(one("b")))
        await asyncio.to_thread(
            lambda: OpenAI(base_url=server.base_url, api_key="x").chat.completions.create(
                model="m", messages=[{"role": "user", "content": "c"}]
            )
        )
    finals = sorted(h.messages_and_choices[-1].message["content"] for h in r.trajectory.histories())
    assert finals == ["answer: a", "answer: b", "answer: c"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_replys_reasoning_is_kept_in_its_turn(served_fake, stream):
    """``reasoning_content`` (vLLM's reasoning parsers, tracerl's servers for Qwen3 and gpt-oss) stays on the
    captured turn, whole or streamed, so the trainer's re-rendering shows the model its own reasoning."""
    from capture_fake_server import FakeOpenAIServer, Reply

    with FakeOpenAIServer(script=lambda body: Reply(content="Paris.", reasoning="The capital.")) as srv:
        ti.register_endpoint(srv.base_url)
        try:
            client = AsyncOpenAI(base_url=srv.base_url, api_key="x")
            async with ti.rollout() as r:
                reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Capital?"}], stream=stream)
                if stream:
                    async for _ in reply:
                        pass
        finally:
            ti.unregister_endpoint(srv.base_url)
    (turn,) = sampled(r.trajectory)
    assert turn.message["content"] == "Paris." and turn.message["reasoning_content"] == "The capital."
    assert turn.token_ids == srv.responses[-1]["choices"][0]["token_ids"]
