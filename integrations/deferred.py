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

When tracerl's processor is the only one on the provider (nothing exports, nothing else
listens) the batch is made by :class:`CaptureOnlyTracer`: the same attributes, ids, times
and sampling decision, handed to the processor as finished ``ReadableSpan``s without the
SDK's live-span machinery (locks, attribute re-validation, processor fan-out) that only
matters while a span is open to other code.  Anyone attaching a processor or exporter gets
SDK spans again from the next batch on.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any, Callable

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SynchronousMultiSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from opentelemetry.trace.status import Status, StatusCode

from .health import record_error
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


_ATTRIBUTE_OPS = frozenset({"set_attribute", "set_attributes"})
MAKE_SPAN: Any = object()
"""What a deferred span's ``describe`` returns when its call needs a real span after all."""
_UNSET = Status(StatusCode.UNSET)


def new_span_id() -> int:
    """A random, valid (non-zero) 64-bit span id, as the SDK's generator makes them."""
    return _random.getrandbits(64) or 1


class DeferredSpan(trace.Span):
    """Stands in for a model-call span until it is materialised; records what is done to it.

    ``start(context, start_time)`` creates the real span (the hook's own start code);
    operations on this object are replayed on it in order; :meth:`defer` queues work
    that needs the real span (building the output attributes) for that moment too.
    After materialisation every call is forwarded to the real span.

    ``describe(span_id, start_ns, end_ns, deferred_finish)``, when the hook gives one, makes the
    converter's record of the call instead of a span while only tracerl listens
    (``direct_calls.py``): a ``ModelCall``, None (nothing to record) or :data:`MAKE_SPAN`.
    """

    def __init__(
        self,
        start: Callable[..., Any],
        parent: Any,
        describe: Callable[..., Any] | None = None,
        *,
        parent_span: Any = None,
        span_id: int | None = None,
    ) -> None:
        """``parent``: the OpenTelemetry context current at the call; ``parent_span``: its current
        span when the caller has it already; ``span_id``: one from :func:`new_span_id`, when the
        caller needed it before the span (``input_delta``)."""
        parent_context = (parent_span if parent_span is not None else trace.get_current_span(parent)).get_span_context()
        self._context = trace.SpanContext(
            parent_context.trace_id,
            span_id or new_span_id(),
            is_remote=False,
            trace_flags=parent_context.trace_flags,
            trace_state=parent_context.trace_state,
        )
        # the parent is the span current *now*: a current-span object may point elsewhere
        # by materialisation time (a LangChain run's scope points at its parent once it ends);
        # the context holding it is built at materialisation, not in the call's hot path
        self._parent_context = parent_context
        self._context_then = parent
        self._start = start
        self._describe = describe
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
    def materialize(self, ids: PresetSpanIds, capture_only: "CaptureOnlyTracer | None" = None) -> None:
        """Create the real span with this span's id and times, replay what was recorded.

        ``capture_only``: make it with that tracer when the call has ended and every recorded
        operation is an attribute (a call still running, events, status and exceptions take
        the SDK's own path: the span may be used after this batch).
        """
        if capture_only is not None and self._describe is not None and self._describe_directly(capture_only):
            return
        parent = trace.set_span_in_context(trace.NonRecordingSpan(self._parent_context), self._context_then)
        self._context_then = None
        ids.preset(self._context.span_id)
        try:
            if capture_only is not None and self._end_ns is not None and all(op[0] in _ATTRIBUTE_OPS for op in self._ops):
                real = self._start(context=parent, start_time=self._start_ns, tracer=capture_only)
            else:
                real = self._start(context=parent, start_time=self._start_ns)
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


    def _describe_directly(self, capture_only: "CaptureOnlyTracer") -> bool:
        """Hand the call's record to the processor without a span, when it can be; whether it was."""
        finish = self._finish
        if finish is None or self._ops or not capture_only.records_directly(self._parent_context):
            return False
        described = self._describe(self._context.span_id, self._start_ns, self._end_ns, finish)  # type: ignore[misc]
        if described is MAKE_SPAN:
            return False
        self._finish = self._describe = self._context_then = None
        self._real = trace.NonRecordingSpan(self._context)  # whatever comes later is dropped, as on an ended span
        capture_only.add_call(self._context, self._parent_context, described)
        return True


