"""The errors importers raise (both under :class:`tracerl.TracerlError`)."""

from __future__ import annotations

from tracerl.errors import TracerlError


class TraceImportError(TracerlError, ValueError):
    """What was to be imported cannot be read: a malformed or torn file, an unknown shape."""


class TraceSourceError(TracerlError, ConnectionError):
    """The trace store (Langfuse's API) could not be reached, refused the keys, or kept failing."""
