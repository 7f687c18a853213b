"""Where the MCP server is, how to connect to it, and what it offers.

:class:`McpServerSpec` names a server: a command started over stdio, or a
streamable-HTTP URL.  ``open_session(spec)`` is an async context manager yielding an
initialized ``mcp.ClientSession``; ``discover(spec_or_session)`` lists its tools (and
resources, when the server has any).  Works with the ``mcp`` SDK 1.x and 2.x.

Nothing waits forever: starting the server and the ``initialize`` handshake are bounded
by ``spec.startup_timeout``, every request on a session we open (tool calls, listings)
by ``spec.request_timeout`` (the SDK's ``read_timeout_seconds``).  A timeout raises
:class:`~tracerl.errors.McpTimeoutError`; a server that cannot be reached, dies or drops
the connection raises :class:`~tracerl.errors.McpServerError`.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import math
import shlex
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, AsyncIterator, Mapping

from tracerl.errors import ConfigError, McpServerError, McpTimeoutError
from tracerl.integrations.faults import class_names, classify
from tracerl.timeouts import DEFAULT_MCP_REQUEST_TIMEOUT, DEFAULT_MCP_STARTUP_TIMEOUT, check_timeout, within
from tracerl.integrations.mcp_hook import mcp_field



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
    startup_timeout: float | None = DEFAULT_MCP_STARTUP_TIMEOUT
    """Seconds to start the server and complete ``initialize``; ``None``: no limit."""
    request_timeout: float | None = DEFAULT_MCP_REQUEST_TIMEOUT
    """Seconds for each request on the session (tool calls, listings); ``None``: no limit."""

    def __post_init__(self) -> None:
        if bool(self.command) == bool(self.url):
            raise ConfigError("an MCP server needs exactly one of `command` (stdio) or `url` (streamable HTTP)")
        object.__setattr__(self, "args", tuple(str(a) for a in self.args))
        for name in ("startup_timeout", "request_timeout"):
            object.__setattr__(self, name, check_timeout(getattr(self, name), f"McpServerSpec.{name}"))

    @classmethod
    def stdio(
        cls, command_line: str, *, env: Mapping[str, str] | None = None, cwd: str | None = None, **timeouts: float | None
    ) -> "McpServerSpec":
        """From one shell-style line, e.g. ``"python -m mcp_server_time --local-timezone UTC"``;
        ``timeouts``: ``startup_timeout=``, ``request_timeout=``."""
        parts = shlex.split(command_line)
        if not parts:
            raise ConfigError("the MCP server command is empty")
        return cls(command=parts[0], args=tuple(parts[1:]), env=env, cwd=cwd, **timeouts)

    @classmethod
    def http(cls, url: str, *, headers: Mapping[str, str] | None = None, **timeouts: float | None) -> "McpServerSpec":
        """A streamable-HTTP server; ``timeouts``: ``startup_timeout=``, ``request_timeout=``."""
        return cls(url=url, headers=headers, **timeouts)

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
        async with streamable_http_client(str(spec.url), http_client=http_client) as streams:
            yield streams[0], streams[1]  # 2.x yields (read, write); late 1.x (read, write, get_session_id)
    finally:
        if http_client is not None:
            await http_client.aclose()


def sdk_timeout(seconds: float | None) -> Any:
    """A timeout as the installed ``mcp`` SDK takes it: 1.x a ``timedelta``, 2.x seconds."""
    if seconds is None:
        return None
    return timedelta(seconds=seconds) if _SDK_MAJOR < 2 else float(seconds)


def _sdk_major() -> int:
    try:
        return int(importlib.metadata.version("mcp").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return 2


_SDK_MAJOR = _sdk_major()


async def _initialize(session: Any, spec: McpServerSpec) -> None:
    """``initialize`` bounded by ``startup_timeout`` alone (it may exceed the session's
    request timeout: a first ``uvx`` run downloads the server before it answers)."""
    import anyio

    lifted = hasattr(session, "_session_read_timeout_seconds")  # the SDK's per-session default (1.x and 2.x)
    saved = session._session_read_timeout_seconds if lifted else None
    if lifted:
        session._session_read_timeout_seconds = None
    try:
        with anyio.fail_after(spec.startup_timeout if spec.startup_timeout is not None else math.inf):
            await session.initialize()
    finally:
        if lifted:
            session._session_read_timeout_seconds = saved


@asynccontextmanager
async def open_session(spec: McpServerSpec) -> AsyncIterator[Any]:
    """An initialized ``mcp.ClientSession`` on ``spec``; closed (and a stdio server stopped) on exit.

    Every request on it is bounded by ``spec.request_timeout``.  Failing to start or reach
    the server raises :class:`McpServerError` naming it (:class:`McpTimeoutError` past
    ``spec.startup_timeout``); so does a server that dies or drops the connection while
    the session is in use.  Errors of the caller's own code pass through unchanged.
    """
    from mcp import ClientSession

    entered = False
    body_error: BaseException | None = None
    try:
        async with _transport(spec) as (read, write), ClientSession(
            read, write, read_timeout_seconds=sdk_timeout(spec.request_timeout)
        ) as session:
            await _initialize(session, spec)
            entered = True
            try:
                yield session
            except BaseException as raised:
                body_error = raised
                raise
    except Exception as error:
        if not entered:
            raise _start_error(spec, error) from error
        failure = _in_session_error(spec, error, body_error)
        if failure is None:
            return  # only teardown noise after the caller was done: the session did its work
        if failure is error:
            raise
        failure.__suppress_context__ = True  # anyio's task-group wrapping says nothing
        raise failure  # noqa: B904 - its cause is set


def _start_error(spec: McpServerSpec, error: BaseException) -> McpServerError:
    if isinstance(_single_leaf(error), TimeoutError):
        return McpTimeoutError(
            f"the MCP server {spec.label} ({spec.transport}) did not start and answer `initialize` "
            f"{within(spec.startup_timeout)} (knob: McpServerSpec(startup_timeout=...))"
        )
    return McpServerError(f"could not connect to the MCP server {spec.label} ({spec.transport}): {_describe(error)}")


_TEARDOWN_NOISE = {"anyio.BrokenResourceError", "anyio.ClosedResourceError"}
"""What the SDK's pipe tasks raise when a message arrives for a session already closed (``mcp`` 1.x)."""