class PendingSpans:
    """The deferred spans of one rollout (thread-safe; bounded by :data:`FLUSH_AT`)."""

    def __init__(self, ids: PresetSpanIds) -> None:
        self._ids = ids
        self._spans: list[DeferredSpan] = []
        self._lock = threading.Lock()
        self.inputs = InputHistory()
        """The recent model-call inputs, so each call's span stores only its new messages."""

    def open(
        self,
        start: Callable[..., Any],
        describe: Callable[..., Any] | None = None,
        *,
        context: Any = None,
        parent_span: Any = None,
        span_id: int | None = None,
    ) -> DeferredSpan:
        """A deferred span for a call starting now, under ``context`` (default: the current one);
        ``parent_span`` / ``span_id``: see :class:`DeferredSpan`."""
        if context is None:
            context = otel_context.get_current()
        span = DeferredSpan(start, context, describe, parent_span=parent_span, span_id=span_id)
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
        capture_only = CaptureOnlyTracer.when_alone(self._ids) if ready else None
        for span in ready:
            try:
                span.materialize(self._ids, capture_only)
            except Exception as error:  # noqa: BLE001 - as ``guard``: one span must not lose the others
                record_error("deferred_span", error)

    def __len__(self) -> int:
        return len(self._spans)


_DIRECT_ATTRIBUTE_ROOM = 32
"""A model-call span has at most ~15 attributes: under a lower span limit the SDK's path decides."""


class CaptureOnlyTracer:
    """Makes finished spans for tracerl's processor alone, when it is the provider's only one.

    Same contract as the SDK tracer's ``start_span`` for what the hooks do at rollout end
    (attributes, then ``end``): the span gets the tracer's sampling decision, the preset id,
    the resource and instrumentation scope, the attributes as the SDK keeps them (lists as
    tuples, ``None`` dropped), and reaches the processor's ``on_start`` / ``on_end``.  A span
    the sampler would not record and a set of attributes past the span limits go to the SDK.

    Its spans may hold ``gen_ai.input.messages`` / ``gen_ai.output.messages`` as the message
    lists themselves (:attr:`structured_attributes`), not their JSON: only the converter reads
    them, and serialising each message to parse it back a moment later was a sixth of the
    rollout-end work.  Readers take either form (``convert.attribute_value``).
    """

    structured_attributes = True
    """Hooks may set message attributes as lists of semconv message dicts (no JSON round trip)."""

    def __init__(self, tracer: Any, processor: Any) -> None:
        self._tracer = tracer
        self._processor = processor
        sampler = tracer.sampler
        self._samples_under_sampled_parents = (
            isinstance(sampler, ParentBased) and getattr(sampler, "_local_parent_sampled", None) is ALWAYS_ON
        )
        """The SDK's default sampler: a child of a sampled local parent is sampled, attributes unchanged."""
        self._direct_parent: trace.SpanContext | None = None

    def records_directly(self, parent: trace.SpanContext) -> bool:
        """Whether a call under ``parent`` may skip its span (``direct_calls.py``): the default
        sampler would record it unchanged, as a child of a sampled local parent.  (One tracer
        serves one batch, whose calls mostly share a parent: the last answer yes is remembered.)"""
        if parent is self._direct_parent:
            return True
        direct = (
            self._samples_under_sampled_parents
            and parent.is_valid
            and parent.trace_flags.sampled
            and not parent.is_remote
            and self._tracer._span_limits.max_span_attributes >= _DIRECT_ATTRIBUTE_ROOM
        )
        if direct:
            self._direct_parent = parent
        return direct

    def add_call(self, context: trace.SpanContext, parent: trace.SpanContext, call: Any) -> None:
        """A call recorded without a span reaches the rollout's buffer (None: a span with no call)."""
        self._processor.add_call(context, parent, call)

    @classmethod
    def when_alone(cls, ids: PresetSpanIds) -> "CaptureOnlyTracer | None":
        """One for tracerl's tracer if its processor is all the provider has, else None."""
        from .processor import current_setup

        tracer, processor = current_setup()
        active = getattr(tracer, "span_processor", None)
        if tracer is None or type(active) is not SynchronousMultiSpanProcessor or tracer.id_generator is not ids:
            return None
        enabled = getattr(tracer, "_is_enabled", None)
        if enabled is not None and not enabled():
            return None
        if type(getattr(tracer, "_tracer_metrics", None)).__name__ not in ("NoneType", "NoOpTracerMetrics"):
            return None  # the SDK counts spans for a meter provider: let it
        processors = getattr(active, "_span_processors", ())
        if len(processors) != 1 or processors[0] is not processor:
            return None
        limits = getattr(tracer, "_span_limits", None)
        if limits is None or limits.max_attribute_length is not None:
            return None
        return cls(tracer, processor)

    def start_span(
        self,
        name: str,
        context: Any = None,
        kind: trace.SpanKind = trace.SpanKind.INTERNAL,
        attributes: Any = None,
        links: Any = None,
        start_time: int | None = None,
        **_: Any,
    ) -> Any:
        tracer = self._tracer
        parent = trace.get_current_span(context).get_span_context()
        attributes = dict(attributes or {})
        sampled, trace_state = False, None
        if parent.is_valid and not links:
            if self._samples_under_sampled_parents and parent.trace_flags.sampled and not parent.is_remote:
                sampled, trace_state = True, parent.trace_state  # what ParentBased(ALWAYS_ON) answers
            else:
                decision = tracer.sampler.should_sample(context, parent.trace_id, name, kind, attributes, links)
                sampled, trace_state = decision.decision.is_sampled(), decision.trace_state
                attributes = dict(decision.attributes or attributes)
        if not sampled or len(attributes) > tracer._span_limits.max_span_attributes:
            return tracer.start_span(name, context=context, kind=kind, attributes=attributes, links=links, start_time=start_time)
        flags = trace.TraceFlags(trace.TraceFlags.SAMPLED | (parent.trace_flags & trace.TraceFlags.RANDOM_TRACE_ID))
        span_context = trace.SpanContext(
            parent.trace_id, tracer.id_generator.generate_span_id(), is_remote=False,
            trace_flags=flags, trace_state=trace_state,
        )  # fmt: skip
        span = _CaptureOnlySpan(self, name, span_context, parent, kind, attributes, start_time)
        self._processor.on_start(span, context)
        return span

    def _finish(self, span: "_CaptureOnlySpan") -> None:
        """The ended span's attributes as the SDK would have kept them, then ``on_end``."""
        limit = self._tracer._span_limits.max_span_attributes
        attributes = span._attributes
        for key, value in list(attributes.items()):
            if value is None:
                del attributes[key]
            elif type(value) is list:
                attributes[key] = tuple(value)
        if len(attributes) > limit:
            span._attributes = dict(list(attributes.items())[:limit])
        self._processor.on_end(span)


