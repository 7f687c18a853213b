"""The MCP agent: an OpenAI-client tool loop over an MCP server's tools, captured as a trajectory.

``await run_mcp_agent(model, spec_or_session, task)`` runs one attempt inside
``tracerl.rollout(model, ...)``: the MCP tools become OpenAI ``tools``, each tool call
the model makes is executed with ``session.call_tool``, and capture builds the
trajectory from the spans (exact token ids and logprobs when ``model`` is served by a
tracerl backend).  A failing tool (an MCP error result, an exception, unparsable
arguments, an unknown name) becomes a tool message starting with ``Error:``, never a
crash.  The loop ends when the model answers without a tool call, or after ``max_turns``
model calls.

Infrastructure is not the policy's doing, so it is never turned into a tool message: a
tool call that does not answer within ``request_timeout`` raises
:class:`~tracerl.errors.McpTimeoutError`, an MCP server that died or dropped the
connection :class:`~tracerl.errors.McpServerError`, a failing inference server
:class:`~tracerl.errors.InferenceServerError`; ``gather_trajectory_groups`` records the
attempt in ``group.exceptions``.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

import tracerl
from tracerl.errors import McpServerError, McpTimeoutError
from tracerl.integrations.faults import classify
from tracerl.integrations.mcp_hook import mcp_field
from tracerl.integrations.mcp_hook import result_text as mcp_result_text
from tracerl.timeouts import DEFAULT_MCP_REQUEST_TIMEOUT, within

from .scenarios import Scenario
from .server import McpServerSpec, McpTool, list_tools, open_session, sdk_timeout

DEFAULT_SYSTEM_PROMPT = (
    "You are an agent that completes the user's task with the tools you are given. "
    "Call a tool whenever it helps; read each tool result before going on. "
    "When the task is done, reply with a short final answer and no tool call."
)


def openai_tools(tools: Sequence[McpTool]) -> list[dict[str, Any]]:
    """MCP tools -> the OpenAI chat-completions ``tools`` list."""
    return [tool.to_openai() for tool in tools]


def result_text(result: Any) -> str:
    """What the agent sees of an MCP ``CallToolResult``: the same text capture records,
    prefixed with ``Error:`` when the server flagged the call as failed."""
    text = mcp_result_text(result)
    is_error = mcp_field(result, "is_error", "isError")
    return f"Error: {text or 'the tool failed'}" if is_error else text


@asynccontextmanager
async def _session(spec_or_session: McpServerSpec | Any) -> AsyncIterator[Any]:
    if isinstance(spec_or_session, McpServerSpec):
        async with open_session(spec_or_session) as session:
            yield session
    else:
        yield spec_or_session


async def call_tool(
    session: Any, known: set[str], name: str, raw_arguments: str | None, *, timeout: float | None = DEFAULT_MCP_REQUEST_TIMEOUT
) -> tuple[str, bool]:
    """Run one tool call; returns ``(tool message content, failed?)``.

    The policy's mistakes and the tool's own errors are messages; raises only when the
    server is at fault: :class:`McpTimeoutError` past ``timeout`` seconds,
    :class:`McpServerError` when it died or the connection dropped.
    """
    if name not in known:
        return f"Error: there is no tool named {name!r}; the tools are {', '.join(sorted(known))}", True
    try:
        arguments = json.loads(raw_arguments or "{}")
    except ValueError as error:
        return f"Error: the arguments are not valid JSON ({error})", True
    if not isinstance(arguments, dict):
        return "Error: the arguments must be a JSON object", True
    try:
        result = await session.call_tool(name, arguments, read_timeout_seconds=sdk_timeout(timeout))
    except Exception as error:  # noqa: BLE001 - a tool failure is an observation for the model...
        reason = classify(error)  # ...unless the server is at fault
        if reason == "timeout":
            raise McpTimeoutError(
                f"the MCP tool {name!r} did not answer {within(timeout)} "
                "(knob: McpServerSpec(request_timeout=...), or run_mcp_agent(..., request_timeout=...))"
            ) from error
        if reason is not None:
            raise McpServerError(f"the MCP server failed during the call to tool {name!r}: {type(error).__name__}: {error}") from error
        return f"Error: {type(error).__name__}: {error}", True
    text = result_text(result)
    return text, text.startswith("Error:")


async def run_mcp_agent(
    model: tracerl.Model,
    spec_or_session: McpServerSpec | Any,
    task: str | Scenario,
    *,
    max_turns: int = 5,
    max_tokens: int = 256,
    temperature: float = 1.0,
    system_prompt: str = DEFAULT_SYSTEM_PROMPT,
    tools: Sequence[McpTool] | None = None,
    few_shot: Sequence[dict[str, Any]] = (),
    request_timeout: float | None = None,
) -> tracerl.Trajectory:
    """One attempt at ``task``; returns the captured trajectory (reward 0, to be judged).

    ``spec_or_session``: an :class:`McpServerSpec` (a session is opened for this attempt,
    a stdio server started and stopped) or an open ``ClientSession`` shared by attempts.
    ``tools``: the tools to offer (default: ``list_tools`` on the session).
    ``request_timeout``: seconds per tool call (default: the spec's ``request_timeout``,
    or 120 s for a session you pass); model calls are bounded by the model's client
    (``Model(inference_timeout=...)``).
    ``few_shot``: messages placed between the system prompt and the task (e.g. worked
    examples: user, assistant with ``tool_calls``, tool, assistant); they help a small
    model a lot and are never trained on.
    """
    import tracerl.integrations as ti

    ti.instrument("openai", "mcp")
    scenario = task if isinstance(task, Scenario) else Scenario(task=str(task))
    metadata: dict[str, Any] = {"scenario_id": scenario.id, "difficulty": scenario.difficulty}
    if scenario.metadata:
        metadata["scenario_metadata"] = dict(scenario.metadata)
    prompt = [{"role": "system", "content": system_prompt}, *few_shot, {"role": "user", "content": scenario.task}]
    if request_timeout is None:
        request_timeout = spec_or_session.request_timeout if isinstance(spec_or_session, McpServerSpec) else DEFAULT_MCP_REQUEST_TIMEOUT
    async with tracerl.rollout(model, task=scenario.task, metadata=metadata) as r:
        async with _session(spec_or_session) as session:
            offered = tuple(tools) if tools is not None else await list_tools(session, request_timeout)
            limits = _Limits(max_turns, max_tokens, temperature, request_timeout)
            r.output = await _loop(r, model, session, offered, prompt, limits)
    assert r.trajectory is not None
    return r.trajectory


@dataclass(frozen=True)
class _Limits:
    max_turns: int
    max_tokens: int
    temperature: float
    request_timeout: float | None


async def _loop(
    r: Any, model: tracerl.Model, session: Any, tools: Sequence[McpTool], prompt: list[dict[str, Any]], limits: _Limits
) -> str:
    client = model.openai_client()
    schemas = openai_tools(tools)
    known = {t.name for t in tools}
    messages = list(prompt)
    r.metrics.update(turns=0, tool_calls=0, tool_errors=0, finished=0)
    for _ in range(limits.max_turns):
        response = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=messages,
            tools=schemas or None,
            max_tokens=limits.max_tokens,
            temperature=limits.temperature,
        )
        r.metrics["turns"] += 1
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            r.metrics["finished"] = 1
            return message.content or ""
        for call in message.tool_calls:
            content, failed = await call_tool(
                session, known, call.function.name, call.function.arguments, timeout=limits.request_timeout
            )
            r.metrics["tool_calls"] += 1
            r.metrics["tool_errors"] += int(failed)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
    return ""
