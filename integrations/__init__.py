"""Capture: agents run unchanged; OpenTelemetry spans become trajectories.

``async with rollout(model, task=...) as r:`` scopes one attempt and leaves
``r.trajectory``; entering it hooks the OpenAI SDK, LiteLLM, LangChain/LangGraph and the MCP
client (those installed; ``instrument()`` does it explicitly, e.g. to pick the tracer
provider), and a rollout that sent model requests it did not capture raises a
:class:`CaptureWarning` with the likely cause.  ``export_to_langfuse()`` / ``export_to_otlp(url)`` also send
the spans, rewards and RULER scores to an observability backend; an exporter of your own
wrapped in ``OutboundSpanExporter`` gets the spans as they do (redacted, full inputs).  Importing this package
stays light: hooks and exporters import their library only when enabled.
"""

from __future__ import annotations

from . import langgraph
from .convert import spans_to_trajectory
from .endpoints import is_tracerl_endpoint, register_endpoint, unregister_endpoint
from .export import export_scores, export_to_langfuse, export_to_otlp
from .health import error_counts as capture_error_counts
from .health import reset_error_counts
from .instrument import instrument, uninstrument
from .missed import CaptureWarning
from .outbound import OutboundSpanExporter
from .processor import CaptureProcessor, TokenRecord, get_tracer_provider
from .processor import configure as configure_tracing
from .rollout import Rollout, current_rollout, rollout, trajectory, trajectory_group

__all__ = [
    "CaptureProcessor",
    "CaptureWarning",
    "OutboundSpanExporter",
    "Rollout",
    "TokenRecord",
    "capture_error_counts",
    "configure_tracing",
    "current_rollout",
    "export_scores",
    "export_to_langfuse",
    "export_to_otlp",
    "get_tracer_provider",
    "instrument",
    "is_tracerl_endpoint",
    "langgraph",
    "register_endpoint",
    "reset_error_counts",
    "rollout",
    "spans_to_trajectory",
    "trajectory",
    "trajectory_group",
    "uninstrument",
    "unregister_endpoint",
]
