"""MCP faults injected for real: a tool that never answers, a server that freezes, dies
mid-call (``os._exit``) or is SIGKILLed mid-rollout, a server that never finishes starting,
and a LangGraph ``ToolNode`` that swallows the failure into a message.

Every one must end as a typed exception in ``group.exceptions`` (never a trajectory to
train on), within its timeout knob, with the stdio server it started gone afterwards.
The MCP servers are ``tests/mcp_http_server.py --faults`` over stdio and streamable HTTP;
the policy is ``capture_fake_server.FakeOpenAIServer`` (real HTTP, scripted replies).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
from capture_fake_server import FakeOpenAIServer, Reply
from mcp_http_server import McpHttpServer

import tracerl
import tracerl.integrations as ti
from tracerl.mcp_rl import McpServerSpec, discover, open_session, run_mcp_agent

pytest.importorskip("mcp")

SERVER_SCRIPT = str(Path(__file__).resolve().parent / "mcp_http_server.py")
TIMEOUT = 1.0
"""The request timeout the tests use: small, so a hang costs about a second."""


def stdio_spec(pid_file: Path, **timeouts: Any) -> McpServerSpec:
    args = (SERVER_SCRIPT, "--transport", "stdio", "--faults", "--pid-file", str(pid_file))
    return McpServerSpec(command=sys.executable, args=args, **timeouts)


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def calls(*names: str):
    """A policy that calls ``names`` one per turn (``pid``'s result is read back), then answers."""

    def script(body: dict[str, Any]) -> Reply:
        done = sum(1 for m in body["messages"] if m["role"] == "tool")
        return Reply(tool_calls=[(names[done], {})]) if done < len(names) else Reply(content="finished")

    return script


@pytest.fixture
def policy():
    servers: list[FakeOpenAIServer] = []

    def start(script) -> tracerl.Model:
        server = FakeOpenAIServer(script).start()
        servers.append(server)
        return tracerl.Model("policy", "tests", inference_base_url=server.base_url, inference_model_name="m")

    yield start
    for server in servers:
        server.stop()


async def gather_one(attempt) -> tracerl.TrajectoryGroup:
    [group] = await tracerl.gather_trajectory_groups([tracerl.TrajectoryGroup([attempt])], pbar_desc=None, max_exceptions=1)
    return group


# -- a tool that never answers ----------------------------------------------------------------------
async def test_a_stdio_tool_that_never_answers_times_out_and_the_server_is_stopped(policy, tmp_path):
    model = policy(calls("hang"))
    pid_file = tmp_path / "pid"
    group = await gather_one(run_mcp_agent(model, stdio_spec(pid_file, request_timeout=TIMEOUT), "Wait."))
    assert group.trajectories == []
    [record] = group.exceptions
    assert record.type == "McpTimeoutError"
    assert "'hang' did not answer within 1 s" in record.message and "request_timeout" in record.message
    assert not is_alive(int(pid_file.read_text()))


async def test_a_http_tool_that_never_answers_times_out_on_a_shared_session(policy):
    model = policy(calls("hang"))
    with McpHttpServer(faults=True) as server:
        async with open_session(McpServerSpec.http(server.url, request_timeout=None)) as session:  # no session default
            with pytest.raises(tracerl.McpTimeoutError, match="'hang' did not answer within 1 s") as caught:
                await run_mcp_agent(model, session, "Wait.", request_timeout=TIMEOUT)
            assert isinstance(caught.value, TimeoutError)
            assert (await session.call_tool("add", {"a": 1, "b": 2})).content[0].text == "3"  # the session lives on


async def test_a_session_we_open_bounds_every_request_even_outside_the_agent(tmp_path):
    """User code (or a LangGraph tool) calling ``session.call_tool`` directly is bounded too."""
    async with open_session(stdio_spec(tmp_path / "pid", request_timeout=TIMEOUT)) as session:
        ti.instrument("mcp")
        async with tracerl.rollout(None, task="direct call", raise_infrastructure_errors=False) as r:
            try:
                await session.call_tool("hang", {})
            except Exception as error:  # noqa: BLE001 - an agent that swallows it
                r.output = type(error).__name__
    assert r.trajectory.metadata["infrastructure_errors"][0]["reason"] == "timeout"


# -- a server that freezes, dies, or is killed ----------------------------------------------------------
async def test_a_stdio_server_that_dies_mid_call_is_an_mcp_server_error(policy, tmp_path):
    model = policy(calls("crash"))
    group = await gather_one(run_mcp_agent(model, stdio_spec(tmp_path / "pid", request_timeout=30), "Crash."))
    assert group.trajectories == []
    [record] = group.exceptions
    assert record.type == "McpServerError" and "'crash'" in record.message and "Connection closed" in record.message


async def test_a_http_server_that_dies_mid_call_is_an_mcp_server_error(policy):
    """mcp 2.x sees the response stream end; 1.x only notices at ``request_timeout``
    (an ``McpTimeoutError``, which is an ``McpServerError`` too)."""
    model = policy(calls("crash"))
    with McpHttpServer(faults=True) as server:
        group = await gather_one(run_mcp_agent(model, McpServerSpec.http(server.url, request_timeout=5), "Crash."))
    assert group.trajectories == []
    [record] = group.exceptions
    assert issubclass(getattr(tracerl, record.type), tracerl.McpServerError)


def killer(after: str = "pid"):
    """A policy that asks for the server's pid, SIGKILLs it (mid-rollout), then calls ``add``."""

    def script(body: dict[str, Any]) -> Reply:
        results = [m["content"] for m in body["messages"] if m["role"] == "tool"]
        if not results:
            return Reply(tool_calls=[("pid", {})])
        if len(results) == 1:
            os.kill(int(results[0]), signal.SIGKILL)
            return Reply(tool_calls=[("add", {"a": 1, "b": 2})])
        return Reply(content="finished")

    return script


@pytest.mark.parametrize("transport", ["stdio", "streamable-http"])
async def test_a_server_killed_mid_rollout_is_an_exception_not_a_trajectory(policy, tmp_path, transport):
    model = policy(killer())
    if transport == "stdio":
        group = await gather_one(run_mcp_agent(model, stdio_spec(tmp_path / "pid", request_timeout=30), "Add."))
    else:
        with McpHttpServer(faults=True) as server:
            group = await gather_one(run_mcp_agent(model, McpServerSpec.http(server.url, request_timeout=30), "Add."))
    assert group.trajectories == []
    [record] = group.exceptions  # stdio: the call to add sees the closed pipe; HTTP: the session's transport fails
    assert record.type == "McpServerError" and ("'add'" in record.message or "failed during the session" in record.message)


# -- a server that never finishes starting ------------------------------------------------------------------
async def test_a_stdio_server_that_never_answers_initialize_times_out_and_is_killed(tmp_path):
    pid_file = tmp_path / "pid"
    silent = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)"
    spec = McpServerSpec(command=sys.executable, args=("-c", silent, str(pid_file)), startup_timeout=TIMEOUT)
    with pytest.raises(tracerl.McpTimeoutError, match=r"did not start and answer `initialize` within 1 s .*startup_timeout"):
        await discover(spec)
    assert not is_alive(int(pid_file.read_text()))


