"""Model-call spans inside a rollout: cheap at call time, made real at rollout end.

Why: measured on our 2-core CPU, creating an OpenTelemetry SDK span and serialising the
request and response *between two HTTP round trips* costs 5-8x what the same code
costs in a tight loop (the HTTP stack evicts the caches it runs from).  So inside a
rollout a model call only takes a span id, the parent context, timestamps and
references to the request/response; :meth:`PendingSpans.materialize` later creates
the real spans, with the same ids and the call's own start/end times, in one warm
batch (at the latest when the rollout ends, earlier when many calls are pending).

During the call a :class:`DeferredSpan` is the current span, so spans that lower
layers create (the OpenAI SDK under LangChain, OpenInference's instrumentors) get it
as their parent exactly as they would the real one.  Outside a rollout nothing is
deferred: there is no rollout end to wait for.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any, Callable

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace.id_generator import IdGenerator

from .health import guard, record_error
from .input_delta import InputHistory

FLUSH_AT = 256
"""Materialise once this many finished calls are pending (bounds memory in long rollouts)."""

_random = random.Random()


class PresetSpanIds(IdGenerator):
    """Wraps a tracer's id generator; hands out a preset span id once when one is set.

    How a deferred span gets, at materialisation, the id its children already point to.
    """

    def __init__(self, inner: IdGenerator) -> None:
        self.inner = inner
        self._next = threading.local()

    def preset(self, span_id: int | None) -> None:
        self._next.span_id = span_id

    def generate_span_id(self) -> int:
        span_id = getattr(self._next, "span_id", None)
        if span_id is not None:
            self._next.span_id = None
            return span_id
        return self.inner.generate_span_id()

    def generate_trace_id(self) -> int:
        return self.inner.generate_trace_id()

    def is_trace_id_random(self) -> bool:
        return self.inner.is_trace_id_random()


def install_preset_ids(tracer: Any) -> PresetSpanIds:
    """Give ``tracer`` (tracerl's own, one per provider) a :class:`PresetSpanIds`."""
    generator = tracer.id_generator
    if not isinstance(generator, PresetSpanIds):
        generator = PresetSpanIds(generator)
        tracer.id_generator = generator
    return generator


class DeferredSpan(trace.Span):
    """Stands in for a model-call span until it is materialised; records what is done to it.

    ``start(context, start_time)`` creates the real span (the hook's own start code);
    operations on this object are replayed on it in order; :meth:`defer` queues work
    that needs the real span (building the output attributes) for that moment too.
    After materialisation every call is forwarded to the real span.
    """

    def __init__(self, start: Callable[..., Any], parent: Any) -> None:
        parent_context = trace.get_current_span(parent).get_span_context()
        self._context = trace.SpanContext(
            parent_context.trace_id,
            _random.getrandbits(64) or 1,
            is_remote=False,
            trace_flags=parent_context.trace_flags,
            trace_state=parent_context.trace_state,
        )
        # the parent is the span current *now*: a current-span object may point elsewhere
        # by materialisation time (a LangChain run's scope points at its parent once it ends)
        self._parent = trace.set_span_in_context(trace.NonRecordingSpan(parent_context), parent)
        self._start = start
        self._start_ns = time.time_ns()
        self._end_ns: int | None = None
        self._ops: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self._finish: tuple[Callable[..., Any], tuple[Any, ...]] | None = None
        self._real: Any = None

    # -- the Span API, recorded --------------------------------------------------------------
    def get_span_context(self) -> trace.SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return True

    def _op(self, name: str, *args: Any, **kwargs: Any) -> None:
        if self._real is not None:
            getattr(self._real, name)(*args, **kwargs)
        else:
            self._ops.append((name, args, kwargs))

    def set_attributes(self, attributes: Any) -> None:
        self._op("set_attributes", dict(attributes))

    def set_attribute(self, key: str, value: Any) -> None:
        self._op("set_attribute", key, value)

    def add_event(self, name: str, attributes: Any = None, timestamp: int | None = None) -> None:
        self._op("add_event", name, attributes, timestamp if timestamp is not None else time.time_ns())

    def add_link(self, context: Any, attributes: Any = None) -> None:
        self._op("add_link", context, attributes)

    def update_name(self, name: str) -> None:
        self._op("update_name", name)

    def set_status(self, status: Any, description: str | None = None) -> None:
        self._op("set_status", status, description)

    def record_exception(
        self, exception: BaseException, attributes: Any = None, timestamp: int | None = None, escaped: bool = False
    ) -> None:
        self._op("record_exception", exception, attributes, timestamp or time.time_ns(), escaped)

    def end(self, end_time: int | None = None) -> None:
        if self._real is not None:
            self._real.end(end_time)
        elif self._end_ns is None:
            self._end_ns = end_time or time.time_ns()

    def defer(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call ``fn(real_span, *args, end_time=...)`` at materialisation; ``fn`` ends the span."""
        if self._real is not None:
            fn(self._real, *args)
            return
        self._finish = (fn, args)
        self._end_ns = time.time_ns()

    @property
    def ended(self) -> bool:
        return self._end_ns is not None

    # -- materialisation -----------------------------------------------------------------------
    def materialize(self, ids: PresetSpanIds) -> None:
        """Create the real span with this span's id and times, replay what was recorded."""
        ids.preset(self._context.span_id)
        try:
            real = self._start(context=self._parent, start_time=self._start_ns)
        finally:
            ids.preset(None)
        if real.is_recording() and real.get_span_context().span_id != self._context.span_id:
            record_error("deferred_span_id")  # children keep pointing at the recorded id
        for name, args, kwargs in self._ops:
            getattr(real, name)(*args, **kwargs)
        self._ops.clear()
        self._real = real
        if self._finish is not None:
            fn, args = self._finish
            self._finish = None
            fn(real, *args, end_time=self._end_ns)
        elif self._end_ns is not None:
            real.end(self._end_ns)


class PendingSpans:
    """The deferred spans of one rollout (thread-safe; bounded by :data:`FLUSH_AT`)."""

    def __init__(self, ids: PresetSpanIds) -> None:
        self._ids = ids
        self._spans: list[DeferredSpan] = []
        self._lock = threading.Lock()
        self.inputs = InputHistory()
        """The recent model-call inputs, so each call's span stores only its new messages."""

    def open(self, start: Callable[..., Any]) -> DeferredSpan:
        span = DeferredSpan(start, otel_context.get_current())
        with self._lock:
            self._spans.append(span)
            full = len(self._spans) >= FLUSH_AT
        if full:
            self.materialize(only_ended=True)
        return span

    def materialize(self, *, only_ended: bool = False) -> None:
        """Make pending spans real, oldest first (all of them, or those whose call has ended)."""
        with self._lock:
            if only_ended:
                ready = [s for s in self._spans if s.ended]
                self._spans = [s for s in self._spans if not s.ended]
            else:
                ready, self._spans = self._spans, []
        for span in ready:
            with guard("deferred_span"):
                span.materialize(self._ids)

    def __len__(self) -> int:
        return len(self._spans)
