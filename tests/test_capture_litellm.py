"""Capture through the LiteLLM hook (non-streamed and streamed)."""

from __future__ import annotations

import os

import pytest
from capture_fake_server import FakeOpenAIServer
from capture_helpers import assert_tokens_match_server, litellm_tool_agent, roles, sampled

import tracerl.integrations as ti

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
litellm = pytest.importorskip("litellm")


@pytest.fixture(scope="module")
def server():
    ti.instrument("litellm", "openai")
    with FakeOpenAIServer() as srv:
        ti.register_endpoint(srv.base_url)
        yield srv
        ti.unregister_endpoint(srv.base_url)


async def test_litellm_tool_loop_is_captured_with_token_ids(server):
    async with ti.rollout() as r:
        await litellm_tool_agent(litellm, server.base_url, "lite-1", model="hosted_vllm/m")
    t = r.trajectory
    assert server.requests[-1]["return_token_ids"] is True
    assert roles(t.messages_and_choices) == ["user", "assistant", "tool", "assistant"]
    assert sampled(t)[-1].message["content"] == "answer: tool says lite-1"
    assert t.additional_histories == []
    assert_tokens_match_server(t, server.responses)


async def test_litellm_openai_provider_is_seen_once(server):
    async with ti.rollout() as r:
        await litellm.acompletion(model="openai/m", base_url=server.base_url, api_key="x", messages=[{"role": "user", "content": "lite-2"}])
    t = r.trajectory
    assert t.metrics["capture_model_calls"] == 1
    assert sampled(t)[0].message["content"] == "answer: lite-2"


async def test_litellm_streaming_and_sync(server):
    async with ti.rollout() as r:
        stream = await litellm.acompletion(
            model="hosted_vllm/m", base_url=server.base_url, api_key="x", messages=[{"role": "user", "content": "lite-3"}], stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        sync = litellm.completion(model="hosted_vllm/m", base_url=server.base_url, api_key="x", messages=[{"role": "user", "content": "lite-4"}])
    assert text == "answer: lite-3" and sync.choices[0].message.content == "answer: lite-4"
    finals = sorted(h.messages_and_choices[-1].message["content"] for h in r.trajectory.histories())
    assert finals == ["answer: lite-3", "answer: lite-4"]


@pytest.mark.parametrize("on_choice", [True, False], ids=["tracerl-server", "raw-vllm"])
async def test_litellm_streaming_keeps_exact_tokens(on_choice):
    """LiteLLM's stream wrapper drops unknown *chunk*-level fields but keeps choice-level ones;
    tracerl's servers put the prompt ids on the first chunk's choice, so they survive."""
    with FakeOpenAIServer(prompt_ids_on_choice=on_choice) as srv:
        ti.register_endpoint(srv.base_url)
        try:
            async with ti.rollout() as r:
                stream = await litellm.acompletion(
                    model="hosted_vllm/m", base_url=srv.base_url, api_key="x",
                    messages=[{"role": "user", "content": "lite-5"}], stream=True,
                )
                assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == "answer: lite-5"
        finally:
            ti.unregister_endpoint(srv.base_url)
    (turn,) = r.trajectory.sampled_turns()
    server_choice = srv.responses[-1]["choices"][0]
    assert turn.token_ids == server_choice["token_ids"]
    assert turn.logprobs == [e["logprob"] for e in server_choice["logprobs"]["content"]]
    assert turn.prompt_token_ids == (srv.responses[-1]["prompt_token_ids"] if on_choice else None)
