"""FastAPI apps that never trace themselves into the user's OpenTelemetry provider.

tracerl's HTTP servers (``tracerl serve``, the vLLM proxy, the transformers server) often run
inside the user's process, where a global SDK tracer provider exports to Langfuse or an OTLP
backend.  Measured: every request to them then became spans in the user's traces, from

- FastAPI's built-in telemetry (recent releases, 0.165 here: it traces every request, dependency
  and endpoint, and logs exceptions, whenever the global tracer provider is an SDK one;
  ``FastAPI(telemetry=...)`` turns it off),
- OpenTelemetry's contrib instrumentation (``opentelemetry-instrument``,
  ``FastAPIInstrumentor().instrument()``, ``HTTPXClientInstrumentor``), which wraps every FastAPI
  app and the httpx client that serve's proxy forwards requests with.

:func:`untraced_fastapi` builds the app with FastAPI's telemetry off and handles each request
inside OpenTelemetry's "suppress instrumentation" context, which the contrib ASGI, FastAPI and
httpx instrumentations (and OpenInference's) honour.  The user's own FastAPI apps are untouched.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["suppressed_context", "untraced_fastapi"]

_TELEMETRY_OFF = {"tracing": False, "metrics": False, "logs": False}
_classes: dict[type, type] = {}


def suppressed_context() -> Any:
    """The current OpenTelemetry context with instrumentation (HTTP included) suppressed."""
    from opentelemetry import context
    from opentelemetry.instrumentation.utils import suppress_http_instrumentation, suppress_instrumentation

    with suppress_instrumentation(), suppress_http_instrumentation():  # the public way to set the keys
        return context.get_current()


def untraced_fastapi(**kwargs: Any) -> Any:
    """``FastAPI(**kwargs)`` that emits no spans, metrics or logs into the user's providers."""
    import fastapi

    base = fastapi.FastAPI  # contrib's FastAPIInstrumentor may have replaced it: subclass what is there
    if "telemetry" in inspect.signature(base.__init__).parameters:
        kwargs.setdefault("telemetry", dict(_TELEMETRY_OFF))
    return _untraced_class(base)(**kwargs)


def _untraced_class(base: type) -> type:
    cls = _classes.get(base)
    if cls is None:

        class UntracedFastAPI(base):  # type: ignore[valid-type, misc]
            """Handles every request with instrumentation suppressed (see :mod:`tracerl.net.untraced`)."""

            async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
                from opentelemetry import context

                token = context.attach(suppressed_context())
                try:
                    await super().__call__(scope, receive, send)
                finally:
                    context.detach(token)

        cls = _classes[base] = UntracedFastAPI
    return cls
