"""An MCP server (the ``mcp`` SDK, stdio) whose ``add`` tool takes 0.5-2 s, for ``bench/pipeline.py``.

    python bench/slow_add_server.py          # speaks MCP on stdin/stdout

The wait stands for what agent tools really cost (an API, a database, a browser): a uniform
0.5-2.0 s ``asyncio.sleep`` per call, so concurrent calls wait side by side.
"""

from __future__ import annotations

import asyncio
import random


def build_server():
    try:
        from mcp.server.mcpserver import MCPServer as Server
    except ImportError:  # mcp 1.x
        from mcp.server.fastmcp import FastMCP as Server  # type: ignore[no-redef]

    server = Server("tracerl-slow-add")

    @server.tool()
    async def add(a: int, b: int) -> int:
        """Add two integers and return the sum (slowly)."""
        await asyncio.sleep(random.uniform(0.5, 2.0))
        return a + b

    return server


if __name__ == "__main__":
    build_server().run()
