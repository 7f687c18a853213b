"""MCP over streamable HTTP: a real MCP server (``tests/mcp_http_server.py``, a child process on
loopback) reached through the SDK's streamable-HTTP client; ``list_tools`` / ``call_tool``
become spans and tool messages, in order, with the offered tools recorded."""

from __future__ import annotations

import json
from typing import Any

import pytest
from capture_fake_server import FakeOpenAIServer, Reply
from capture_helpers import assert_tokens_match_server, roles
from mcp_http_server import McpHttpServer

from tracerl.mcp_rl.server import tools_from_listing
from openai import AsyncOpenAI

import tracerl
import tracerl.integrations as ti
from tracerl.integrations.mcp_hook import mcp_field

pytest.importorskip("mcp")


def streamable_http(url: str) -> Any:
    """The SDK's client transport, as an async context manager yielding ``(read, write)``."""
    try:
        from mcp.client.streamable_http import streamable_http_client
    except ImportError:  # mcp 1.x: ``streamablehttp_client`` yields (read, write, get_session_id)
        from contextlib import asynccontextmanager

        from mcp.client.streamable_http import streamablehttp_client

        @asynccontextmanager
        async def two_streams(u: str):
            async with streamablehttp_client(u) as (read, write, _):
                yield read, write

        return two_streams(url)
    return streamable_http_client(url)


def mcp_tools_as_openai(listed: Any) -> list[dict[str, Any]]:
    return [tool.to_openai() for tool in tools_from_listing(listed)]


def calculator_script(body: dict[str, Any]) -> Reply:
    results = [m for m in body["messages"] if m["role"] == "tool"]
    if not results:
        return Reply(tool_calls=[("add", {"a": 17, "b": 25}), ("fail", {"reason": "testing"})])
    return Reply(content="the sum is " + results[0]["content"])


@pytest.fixture(scope="module")
def mcp_server():
    with McpHttpServer() as server:
        yield server


@pytest.fixture(scope="module")
def policy():
    ti.instrument("openai", "mcp")
    with FakeOpenAIServer(calculator_script) as srv:
        ti.register_endpoint(srv.base_url)
        yield srv
        ti.unregister_endpoint(srv.base_url)


async def test_mcp_calls_over_streamable_http_become_spans_and_tool_messages(mcp_server, policy):
    from mcp import ClientSession

    client = AsyncOpenAI(base_url=policy.base_url, api_key="x", max_retries=0)
    async with ti.rollout(task="17+25") as r:
        async with streamable_http(mcp_server.url) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            tools = mcp_tools_as_openai(await session.list_tools())
            messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 17 + 25?"}]
            for _ in range(3):
                response = await client.chat.completions.create(model="m", messages=messages, tools=tools)
                message = response.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    result = await session.call_tool(call.function.name, json.loads(call.function.arguments))
                    text = "\n".join(getattr(b, "text", "") for b in result.content)
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
    t = r.trajectory
    assert messages[-1]["content"] == "the sum is 42"
    assert roles(t.messages_and_choices) == ["user", "assistant", "tool", "tool", "assistant"]
    call_turn = t.messages_and_choices[1]
    add_result, fail_result = t.messages_and_choices[2], t.messages_and_choices[3]
    ids = [c["id"] for c in call_turn.message["tool_calls"]]
    assert [add_result["tool_call_id"], fail_result["tool_call_id"]] == ids
    assert add_result["content"] == "42"
    assert "failed on purpose: testing" in fail_result["content"]
    assert {tool["function"]["name"] for tool in t.tools} == {"add", "reverse", "fail"}
    assert t.metrics["capture_tool_runs"] == 2
    assert t.metrics["capture_turns_without_token_ids"] == 0
    assert_tokens_match_server(t, policy.responses[-2:])


