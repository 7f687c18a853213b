"""Where the MCP server is, how to connect to it, and what it offers.

:class:`McpServerSpec` names a server: a command started over stdio, or a
streamable-HTTP URL.  ``open_session(spec)`` is an async context manager yielding an
initialized ``mcp.ClientSession``; ``discover(spec_or_session)`` lists its tools (and
resources, when the server has any).  Works with the ``mcp`` SDK 1.x and 2.x.
"""

from __future__ import annotations

import shlex
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping

from tracerl.errors import ConfigError, TracerlError
from tracerl.integrations.mcp_hook import mcp_field


class McpServerError(TracerlError, RuntimeError):
    """The MCP server could not be started, reached or listed."""


@dataclass(frozen=True)
class McpServerSpec:
    """An MCP server: ``command`` + ``args`` (+ ``env``, ``cwd``) over stdio, or a streamable-HTTP ``url``."""

    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] | None = None
    """Extra environment for a stdio server (added to the SDK's safe default environment)."""
    cwd: str | None = None
    url: str | None = None
    """E.g. ``"http://127.0.0.1:8000/mcp"``."""
    headers: Mapping[str, str] | None = field(default=None, repr=False)
    """HTTP headers for a URL server (e.g. authorization); never shown in ``repr``."""

    def __post_init__(self) -> None:
        if bool(self.command) == bool(self.url):
            raise ConfigError("an MCP server needs exactly one of `command` (stdio) or `url` (streamable HTTP)")
        object.__setattr__(self, "args", tuple(str(a) for a in self.args))

    @classmethod
    def stdio(cls, command_line: str, *, env: Mapping[str, str] | None = None, cwd: str | None = None) -> "McpServerSpec":
        """From one shell-style line, e.g. ``"python -m mcp_server_time --local-timezone UTC"``."""
        parts = shlex.split(command_line)
        if not parts:
            raise ConfigError("the MCP server command is empty")
        return cls(command=parts[0], args=tuple(parts[1:]), env=env, cwd=cwd)

    @classmethod
    def http(cls, url: str, *, headers: Mapping[str, str] | None = None) -> "McpServerSpec":
        return cls(url=url, headers=headers)

    @property
    def transport(self) -> str:
        return "stdio" if self.command else "streamable-http"

    @property
    def label(self) -> str:
        """A short human name (no secrets): the command line or the URL."""
        return shlex.join([self.command or "", *self.args]) if self.command else str(self.url)


@dataclass(frozen=True)
class McpTool:
    """One tool the server offers."""

    name: str
    description: str
    input_schema: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI chat-completions ``tools`` entry for this tool."""
        schema = dict(self.input_schema or {})
        schema.setdefault("type", "object")
        schema.setdefault("properties", {})
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": schema}}

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "input_schema": self.input_schema}


@dataclass(frozen=True)
class McpResource:
    uri: str
    name: str
    description: str = ""
    mime_type: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"uri": self.uri, "name": self.name, "description": self.description, "mime_type": self.mime_type}


@dataclass(frozen=True)
class Discovery:
    """What :func:`discover` found."""

    tools: tuple[McpTool, ...]
    resources: tuple[McpResource, ...] = ()
    server_name: str | None = None

    def openai_tools(self) -> list[dict[str, Any]]:
        return [tool.to_openai() for tool in self.tools]


def tools_from_listing(listed: Any) -> tuple[McpTool, ...]:
    """``ListToolsResult`` -> :class:`McpTool` tuple."""
    return tuple(
        McpTool(
            name=str(tool.name),
            description=str(tool.description or ""),
            input_schema=dict(mcp_field(tool, "input_schema", "inputSchema") or {}),
        )
        for tool in listed.tools
    )


@asynccontextmanager
async def _transport(spec: McpServerSpec) -> AsyncIterator[tuple[Any, Any]]:
    if spec.command:
        from mcp import StdioServerParameters, stdio_client

        params = StdioServerParameters(
            command=spec.command, args=list(spec.args), env=dict(spec.env) if spec.env is not None else None, cwd=spec.cwd
        )
        async with stdio_client(params) as (read, write):
            yield read, write
        return
    try:
        from mcp.client.streamable_http import streamable_http_client
    except ImportError:  # mcp 1.x
        from mcp.client.streamable_http import streamablehttp_client

        async with streamablehttp_client(str(spec.url), headers=dict(spec.headers or {})) as (read, write, _):
            yield read, write
        return
    http_client = None
    if spec.headers:
        from mcp.shared._httpx_utils import create_mcp_http_client

        http_client = create_mcp_http_client(headers=dict(spec.headers))
    try:
        async with streamable_http_client(str(spec.url), http_client=http_client) as (read, write):
            yield read, write
    finally:
        if http_client is not None:
            await http_client.aclose()


@asynccontextmanager
async def open_session(spec: McpServerSpec) -> AsyncIterator[Any]:
    """An initialized ``mcp.ClientSession`` on ``spec``; closed (and a stdio server stopped) on exit.

    Failing to start or reach the server raises :class:`McpServerError` naming it.
    """
    from mcp import ClientSession

    entered = False
    try:
        async with _transport(spec) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            entered = True
            yield session
    except Exception as error:
        if entered:  # the caller's own error, raised inside the session: unwrap anyio's task-group wrapping
            leaf = _single_leaf(error)
            if leaf is not error:
                raise leaf from None
            raise
        raise McpServerError(f"could not connect to the MCP server {spec.label} ({spec.transport}): {_describe(error)}") from error


def _single_leaf(error: BaseException) -> BaseException:
    """The one exception inside (nested) exception groups of one member each, else ``error``."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def _describe(error: BaseException) -> str:
    """The innermost useful message (anyio wraps transport errors in exception groups)."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}"


async def _list_resources(session: Any) -> tuple[McpResource, ...]:
    result = getattr(session, "initialize_result", None)
    capabilities = getattr(result, "capabilities", None) if not callable(result) else None
    if capabilities is not None and getattr(capabilities, "resources", None) is None:
        return ()
    try:
        listed = await session.list_resources()
    except Exception:  # noqa: BLE001 - a server without resources may answer "method not found"
        return ()
    return tuple(
        McpResource(
            uri=str(r.uri),
            name=str(r.name),
            description=str(r.description or ""),
            mime_type=mcp_field(r, "mime_type", "mimeType"),
        )
        for r in listed.resources
    )


async def discover(spec_or_session: McpServerSpec | Any) -> Discovery:
    """The tools (name, description, input schema) and resources the server offers."""
    if isinstance(spec_or_session, McpServerSpec):
        async with open_session(spec_or_session) as session:
            return await discover(session)
    session = spec_or_session
    try:
        tools = tools_from_listing(await session.list_tools())
    except Exception as error:
        raise McpServerError(f"listing the MCP server's tools failed: {_describe(error)}") from error
    result = getattr(session, "initialize_result", None)
    info = mcp_field(result, "server_info", "serverInfo") if result is not None and not callable(result) else None
    return Discovery(tools=tools, resources=await _list_resources(session), server_name=getattr(info, "name", None))
