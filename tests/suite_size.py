"""Tiny or full: how much of a long real-model journey a test runs.

``make test`` runs each such test in its tiny configuration (the same code paths and assertions, fewer
steps, rollouts, streams or tokens); ``TRACERL_FULL=1`` (``make test-long``) runs the full one as well.
"""

from __future__ import annotations

import os

FULL = os.environ.get("TRACERL_FULL", "") not in ("", "0")
"""``TRACERL_FULL=1``: the full configurations (``make test-long``)."""


def tiny_or_full(tiny, full):
    """``full`` under ``TRACERL_FULL=1``, else ``tiny``."""
    return full if FULL else tiny