def _in_session_error(spec: McpServerSpec, error: BaseException, body_error: BaseException | None) -> BaseException | None:
    """What leaves a session that failed while in use: the caller's own error as itself
    (unwrapped from anyio's task groups), a transport failure as :class:`McpServerError`;
    closed-stream noise at teardown gives way to the caller's error (or to nothing)."""
    if body_error is not None and not isinstance(body_error, Exception) and _cancel_requested():
        return body_error  # we are being cancelled (e.g. rollout_timeout): that must propagate, not a side effect
    leaves = _leaves(error)
    real = [e for e in leaves if not class_names(e) & _TEARDOWN_NOISE]
    if not real:
        if body_error is None:
            return None
        real = [body_error] if isinstance(body_error, Exception) else leaves
    own = [e for e in real if not _transport_failure(e)]
    if own:
        return own[0]
    typed = McpServerError(f"the MCP server {spec.label} ({spec.transport}) failed during the session: {_describe(real[0])}")
    typed.__cause__ = real[0]
    return typed


def _cancel_requested() -> bool:
    """Whether someone cancelled the current task (not just the SDK's own cancel scope)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _transport_failure(error: BaseException) -> bool:
    """A broken connection to the MCP server (not a model call's or the caller's own error)."""
    libraries = {name.split(".")[0] for name in class_names(error)}
    return classify(error) is not None and bool(libraries & {"mcp", "httpx", "httpcore", "anyio"})


def _leaves(error: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, in order; ``[error]`` for a plain one."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for member in error.exceptions for leaf in _leaves(member)]
    return [error]


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


async def list_tools(session: Any, timeout: float | None = DEFAULT_MCP_REQUEST_TIMEOUT) -> tuple[McpTool, ...]:
    """The session's tools; a server that does not answer within ``timeout`` seconds raises
    :class:`McpTimeoutError`, one that fails :class:`McpServerError`."""
    import anyio

    try:
        with anyio.fail_after(timeout if timeout is not None else math.inf):
            return tools_from_listing(await session.list_tools())
    except Exception as error:
        if classify(error) == "timeout":
            raise McpTimeoutError(
                f"the MCP server did not list its tools {within(timeout)} (knob: McpServerSpec(request_timeout=...))"
            ) from error
        raise McpServerError(f"listing the MCP server's tools failed: {_describe(error)}") from error


async def discover(spec_or_session: McpServerSpec | Any) -> Discovery:
    """The tools (name, description, input schema) and resources the server offers."""
    if isinstance(spec_or_session, McpServerSpec):
        async with open_session(spec_or_session) as session:
            return await discover(session)
    session = spec_or_session
    tools = await list_tools(session)
    result = getattr(session, "initialize_result", None)
    info = mcp_field(result, "server_info", "serverInfo") if result is not None and not callable(result) else None
    return Discovery(tools=tools, resources=await _list_resources(session), server_name=getattr(info, "name", None))