class _CaptureOnlySpan(trace.Span, ReadableSpan):
    """An open span of :class:`CaptureOnlyTracer` (attributes, then ``end``), and once ended the
    finished span the processor keeps: one object, no copy.  Events, status and exceptions never
    reach one (the deferred span sends those spans through the SDK)."""

    structured_attributes = True
    """See :attr:`CaptureOnlyTracer.structured_attributes`."""

    def __init__(
        self, tracer: CaptureOnlyTracer, name: str, context: trace.SpanContext, parent: trace.SpanContext,
        kind: trace.SpanKind, attributes: dict[str, Any], start_time: int | None,
    ) -> None:  # fmt: skip
        # ReadableSpan's fields, set directly (its __init__ would build an empty Resource first)
        self._owner = tracer
        self._name, self._context, self._parent, self._kind = name, context, parent, kind
        self._attributes = attributes
        self._start_time = start_time or time.time_ns()
        self._end_time: int | None = None
        self._events = self._links = ()
        self._status = _UNSET
        self._resource = tracer._tracer.resource
        self._instrumentation_scope = tracer._tracer._instrumentation_scope
        self._instrumentation_info = None

    def get_span_context(self) -> trace.SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self._end_time is None

    def set_attributes(self, attributes: Any) -> None:
        if self._end_time is None:
            self._attributes.update(attributes)

    def set_attribute(self, key: str, value: Any) -> None:
        if self._end_time is None:
            self._attributes[key] = value

    def end(self, end_time: int | None = None) -> None:
        if self._end_time is not None:
            return
        self._end_time = end_time or time.time_ns()
        self._owner._finish(self)

    def _unsupported(self, *args: Any, **kwargs: Any) -> None:
        if self._end_time is None:  # only ended calls are made this way: nothing else reaches an open one
            raise NotImplementedError("a capture-only span records attributes only")

    add_event = add_link = update_name = set_status = record_exception = _unsupported
