"""Exporters, one file per job: spans to any OTLP/HTTP backend, Langfuse's mapping, scores.

* ``otlp.py`` — one processor per destination; :meth:`otlp.Exporter.outgoing` is the one
  place every outgoing span passes (on the export thread, on copies).
* ``langfuse.py`` — Langfuse's attribute mapping, its keys, its SDK beside ours.
* ``traces.py`` — the trace-level fields of each trace tracerl starts (name, session…).
* ``scores.py`` — rewards, RULER verdicts and group scores, to every destination.
* ``evaluations.py`` — evaluator observations: scores in their trace, the RULER judge call.
* ``steps.py`` — each ``model.log`` as a ``training step`` trace with its metrics as scores.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping

from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from tracerl.errors import ConfigError

from ..outbound import mark_internal_url
from . import langfuse, otlp, scores
from .langfuse import langfuse_attributes, langfuse_sdk_own_spans, langfuse_span_filter
from .otlp import ExportError
from .scores import ScoreSender, export_scores
from .steps import export_step

__all__ = [
    "ExportError",
    "export_scores",
    "export_step",
    "export_to_langfuse",
    "export_to_otlp",
    "langfuse_attributes",
    "langfuse_sdk_own_spans",
    "langfuse_span_filter",
]

def export_to_langfuse(
    host: str | None = None, public_key: str | None = None, secret_key: str | None = None, *,
    tracer_provider: TracerProvider | None = None, timeout_s: float = 10.0, check: bool = False,
    environment: str | None = None, release: str | None = None, prices: Mapping[str, Any] | None = None,
) -> SpanProcessor:  # fmt: skip
    """Send spans (OTLP/HTTP protobuf, gzip) and scores to Langfuse, in Langfuse's mapping.

    Arguments left out come from ``LANGFUSE_BASE_URL`` / ``LANGFUSE_HOST`` (default Langfuse
    Cloud), ``LANGFUSE_PUBLIC_KEY``, ``LANGFUSE_SECRET_KEY``, ``LANGFUSE_TRACING_ENVIRONMENT``
    and ``LANGFUSE_RELEASE`` (default: the checkpoint, ``name@step``); missing or swapped
    keys and a bad environment raise :class:`~tracerl.ConfigError`.  ``prices`` maps a model
    name to (USD per million input tokens, USD per million output tokens); models served by
    tracerl cost zero, hosted ones are priced by Langfuse.  ``check=True`` also asks Langfuse
    whether it accepts the keys.  A Langfuse SDK client on the same provider, created with
    ``should_export_span=langfuse_sdk_own_spans``, keeps sending its own spans; tracerl sends
    the rest, each span once.
    """
    host = langfuse.langfuse_host(host)
    for path in (langfuse.SCORES_PATH, langfuse.PROJECTS_PATH):  # tracerl's own traffic (OTEL_PATH: in attach)
        mark_internal_url(host + path)
    headers = langfuse.auth_headers(public_key, secret_key)
    where = langfuse.destination(environment, release, prices)
    if check:
        langfuse.check_keys(host, headers, timeout_s)
    processor = otlp.attach(
        host + langfuse.OTEL_PATH, headers, tracer_provider, timeout_s, "gzip", where,
        make_scores=lambda: ScoreSender(host, headers, timeout_s), skip_sdk_spans=True,
    )  # fmt: skip
    install_hooks()
    return processor


def export_to_otlp(
    endpoint: str, *, headers: Mapping[str, str] | None = None, tracer_provider: TracerProvider | None = None,
    timeout_s: float = 10.0, compression: str = "gzip", add_langfuse_attributes: bool = True,
    environment: str | None = None,
) -> SpanProcessor:  # fmt: skip
    """Send every span of the provider tracerl captures on (rollouts, gen_ai spans from any
    instrumentor) to an OTLP/HTTP endpoint, e.g. ``http://localhost:6006/v1/traces`` (Phoenix).

    With ``add_langfuse_attributes`` (default) the spans carry Langfuse's mapping (for a
    Langfuse behind a collector) and an outer layer of a model call is sent as a plain span,
    so no backend counts a request twice; ``environment`` is written as ``langfuse.environment``.
    Returns the processor (``force_flush()`` / ``shutdown()``); calling again with the same
    endpoint returns the same one.  Raises :class:`~tracerl.ConfigError` for a bad URL or compression.
    """
    url = langfuse.check_url(endpoint, "OTLP endpoint")
    if compression not in ("gzip", "deflate", "none"):
        raise ConfigError(f"compression must be 'gzip', 'deflate' or 'none', not {compression!r}")
    where = langfuse.destination(environment, None, None) if add_langfuse_attributes else None
    processor = otlp.attach(url, headers, tracer_provider, timeout_s, compression, where)
    install_hooks()
    return processor


_hooks_lock = threading.Lock()
_hooks_installed = False


def install_hooks() -> None:
    """Rollout start/end, RULER's ``apply_scores``, the judge and ``model.log`` report to the exporters (once)."""
    global _hooks_installed
    with _hooks_lock:
        if _hooks_installed:
            return
        _hooks_installed = True
    from tracerl.model import on_log
    from tracerl.ruler.group import on_scores_applied

    from ..rollout import end_hooks, start_hooks

    start_hooks.append(scores.on_rollout_start)
    end_hooks.append(scores.on_rollout_end)
    on_scores_applied.append(scores.on_scores_applied)
    on_log.append(export_step)
