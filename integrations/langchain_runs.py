"""LangChain / LangGraph runs as nested spans: the graph, its nodes, subgraphs, chains,
retrievers, tools and chat models, parented as Langfuse's own LangChain integration
parents them.

What Langfuse's ``langfuse.langchain.CallbackHandler`` does, and so what we do:

* every run gets a span, parented by LangChain's ``parent_run_id`` (the run's own
  tree, not whatever span happens to be current), a root run under the current span;
* the name is the run's name: the ``name`` keyword, else ``serialized["name"]``, else
  the last part of ``serialized["id"]``, else ``<unknown>`` (so a LangGraph graph is
  ``LangGraph``, a node its node name, ``create_agent``'s nodes ``model`` and
  ``tools``; parallel branches are sibling spans, each in its own asyncio task);
* the type is ``chain``, or ``agent`` when the run's class path or name contains
  "agent", or ``retriever`` / ``tool`` / ``generation`` for those callbacks;
* the run's span is made current while it runs, so spans written below it — the OpenAI
  SDK's under ``ChatOpenAI``, MCP's under a tool — nest under it (attached on start,
  detached on end; where LangChain ends a run in another context the attachment cannot
  be undone, and a :class:`RunScope` makes it point at the parent instead);
* the run's metadata (LangGraph's ``langgraph_node``, ``langgraph_step``,
  ``langgraph_path``, ``langgraph_checkpoint_ns``...) and tags are kept.

Attributes follow OpenInference, which Phoenix shows natively and Langfuse maps
(``openinference.span.kind`` CHAIN / AGENT / RETRIEVER -> observation types chain /
agent / retriever; ``metadata`` as one JSON object).  Chain inputs and outputs (whole
graph states) are not copied onto spans: the chat and tool spans already carry the
messages, and copying states would cost every run.  The trajectory converter ignores
these spans (they describe no model call and no tool run).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence
from uuid import UUID

from opentelemetry import context as otel_context
from opentelemetry import trace

from . import semconv as sc
from .health import record_error
from .processor import get_tracer
from .spans import end_with_error

MAX_OPEN_RUNS = 10_000
"""Runs that never end (a cancelled graph) must not grow memory without bound."""

KIND_CHAIN, KIND_AGENT, KIND_RETRIEVER = "CHAIN", "AGENT", "RETRIEVER"


def run_name(serialized: Mapping[str, Any] | None, kwargs: Mapping[str, Any]) -> str:
    """A run's name, by Langfuse's rule (``CallbackHandler.get_langchain_run_name``)."""
    name = kwargs.get("name")
    if name is not None:
        return str(name)
    if not serialized:
        return "<unknown>"
    if serialized.get("name") is not None:
        return str(serialized["name"])
    ids = serialized.get("id")
    if isinstance(ids, (list, tuple)) and ids:
        return str(ids[-1])
    return "<unknown>"


def chain_kind(serialized: Mapping[str, Any] | None, name: str) -> str:
    """``AGENT`` when the class path or the name says agent (Langfuse's rule), else ``CHAIN``."""
    ids = (serialized or {}).get("id")
    if isinstance(ids, (list, tuple)) and any("agent" in str(part).lower() for part in ids):
        return KIND_AGENT
    return KIND_AGENT if "agent" in name.lower() else KIND_CHAIN


def run_metadata(metadata: Mapping[str, Any] | None, tags: Sequence[str] | None) -> dict[str, Any] | None:
    """Tags and metadata joined as Langfuse joins them (``tags`` beside the metadata keys)."""
    out: dict[str, Any] = {}
    if tags:
        out["tags"] = list(tags)
    if metadata:
        out.update(metadata)
    return out or None


class RunScope(trace.Span):
    """What is current while a run runs: its span, and once the run has ended, its parent.

    Why: in async code LangChain calls ``on_*_end`` / ``on_*_error`` in a *copy* of the
    caller's context (``@shielded`` handlers run in a new task), so the context the run's
    span was attached to can never be detached there; it stays set after the run.  This
    object makes that harmless: after :meth:`close` everything — the span context that
    new child spans take as parent, attributes, events — goes to the parent (recursively),
    as if the run's span had been detached.  ``end()`` ends the run's own span only.
    """

    def __init__(self, span: Any, parent: Any) -> None:
        self.span = span
        self.parent = parent
        self.closed = False

    def target(self) -> Any:
        scope: Any = self
        while isinstance(scope, RunScope) and scope.closed:
            scope = scope.parent
        return scope.span if isinstance(scope, RunScope) else scope

    def close(self) -> None:
        self.closed = True

    def get_span_context(self) -> trace.SpanContext:
        return self.target().get_span_context()

    def is_recording(self) -> bool:
        return bool(self.target().is_recording())

    def end(self, end_time: int | None = None) -> None:
        if not self.closed:
            self.span.end(end_time)

    def set_attributes(self, attributes: Any) -> None:
        self.target().set_attributes(attributes)

    def set_attribute(self, key: str, value: Any) -> None:
        self.target().set_attribute(key, value)

    def add_event(self, name: str, attributes: Any = None, timestamp: int | None = None) -> None:
        self.target().add_event(name, attributes, timestamp)

    def add_link(self, context: Any, attributes: Any = None) -> None:
        self.target().add_link(context, attributes)

    def update_name(self, name: str) -> None:
        self.target().update_name(name)

    def set_status(self, status: Any, description: str | None = None) -> None:
        self.target().set_status(status, description)

    def record_exception(
        self, exception: BaseException, attributes: Any = None, timestamp: int | None = None, escaped: bool = False
    ) -> None:
        self.target().record_exception(exception, attributes, timestamp, escaped)


@dataclass
class _Run:
    scope: RunScope
    token: Any


class RunSpans:
    """The open spans of LangChain runs, by run id, each current (as a :class:`RunScope`)
    while its run runs."""

    def __init__(self, max_open: int = MAX_OPEN_RUNS) -> None:
        self._runs: dict[UUID, _Run] = {}
        self._lock = threading.Lock()
        self._max_open = max_open

    def parent(self, parent_run_id: UUID | None) -> RunScope | None:
        """The scope of the parent run, when it is one of ours (else ``None``: the current span)."""
        run = self._runs.get(parent_run_id) if parent_run_id is not None else None
        return run.scope if run is not None else None

    def start(self, run_id: UUID, parent_run_id: UUID | None, make: Callable[[], Any]) -> Any:
        """Start a run's span (``make()``) under its parent run's, keep it, make it current.

        The parent run's span is made current only for ``make()`` (unless it is already, or the
        parent is not one of ours): no context manager, as this runs for every LangChain run."""
        parent = self.parent(parent_run_id)
        enter = parent is not None and trace.get_current_span() is not parent
        token = otel_context.attach(trace.set_span_in_context(parent)) if enter else None
        try:
            span = make()
        finally:
            if token is not None:
                otel_context.detach(token)
        self.open(run_id, span, parent_run_id)
        return span

    def open(self, run_id: UUID, span: Any, parent_run_id: UUID | None = None) -> None:
        """Keep ``span`` for ``run_id`` and make it current (children nest under it)."""
        scope = RunScope(span, self.parent(parent_run_id) or trace.get_current_span())
        token = otel_context.attach(trace.set_span_in_context(scope))
        with self._lock:
            stale = self._runs.pop(next(iter(self._runs))) if len(self._runs) >= self._max_open else None
            self._runs[run_id] = _Run(scope, token)
        if stale is not None:
            stale.scope.close()
            stale.scope.span.end()
            record_error("langchain_open_runs_overflow")

    def close(self, run_id: UUID) -> Any:
        """Forget ``run_id``, stop its span being current; returns the span (``None`` if unknown)."""
        with self._lock:
            run = self._runs.pop(run_id, None)
        if run is None:
            return None
        run.scope.close()
        _detach(run.token)
        return run.scope.span

    def get(self, run_id: UUID) -> Any:
        """The span of an open run (``None`` if unknown)."""
        run = self._runs.get(run_id)
        return run.scope.span if run is not None else None

    def __len__(self) -> int:
        return len(self._runs)


def _quiet(record: logging.LogRecord) -> bool:
    """Drops OpenTelemetry's "Failed to detach context" error while :func:`_detach` runs."""
    return "Failed to detach context" not in record.getMessage()


def _detach(token: Any) -> None:
    """Detach, quietly when the token belongs to another context (a run ended in another task).

    OpenTelemetry's ``detach`` then logs an error with a traceback; the run's :class:`RunScope`
    is closed by then, so, like Langfuse's handler (which has no such scope and leaves the
    ended span current), we drop it: a logging filter on the ``opentelemetry.context`` logger
    for the length of the call.
    """
    logger = logging.getLogger("opentelemetry.context")
    logger.addFilter(_quiet)
    try:
        otel_context.detach(token)
    except Exception:  # noqa: BLE001
        pass
    finally:
        logger.removeFilter(_quiet)


def start_run_span(
    name: str, kind: str, metadata: dict[str, Any] | None, extra: dict[str, Any] | None = None
) -> Any:
    """Start the span of a chain / agent / retriever run under the current span."""
    attributes: dict[str, Any] = {sc.OI_SPAN_KIND: kind, sc.LAYER: "langchain"}
    if metadata:
        attributes[sc.OI_METADATA] = json.dumps(metadata, default=str, ensure_ascii=False)
    if extra:
        attributes.update(extra)
    return get_tracer().start_span(name, kind=trace.SpanKind.INTERNAL, attributes=attributes)


def end_run_span(span: Any, error: BaseException | None = None, *, control_flow: tuple[type, ...] = ()) -> None:
    """End a run's span; an error marks it failed, except LangGraph's control flow
    (``GraphBubbleUp``: interrupts, handoffs), which Langfuse keeps at level DEFAULT."""
    if span is None:
        return
    if error is None or isinstance(error, control_flow):
        span.end()
    else:
        end_with_error(span, error)


def retrieved_documents(documents: Sequence[Any]) -> dict[str, Any]:
    """OpenInference's ``retrieval.documents.N.document.*`` attributes for a retriever's output."""
    out: dict[str, Any] = {}
    for index, document in enumerate(documents):
        prefix = f"{sc.OI_RETRIEVAL_DOCUMENTS}.{index}.document."
        out[prefix + "content"] = str(getattr(document, "page_content", document))
        if getattr(document, "id", None) is not None:
            out[prefix + "id"] = str(document.id)
        metadata = getattr(document, "metadata", None)
        if metadata:
            out[prefix + "metadata"] = json.dumps(metadata, default=str, ensure_ascii=False)
    return out


def control_flow_errors() -> tuple[type, ...]:
    """LangGraph's ``GraphBubbleUp`` (interrupts, ``Command`` handoffs), when LangGraph is installed."""
    try:
        from langgraph.errors import GraphBubbleUp
    except ImportError:
        return ()
    return (GraphBubbleUp,)

