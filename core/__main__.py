"""``python -m tracerl``: the same command line as ``tracerl``."""

from .cli import app

app(prog_name="tracerl")
