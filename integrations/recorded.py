"""One hooked model call: the current span while it runs, the call's record once it ends.

Capture has one route.  Every hook (OpenAI SDK, Responses and Messages APIs, LiteLLM,
LangChain) opens a :class:`ModelCallSpan` when a call starts and ends it with what the
call returned; ``spans.end_chat_span`` builds the converter's ``ModelCall`` right there
(``convert.new_model_call``, the one builder).  Inside a rollout the ended call goes to the
rollout's buffer; the converter reads the records, never a span of ours.

While the call runs the object is the current OpenTelemetry span, with a real span id, so
spans that lower layers make (OpenInference's instrumentors, an SDK's own tracing) point at it
as their parent.  OpenTelemetry spans for exporters (Langfuse, OTLP, a user's own provider)
are made from the records through the SDK's public API (:meth:`ModelCallSpan.emit`), with the ids and times
the call had, and only when something listens (:func:`listening`): a provider the user set up,
or a processor added to tracerl's own.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any, Callable

from opentelemetry import trace
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator

from .health import record_error

_random = random.Random()


def new_span_id() -> int:
    """A random, valid (non-zero) 64-bit span id, as the SDK's generator makes them."""
    return _random.getrandbits(64) or 1


def new_trace_id() -> int:
    return _random.getrandbits(128) or 1


class CaptureTracerProvider(TracerProvider):
    """tracerl's own provider (when the application set up none): counts the processors added
    besides capture's, so spans for exporters are made only when one listens."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.listeners = 0
        self.capture_processor: SpanProcessor | None = None

    def add_span_processor(self, span_processor: SpanProcessor) -> None:
        super().add_span_processor(span_processor)
        if span_processor is not self.capture_processor:
            self.listeners += 1


def listening(provider: TracerProvider | None) -> bool:
    """Whether spans made on ``provider`` reach anyone but capture: always on a provider the
    application set up; on tracerl's own once a processor (an exporter) was added to it."""
    return provider is not None and (not isinstance(provider, CaptureTracerProvider) or provider.listeners > 0)


class PresetIds(IdGenerator):
    """Wraps a tracer's id generator; hands out preset ids once when they are set.

    How a span made from a record gets the ids the call's children already point to.  The
    generator is set through the SDK tracer's public ``id_generator`` attribute.
    """

    def __init__(self, inner: IdGenerator) -> None:
        self.inner = inner
        self._next = threading.local()

    def preset(self, trace_id: int | None, span_id: int | None) -> None:
        self._next.trace_id, self._next.span_id = trace_id, span_id

    def _take(self, kind: str) -> int | None:
        preset = getattr(self._next, kind, None)
        setattr(self._next, kind, None)
        return preset

    def generate_span_id(self) -> int:
        return self._take("span_id") or self.inner.generate_span_id()

    def generate_trace_id(self) -> int:
        return self._take("trace_id") or self.inner.generate_trace_id()

    def is_trace_id_random(self) -> bool:
        return self.inner.is_trace_id_random()


def install_preset_ids(tracer: Any) -> PresetIds:
    """Give ``tracer`` (tracerl's own, one per provider) a :class:`PresetIds`."""
    generator = tracer.id_generator
    if not isinstance(generator, PresetIds):
        generator = PresetIds(generator)
        tracer.id_generator = generator
    return generator


class ModelCallSpan(trace.Span):
    """A model call in flight, then its record.

    ``describe(self)`` (the span writer's, ``spans.py``) builds the attributes of the span made for
    exporters; ``call`` holds the converter's record once the call returned a choice.  Attributes, events, status and
    exceptions that other code sets on it are kept and replayed on the span made from it.
    """

    def __init__(self, name: str, parent: trace.SpanContext, describe: Callable[["ModelCallSpan"], dict[str, Any]], *,
                 span_id: int | None = None, on_end: Callable[["ModelCallSpan"], None] | None = None) -> None:  # fmt: skip
        self.name = name
        self.parent = parent if parent.is_valid else None
        self.context = trace.SpanContext(
            parent.trace_id if parent.is_valid else new_trace_id(),
            span_id or new_span_id(),
            is_remote=False,
            trace_flags=parent.trace_flags if parent.is_valid else trace.TraceFlags(trace.TraceFlags.SAMPLED),
            trace_state=parent.trace_state if parent.is_valid else None,
        )
        self.describe = describe
        self.on_end = on_end
        self.start_ns = time.time_ns()
        self.end_ns: int | None = None
        self.request: Any = None
        """What the hook saw of the request (``spans.ChatRequest``)."""
        self.answer: Any = None
        """What the call returned (``spans.ChatAnswer``); None while running, or when it failed."""
        self.call: Any = None
        """The converter's ``ModelCall``, built when the call returned a choice."""
        self.extra: dict[str, Any] = {}
        self.ops: list[tuple[str, tuple[Any, ...]]] = []

    # -- the Span API ------------------------------------------------------------------------
    def get_span_context(self) -> trace.SpanContext:
        return self.context

    def is_recording(self) -> bool:
        return self.end_ns is None

    def set_attributes(self, attributes: Any) -> None:
        if self.end_ns is None:
            self.extra.update(attributes)

    def set_attribute(self, key: str, value: Any) -> None:
        if self.end_ns is None:
            self.extra[key] = value

    def _op(self, name: str, *args: Any) -> None:
        if self.end_ns is None:  # replayed on the span made from this record
            self.ops.append((name, args))

    def add_event(self, name: str, attributes: Any = None, timestamp: int | None = None) -> None:
        self._op("add_event", name, attributes, timestamp or time.time_ns())

    def add_link(self, context: Any, attributes: Any = None) -> None:
        self._op("add_link", context, attributes)

    def update_name(self, name: str) -> None:
        self._op("update_name", name)

    def set_status(self, status: Any, description: str | None = None) -> None:
        self._op("set_status", status, description)

    def record_exception(self, exception: BaseException, attributes: Any = None, timestamp: int | None = None,
                         escaped: bool = False) -> None:  # fmt: skip
        self._op("record_exception", exception, attributes, timestamp or time.time_ns(), escaped)

    def end(self, end_time: int | None = None) -> None:
        if self.end_ns is not None:
            return
        self.end_ns = end_time or time.time_ns()
        if self.on_end is not None:
            try:
                self.on_end(self)
            except Exception as error:  # noqa: BLE001 - never raise into the hook's caller
                record_error("model_call_end", error)

    # -- the span for exporters ------------------------------------------------------------------
    def emit(self, tracer: Any, ids: PresetIds) -> None:
        """Make this call's OpenTelemetry span on ``tracer`` (public SDK API): its ids, times,
        attributes, then what was done to it."""
        parent = trace.set_span_in_context(trace.NonRecordingSpan(self.parent)) if self.parent else None
        ids.preset(self.context.trace_id, self.context.span_id)
        try:
            span = tracer.start_span(self.name, context=parent, kind=trace.SpanKind.CLIENT,
                                     attributes={**self.describe(self), **self.extra}, start_time=self.start_ns)  # fmt: skip
        finally:
            ids.preset(None, None)
        for name, args in self.ops:
            getattr(span, name)(*args)
        span.end(self.end_ns)