async def test_a_http_server_that_accepts_but_never_answers_times_out():
    with socket.socket() as listener:  # the kernel completes the handshake; nobody ever answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/mcp"
        with pytest.raises(tracerl.McpTimeoutError, match="startup_timeout"):
            await discover(McpServerSpec.http(url, startup_timeout=TIMEOUT))


# -- a stuck rollout --------------------------------------------------------------------------------------
@pytest.mark.parametrize("tool", ["hang", "freeze"])
async def test_rollout_timeout_cancels_a_stuck_rollout_and_stops_its_server(policy, tmp_path, tool):
    """No request timeout at all: ``rollout_timeout`` still ends it, and the stdio server
    (responsive, or frozen in a blocking call) is stopped; the sibling attempt is kept."""
    model = policy(calls(tool))
    pid_file = tmp_path / "pid"
    tasks_before = len(asyncio.all_tasks())

    async def quick() -> tracerl.Trajectory:
        async with tracerl.rollout(model, task="quick") as r:
            r.reward = 1.0
        return r.trajectory

    group = tracerl.TrajectoryGroup([run_mcp_agent(model, stdio_spec(pid_file, request_timeout=None), "Wait."), quick()])
    gathered = await tracerl.gather_trajectory_groups([group], pbar_desc=None, max_exceptions=1, rollout_timeout=6)
    [group] = gathered
    assert [r.type for r in group.exceptions] == ["RolloutTimeoutError"]
    assert "rollout_timeout=6 s" in group.exceptions[0].message
    assert [t.reward for t in group.trajectories] == [1.0]
    assert gathered.metrics["rollout_timeouts"] == 1 and gathered.metrics["exceptions"] == 1
    assert not is_alive(int(pid_file.read_text()))
    assert len(asyncio.all_tasks()) == tasks_before


