"""A tiny, real MCP server over streamable HTTP, for the capture and MCP•RL tests.

    python tests/mcp_http_server.py --port 8765        # serves http://127.0.0.1:8765/mcp

Tools: ``add(a, b)`` (returns the sum), ``reverse(text)`` and ``fail(reason)`` (always
raises, so the client gets an ``isError`` result).  One resource, ``notes://readme``.
With ``--faults`` (the fault-injection tests) also ``pid()`` (the server's process id),
``hang()`` (never answers), ``freeze()`` (blocks the whole server process) and ``crash()``
(the process exits mid-call, ``os._exit``).  ``--transport stdio`` speaks MCP on
stdin/stdout instead; ``--pid-file PATH`` writes the server's process id there first (so a
test can check that the server is gone after a rollout that was cancelled or timed out).
Written against the ``mcp`` SDK (2.x ``MCPServer``; 1.x ``FastMCP`` where that is what is
installed).  :class:`McpHttpServer` runs it in a subprocess on a free port and waits until
it answers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from loopback_app import free_port


def build_server(faults: bool = False):
    try:
        from mcp.server.mcpserver import MCPServer as Server
        from mcp.server.mcpserver.exceptions import ToolError
    except ImportError:  # mcp 1.x
        from mcp.server.fastmcp import FastMCP as Server  # type: ignore[no-redef]
        from mcp.server.fastmcp.exceptions import ToolError  # type: ignore[no-redef]

    server = Server("tracerl-test-tools")

    @server.tool()
    def add(a: int, b: int) -> int:
        """Add two integers and return the sum."""
        return a + b

    @server.tool()
    def reverse(text: str) -> str:
        """Reverse a piece of text."""
        return text[::-1]

    @server.tool()
    def fail(reason: str) -> str:
        """A tool that always fails (for error handling tests)."""
        raise ToolError(f"failed on purpose: {reason}")  # its message reaches the client

    @server.resource("notes://readme", name="readme", description="What this server is for.")
    def readme() -> str:
        return "A calculator and text server used by tracerl's tests."

    if faults:
        _add_faulty_tools(server)
    return server


def _add_faulty_tools(server) -> None:
    @server.tool()
    def pid() -> int:
        """The server's process id."""
        return os.getpid()

    @server.tool()
    async def hang() -> str:
        """Never answers (the server itself stays responsive)."""
        await asyncio.sleep(3600)
        return "too late"

    @server.tool()
    def freeze() -> str:
        """Blocks the server's event loop: the whole process stops answering."""
        time.sleep(3600)
        return "too late"

    @server.tool()
    def crash() -> str:
        """The server process dies in the middle of the call."""
        os._exit(3)


class McpHttpServer:
    """``with McpHttpServer() as server: server.url`` — the server runs in a child process."""

    def __init__(self, port: int | None = None, *, faults: bool = False) -> None:
        self.port = port or free_port()
        self.faults = faults
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def start(self, timeout_s: float = 60.0) -> "McpHttpServer":
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--port", str(self.port), *(["--faults"] if self.faults else [])],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                raise RuntimeError(f"MCP HTTP server exited with {self.process.returncode}: {err[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"MCP HTTP server did not listen on port {self.port} within {timeout_s}s")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)  # our own child's process group, by id
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def __enter__(self) -> "McpHttpServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--transport", choices=("streamable-http", "stdio"), default="streamable-http")
    parser.add_argument("--faults", action="store_true", help="also serve the faulty tools")
    parser.add_argument("--pid-file", help="write this process's id here before serving")
    options = parser.parse_args()
    if options.pid_file:
        Path(options.pid_file).write_text(str(os.getpid()))
    port = options.port
    server = build_server(faults=options.faults)
    if options.transport == "stdio":
        server.run(transport="stdio")
    elif hasattr(server, "settings") and hasattr(server.settings, "port"):  # mcp 1.x: host/port are settings
        server.settings.host, server.settings.port = "127.0.0.1", port
        server.run(transport="streamable-http")
    else:
        server.run(transport="streamable-http", host="127.0.0.1", port=port)
