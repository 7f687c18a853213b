"""A small calculator MCP server over stdio (the ``mcp`` SDK), for ``examples/mcp_rl_calculator.py``.

    python examples/mcp_calculator_server.py          # speaks MCP on stdin/stdout

Tools: ``add(a, b)`` and ``multiply(a, b)`` on integers; each returns the result as text.
"""

from __future__ import annotations


def build_server():
    try:
        from mcp.server.mcpserver import MCPServer as Server
    except ImportError:  # mcp 1.x
        from mcp.server.fastmcp import FastMCP as Server  # type: ignore[no-redef]

    server = Server("tracerl-calculator")

    @server.tool()
    def add(a: int, b: int) -> int:
        """Add two integers and return the sum."""
        return a + b

    @server.tool()
    def multiply(a: int, b: int) -> int:
        """Multiply two integers and return the product."""
        return a * b

    return server


if __name__ == "__main__":
    build_server().run(transport="stdio")