async def test_too_many_exceptions_cancels_the_rollouts_still_running(policy, tmp_path):
    """A gather that gives up does not leave a stuck rollout (and its server) running behind it."""
    crashing = policy(calls("crash"))
    stuck = policy(calls("hang"))
    pid_file = tmp_path / "pid"
    groups = [
        tracerl.TrajectoryGroup([run_mcp_agent(crashing, stdio_spec(tmp_path / "c", request_timeout=30), "Crash.")]),
        tracerl.TrajectoryGroup([run_mcp_agent(stuck, stdio_spec(pid_file, request_timeout=None), "Wait.")]),
    ]
    with pytest.raises(tracerl.TooManyExceptionsError, match="McpServerError"):
        await tracerl.gather_trajectory_groups(groups, pbar_desc=None, max_exceptions=0)
    assert not is_alive(int(pid_file.read_text()))


# -- LangGraph swallows the failure into a message ---------------------------------------------------------
def tool_then_answer(tool_name: str):
    def script(body: dict[str, Any]) -> Reply:
        results = [m for m in body["messages"] if m["role"] == "tool"]
        return Reply(content="answer: " + str(results[0]["content"])) if results else Reply(tool_calls=[(tool_name, {})])

    return script


def toolnode_agent(model: tracerl.Model, tools: list[Any]) -> Any:
    """A LangGraph agent whose ToolNode turns tool exceptions into messages (as users configure it)."""
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    from tracerl.integrations.langgraph import init_chat_model

    llm = init_chat_model(model, max_retries=0).bind_tools(tools)

    async def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await llm.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools, handle_tool_errors=True))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile()


@pytest.mark.asyncio(loop_scope="session")
async def test_langgraph_toolnode_swallowing_a_dead_mcp_server_still_fails_the_rollout(tmp_path):
    pytest.importorskip("langgraph")
    from langchain_core.tools import tool

    ti.instrument("openai", "langchain", "mcp")
    with FakeOpenAIServer(tool_then_answer("crash_tool")) as server:
        model = tracerl.Model("policy", "tests", inference_base_url=server.base_url, inference_model_name="m")
        async with open_session(stdio_spec(tmp_path / "pid", request_timeout=30)) as session:

            @tool
            async def crash_tool() -> str:
                """Calls the MCP server's crash tool."""
                return str((await session.call_tool("crash", {})).content)

            graph = toolnode_agent(model, [crash_tool])
            with pytest.raises(tracerl.McpServerError, match="tools/call 'crash'.*carried on") as caught:
                async with tracerl.rollout(model, task="crash"):
                    state = await graph.ainvoke({"messages": [{"role": "user", "content": "crash it"}]})
            assert "Connection closed" in str(caught.value.__cause__)
    # the agent did carry on: the tool error became a message and the model answered it
    assert state["messages"][-1].content.startswith("answer: Error")
    assert len(server.requests) == 2


@pytest.mark.asyncio(loop_scope="session")
async def test_langgraph_toolnode_swallowing_a_refused_connection_still_fails_the_rollout():
    pytest.importorskip("langgraph")
    import httpx
    from langchain_core.tools import tool

    ti.instrument("openai", "langchain")
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        closed_url = f"http://127.0.0.1:{probe.getsockname()[1]}/"

    @tool
    async def fetch_page() -> str:
        """Fetches a web page."""
        async with httpx.AsyncClient() as client:
            return (await client.get(closed_url)).text

    with FakeOpenAIServer(tool_then_answer("fetch_page")) as server:
        model = tracerl.Model("policy", "tests", inference_base_url=server.base_url, inference_model_name="m")
        graph = toolnode_agent(model, [fetch_page])
        attempt = tracerl.trajectory(graph.ainvoke({"messages": [{"role": "user", "content": "fetch"}]}), model)
        [group] = await tracerl.gather_trajectory_groups([tracerl.TrajectoryGroup([attempt])], pbar_desc=None, max_exceptions=1)
    assert group.trajectories == [] and [r.type for r in group.exceptions] == ["InfrastructureError"]
    assert "ConnectError" in group.exceptions[0].message
    assert json.dumps(server.requests[-1]["messages"]).count("Error") >= 1  # the model saw the swallowed error