async def test_mcp_results_after_the_last_model_call_come_from_the_http_spans(mcp_server, policy):
    """The rollout ends right after the MCP calls (the model never saw their results): the
    tool messages are built from the MCP spans alone, in call order, errors marked."""
    from mcp import ClientSession

    client = AsyncOpenAI(base_url=policy.base_url, api_key="x", max_retries=0)
    async with ti.rollout() as r:
        async with streamable_http(mcp_server.url) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            tools = mcp_tools_as_openai(await session.list_tools())
            response = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "What is 17 + 25?"}], tools=tools
            )
            results = [
                await session.call_tool(call.function.name, json.loads(call.function.arguments))
                for call in response.choices[0].message.tool_calls
            ]
    assert not mcp_field(results[0], "is_error", "isError")
    assert mcp_field(results[1], "is_error", "isError")
    items = r.trajectory.messages_and_choices
    assert roles(items) == ["user", "assistant", "tool", "tool"]
    ids = [c["id"] for c in items[1].message["tool_calls"]]
    assert [items[2]["tool_call_id"], items[3]["tool_call_id"]] == ids
    assert items[2]["content"] == "42"
    assert items[3]["content"].startswith("Error: tool_error") and "failed on purpose: testing" in items[3]["content"]
    tools_seen = {tool["function"]["name"]: tool["function"] for tool in r.trajectory.tools}
    assert set(tools_seen) == {"add", "reverse", "fail"}
    assert tools_seen["add"]["description"].startswith("Add two integers")
    assert set(tools_seen["add"]["parameters"]["properties"]) == {"a", "b"}


async def test_mcp_only_rollout_over_http_records_the_tools_offered(mcp_server):
    """Without any model call there is no conversation, but the tools and tool runs are recorded."""
    from mcp import ClientSession

    ti.instrument("mcp")
    async with ti.rollout() as r:
        async with streamable_http(mcp_server.url) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            await session.list_tools()
            assert (await session.call_tool("reverse", {"text": "abc"})).content[0].text == "cba"
    t = r.trajectory
    assert t.messages_and_choices == []
    assert {tool["function"]["name"] for tool in t.tools} == {"add", "reverse", "fail"}
    assert t.metrics["capture_tool_runs"] == 1


async def test_mcp_http_spans_carry_method_tool_arguments_and_error(mcp_server):
    """The spans themselves (what an OTLP backend sees): names, MCP method, arguments, result, error type."""
    from mcp import ClientSession
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    ti.instrument("mcp")
    exporter = InMemorySpanExporter()
    ti.get_tracer_provider().add_span_processor(SimpleSpanProcessor(exporter))
    try:
        async with ti.rollout() as r:
            async with streamable_http(mcp_server.url) as (read, write), ClientSession(read, write) as session:
                await session.initialize()
                await session.list_tools()
                await session.call_tool("add", {"a": 2, "b": 3})
                await session.call_tool("fail", {"reason": "x"})
        finished = exporter.get_finished_spans()
    finally:
        exporter.shutdown()  # the provider keeps the processor; a shut-down exporter stores nothing more
    trace_id = int(r.trajectory.trace_id, 16)
    ours = [s for s in finished if s.context.trace_id == trace_id and s.attributes.get("tracerl.layer") == "mcp"]
    assert [s.name for s in ours] == ["tools/list", "tools/call add", "tools/call fail"]
    listed, add, fail = ours
    assert listed.attributes["mcp.method.name"] == "tools/list"
    assert {t["name"] for t in json.loads(listed.attributes["tracerl.mcp.tools"])} == {"add", "reverse", "fail"}
    assert add.attributes["gen_ai.tool.name"] == "add"
    assert json.loads(add.attributes["gen_ai.tool.call.arguments"]) == {"a": 2, "b": 3}
    assert add.attributes["gen_ai.tool.call.result"] == "5"
    assert "error.type" not in add.attributes
    assert fail.attributes["error.type"] == "tool_error"
    root = next(s for s in finished if s.context.trace_id == trace_id and s.parent is None)
    assert all(s.parent.span_id == root.context.span_id for s in ours)
    assert isinstance(r.trajectory, tracerl.Trajectory)


async def test_one_http_session_shared_by_concurrent_rollouts_keeps_each_call_in_its_rollout(mcp_server):
    """The session is opened outside any rollout (one server connection for many attempts);
    each ``call_tool`` span lands in the rollout that made the call."""
    import asyncio

    from mcp import ClientSession

    ti.instrument("mcp")

    async def attempt(session: Any, text: str) -> tracerl.Trajectory:
        async with ti.rollout(task=text) as r:
            for _ in range(3):
                await session.call_tool("reverse", {"text": text})
                await asyncio.sleep(0)
        return r.trajectory

    async with streamable_http(mcp_server.url) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        trajectories = await asyncio.gather(*(attempt(session, f"t{i}") for i in range(4)))
    assert [t.metrics["capture_tool_runs"] for t in trajectories] == [3, 3, 3, 3]
    assert len({t.trace_id for t in trajectories}) == 4
