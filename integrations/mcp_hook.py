"""Hook for the MCP client: ``mcp.ClientSession.call_tool`` and ``list_tools``.

Any transport (stdio, streamable HTTP) goes through ``ClientSession``, so one patch covers
them (both tested against real servers).  Spans are started in the calling task's context,
so a session shared by concurrent rollouts still puts each call in its own rollout.  A tool call
becomes an ``execute_tool``-operation span named ``tools/call {name}`` with the MCP
method, tool name, arguments, result text and error; ``tools/list`` records the tools
offered (used as the trajectory's tools when no model call listed any).

A request that fails because the server died, the connection dropped or the request
timed out is noted on the rollout as an infrastructure failure (:mod:`.faults`): the
rollout raises even when the agent (or LangGraph's ``ToolNode``) turned the error into a
message.  Errors the tool reports (``isError`` results) stay the tool's.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

from . import faults
from . import semconv as sc
from .health import guard
from .patching import InitArgument, Patches
from .processor import get_tracer
from .spans import end_with_error

_patches = Patches()


def result_text(result: Any) -> str:
    """The text an agent would put in a tool message for an MCP ``CallToolResult``."""
    parts = []
    for block in getattr(result, "content", None) or ():
        text = getattr(block, "text", None)
        if text is not None:
            parts.append(text)
        elif hasattr(block, "model_dump"):
            parts.append(json.dumps(block.model_dump(mode="json", exclude_none=True)))
    structured = mcp_field(result, "structured_content", "structuredContent")
    if not parts and structured is not None:
        parts.append(json.dumps(structured, default=str))
    return "\n".join(parts)


_MISSING = object()


def mcp_field(obj: Any, name: str, legacy: str) -> Any:
    """MCP 2.x names fields in snake_case, 1.x in camelCase (2.x still answers to the old name, with a
    deprecation warning: it is read only where the new one does not exist)."""
    value = getattr(obj, name, _MISSING)
    return getattr(obj, legacy, None) if value is _MISSING else value


def _start(name: str, method: str, attributes: dict[str, Any]) -> tuple[Any, Any]:
    span = token = None
    with guard("mcp_start"):
        span = get_tracer().start_span(
            name, kind=trace.SpanKind.CLIENT, attributes={sc.MCP_METHOD_NAME: method, sc.LAYER: "mcp", **attributes}
        )
        token = otel_context.attach(trace.set_span_in_context(span))
    return span, token


def _end(span: Any, token: Any, error: BaseException | None = None) -> None:
    with guard("mcp_end"):
        if token is not None:
            otel_context.detach(token)
        if span is not None:
            if error is not None:
                end_with_error(span, error)
            else:
                span.end()


SESSION_TIMEOUT = InitArgument("read_timeout_seconds")
"""A session's default read timeout, as given to ``ClientSession(...)``."""
MCP_TIMEOUT_KNOB = "McpServerSpec(request_timeout=...), or call_tool(..., read_timeout_seconds=...)"


def seconds(value: Any) -> Any:
    """A timeout in seconds: ``mcp`` 1.x takes a ``timedelta``, 2.x a float."""
    return value.total_seconds() if hasattr(value, "total_seconds") else value


def _note_failure(session: Any, target: str, error: BaseException, key: Any, timeout: Any) -> None:
    if timeout is None:
        timeout = SESSION_TIMEOUT.of(session)  # the session's default, if any
    faults.note_failure("mcp", target, error, key, timeout=seconds(timeout), knob=MCP_TIMEOUT_KNOB)


def _wrap_call_tool(original: Any) -> Any:
    @functools.wraps(original)
    async def call_tool(self: Any, name: str, arguments: dict[str, Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        attributes: dict[str, Any] = {}
        with guard("mcp_call_tool_request"):
            attributes = {sc.OPERATION_NAME: sc.OP_EXECUTE_TOOL, sc.TOOL_NAME: str(name),
                          sc.TOOL_CALL_ARGUMENTS: json.dumps(arguments or {}, default=str)}  # fmt: skip
        span, token = _start(f"tools/call {name}", "tools/call", attributes)
        key = lambda: faults.call_key("mcp", id(self), str(name), arguments)  # noqa: E731
        try:
            result = await original(self, name, arguments, *args, **kwargs)
        except BaseException as error:
            _end(span, token, error)
            timeout = kwargs.get("read_timeout_seconds", args[0] if args else None)
            _note_failure(self, f"tools/call {name!r}", error, key, timeout)
            raise
        faults.note_success("mcp", key)
        if span is not None:
            with guard("mcp_call_tool_result"):
                span.set_attribute(sc.TOOL_CALL_RESULT, result_text(result))
                if mcp_field(result, "is_error", "isError"):
                    span.set_attribute(sc.ERROR_TYPE, "tool_error")
        _end(span, token)
        return result

    call_tool.__tracerl_original__ = original  # type: ignore[attr-defined]
    return call_tool


def _wrap_list_tools(original: Any) -> Any:
    @functools.wraps(original)
    async def list_tools(self: Any, *args: Any, **kwargs: Any) -> Any:
        span, token = _start("tools/list", "tools/list", {})
        key = lambda: faults.call_key("mcp", id(self), "tools/list")  # noqa: E731
        try:
            result = await original(self, *args, **kwargs)
        except BaseException as error:
            _end(span, token, error)
            _note_failure(self, "tools/list", error, key, None)
            raise
        faults.note_success("mcp", key)
        if span is not None:
            with guard("mcp_list_tools_result"):
                tools = [{"type": "function", "name": tool.name, "description": tool.description or "",
                          "parameters": mcp_field(tool, "input_schema", "inputSchema")} for tool in result.tools]  # fmt: skip
                span.set_attribute(sc.MCP_TOOLS, json.dumps(tools, default=str))
        _end(span, token)
        return result

    list_tools.__tracerl_original__ = original  # type: ignore[attr-defined]
    return list_tools


def instrument() -> bool:
    """Patch ``ClientSession.call_tool`` / ``list_tools``; idempotent."""
    try:
        from mcp import ClientSession
    except ImportError:
        return False
    _patches.apply(ClientSession, "__init__", SESSION_TIMEOUT.wrap)
    _patches.apply(ClientSession, "call_tool", _wrap_call_tool)
    _patches.apply(ClientSession, "list_tools", _wrap_list_tools)
    return True


uninstrument = _patches.restore
is_instrumented = _patches.__bool__
