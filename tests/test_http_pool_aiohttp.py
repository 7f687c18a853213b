"""``Model.openai_client()`` on ``tracerl.net.http_pool.AiohttpTransport``: the OpenAI SDK sees the
exceptions it always saw (refused -> ``APIConnectionError``, no answer -> ``APITimeoutError``, cut
mid-answer -> ``APIConnectionError``), streams arrive, one aiohttp session per event loop is closed
when its loop ends, and without aiohttp the client falls back to ``ShardedTransport``.

Faults are real: a port nobody listens on, a scripted server that hangs or drops its answer.
"""

from __future__ import annotations

import asyncio
import sys

import openai
import pytest
from capture_fake_server import FakeOpenAIServer, Reply

import tracerl
from tracerl.net.http_pool import AiohttpTransport, ShardedTransport, http_module_of, openai_transport
from tracerl.net.http_server import free_port

pytest.importorskip("aiohttp")


@pytest.fixture
def server():
    servers: list[FakeOpenAIServer] = []

    def start(script=None) -> FakeOpenAIServer:
        servers.append(FakeOpenAIServer(script) if script else FakeOpenAIServer())
        return servers[-1].start()

    yield start
    for s in servers:
        s.stop()


def _model(base_url: str, **options) -> tracerl.Model:
    return tracerl.Model("m", "aiohttp-transport", inference_base_url=base_url, inference_api_key="k", **options)


async def test_answers_and_streams_arrive(server):
    client = _model(server().base_url).openai_client()
    assert isinstance(client._client._transport, AiohttpTransport)
    whole = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert whole.choices[0].message.content == "answer: hi"
    stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    assert text == "answer: hi"


async def test_a_refused_connection_is_an_api_connection_error():
    client = _model(f"http://127.0.0.1:{free_port()}/v1").openai_client()
    with pytest.raises(openai.APIConnectionError) as caught:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert not isinstance(caught.value, openai.APITimeoutError)
    assert type(caught.value.__cause__).__name__ == "ConnectError"


async def test_no_answer_within_the_timeout_is_an_api_timeout_error(server):
    client = _model(server(lambda body: Reply(hang=True)).base_url, inference_timeout=0.5).openai_client()
    with pytest.raises(openai.APITimeoutError):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_cut_mid_body_is_an_api_connection_error(server, stream):
    client = _model(server(lambda body: Reply(content="long answer " * 50, drop=True)).base_url).openai_client()
    with pytest.raises(openai.APIConnectionError) as caught:
        answer = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], stream=stream)
        if stream:
            async for _ in answer:
                pass
    assert not isinstance(caught.value, openai.APITimeoutError)


def test_each_event_loop_gets_its_own_session_closed_when_the_loop_ends(server):
    model = _model(server().base_url)
    sessions = []

    async def call() -> str:
        answer = await model.openai_client().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        sessions.append(model.openai_client()._client._transport._sessions[asyncio.get_running_loop()])
        return answer.choices[0].message.content

    assert asyncio.run(call()) == asyncio.run(call()) == "answer: hi"  # the cached client, over two loops
    assert sessions[0] is not sessions[1] and all(s.closed for s in sessions)  # closed by the loop's end, not leaked


def test_without_aiohttp_the_client_falls_back_to_sharded_pools(monkeypatch):
    from openai import DefaultAsyncHttpxClient

    monkeypatch.setitem(sys.modules, "aiohttp", None)  # import aiohttp -> ImportError
    assert isinstance(openai_transport(http_module_of(DefaultAsyncHttpxClient)), ShardedTransport)
