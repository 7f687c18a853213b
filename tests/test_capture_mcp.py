"""MCP: an agent using ``mcp-server-time`` over stdio; MCP calls become spans and tool messages."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from capture_fake_server import FakeOpenAIServer, Reply
from capture_helpers import assert_tokens_match_server, roles
from openai import AsyncOpenAI

import tracerl.integrations as ti

pytest.importorskip("mcp")
if importlib.util.find_spec("mcp_server_time") is None:
    pytest.skip("mcp-server-time is not installed", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import mcp_time_agent  # noqa: E402


def time_script(body: dict[str, Any]) -> Reply:
    results = [m for m in body["messages"] if m["role"] == "tool"]
    if not results:
        return Reply(tool_calls=[("get_current_time", {"timezone": "Asia/Tokyo"}), ("get_current_time", {"timezone": "Nowhere/Bad"})])
    return Reply(content="it is " + json.loads(results[0]["content"])["datetime"])


@pytest.fixture(scope="module")
def server():
    ti.instrument("openai", "mcp")
    with FakeOpenAIServer(time_script) as srv:
        ti.register_endpoint(srv.base_url)
        yield srv
        ti.unregister_endpoint(srv.base_url)


async def test_mcp_time_agent_over_stdio(server):
    client = AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    async with ti.rollout(task="tokyo") as r:
        answer = await mcp_time_agent.run_agent(client, "m", "What time is it in Tokyo?")
    t = r.trajectory
    assert answer.startswith("it is ")
    assert roles(t.messages_and_choices) == ["system", "user", "assistant", "tool", "tool", "assistant"]
    tokyo, bad = t.messages_and_choices[3], t.messages_and_choices[4]
    assert json.loads(tokyo["content"])["timezone"] == "Asia/Tokyo"
    assert "Invalid timezone" in bad["content"]
    assert {tool["function"]["name"] for tool in t.tools} == {"get_current_time", "convert_time"}
    assert_tokens_match_server(t, server.responses)
    assert t.metrics["capture_tool_runs"] == 2  # the two MCP tools/call spans


async def test_mcp_calls_after_the_last_model_call_are_appended(server):
    """A tool result the model never saw (the rollout ended) still lands in the trajectory."""
    from mcp import ClientSession, stdio_client

    client = AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    async with ti.rollout() as r:
        async with stdio_client(mcp_time_agent.time_server_params()) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            response = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "time?"}], tools=[{"type": "function", "function": {"name": "get_current_time", "parameters": {}}}]
            )
            for call in response.choices[0].message.tool_calls:
                await session.call_tool(call.function.name, json.loads(call.function.arguments))
    items = r.trajectory.messages_and_choices
    assert roles(items) == ["user", "assistant", "tool", "tool"]
    assert json.loads(items[2]["content"])["timezone"] == "Asia/Tokyo"
    assert items[3]["content"].startswith("Error: tool_error")


def test_mcp_example_runs_as_a_script(server):
    import subprocess

    example = Path(__file__).resolve().parents[1] / "examples" / "mcp_time_agent.py"
    done = subprocess.run([sys.executable, str(example), "--base-url", server.base_url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("reward=")]
    assert len(lines) == 4 and all("reward=1.0" in line and "token_ids=2" in line for line in lines)
