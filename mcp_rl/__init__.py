"""MCP•RL (planned): discover an MCP server's tools, generate practice tasks, roll out, judge with RULER, train.

Not built yet; the pieces it will compose exist (``tracerl.integrations`` MCP capture,
``tracerl.ruler``, ``tracerl.LocalBackend``).
"""
