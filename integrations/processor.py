"""Each active rollout's buffer: the hooks' records of its model calls and the finished spans of its trace.

Only traces a rollout registered are kept (a dict lookup per span otherwise), each buffer
is bounded, and nothing here raises into the code that ends a span.  Exact token ids and
logprobs travel in each record's :class:`TokenRecord`; the converter joins them to other
instrumentors' model-call spans of the same call by span id or response id.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider

from . import layers, semconv
from .health import guard, record_error
from .recorded import CaptureTracerProvider, ModelCallSpan, PresetIds, install_preset_ids, listening

DEFAULT_MAX_SPANS = 20_000
DEFAULT_MAX_ROLLOUTS = 10_000


@dataclass
class TokenRecord:
    """What our inference server sampled for one model call."""

    response_id: str | None
    span_id: int | None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    sampling: Any = None
    """The :class:`tracerl.SamplingParams` the server applied (its ``sampling`` field), None when it sent none."""


@dataclass
class RolloutBuffer:
    """The hooks' records of one rollout's model calls and the finished spans of its trace."""

    trace_id: int
    max_spans: int
    spans: list[ReadableSpan] = field(default_factory=list)
    dropped_spans: int = 0
    calls: list[ModelCallSpan] = field(default_factory=list)
    """The rollout's hooked model calls, ended (``recorded.py``); counted against ``max_spans`` like spans."""

    def add(self, span: ReadableSpan) -> None:
        if len(self.spans) + len(self.calls) < self.max_spans:
            self.spans.append(span)
        else:
            self.dropped_spans += 1

    def add_call(self, call: ModelCallSpan) -> None:
        if len(self.spans) + len(self.calls) < self.max_spans:
            self.calls.append(call)
        else:
            self.dropped_spans += 1


class CaptureProcessor(SpanProcessor):
    """Routes finished spans to the buffer of the rollout whose trace they belong to."""

    def __init__(self, *, max_spans_per_rollout: int = DEFAULT_MAX_SPANS, max_rollouts: int = DEFAULT_MAX_ROLLOUTS):
        self.max_spans_per_rollout = max_spans_per_rollout
        self.max_rollouts = max_rollouts
        self._buffers: dict[int, RolloutBuffer] = {}
        self._lock = threading.Lock()
        self.rejected_rollouts = 0

    # -- rollout lifecycle ----------------------------------------------------------------
    def begin(self, trace_id: int) -> RolloutBuffer | None:
        with self._lock:
            if len(self._buffers) >= self.max_rollouts:
                self.rejected_rollouts += 1
                record_error("too_many_rollouts")
                return None
            buffer = RolloutBuffer(trace_id, self.max_spans_per_rollout)
            self._buffers[trace_id] = buffer
            return buffer

    def end(self, trace_id: int) -> RolloutBuffer | None:
        with self._lock:
            return self._buffers.pop(trace_id, None)

    def active_rollouts(self) -> int:
        return len(self._buffers)

    # -- SpanProcessor ----------------------------------------------------------------------
    def on_start(self, span: Any, parent_context: Any = None) -> None:
        layers.on_start(span, parent_context)  # one request seen by two layers: the outer one is a span

    def on_end(self, span: ReadableSpan) -> None:
        layers.note_end(span)
        try:
            buffer = self._buffers.get(span.context.trace_id)
            if buffer is not None:
                buffer.add(span)
        except Exception as error:  # noqa: BLE001 - never raise into whoever ends the span
            record_error("processor_on_end", error)

    def add_call(self, call: ModelCallSpan) -> None:
        """A hooked model call ended: to its rollout's buffer (what :meth:`on_end` does for a span).

        A call outside every rollout (or ending after its rollout did) becomes a span now, when
        something listens."""
        layers.note_model_call_end(call.context.span_id, call.parent)
        try:
            buffer = self._buffers.get(call.context.trace_id)
            if buffer is not None:
                buffer.add_call(call)
                return
            emit_spans([call])
        except Exception as error:  # noqa: BLE001 - as on_end
            record_error("processor_on_end", error)

    def shutdown(self) -> None:
        with self._lock:
            self._buffers.clear()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


# -- the tracer tracerl uses ---------------------------------------------------------------
_setup_lock = threading.Lock()
_processor: CaptureProcessor | None = None
_provider: TracerProvider | None = None
_tracer: trace.Tracer | None = None
_attached: "weakref.WeakSet[TracerProvider]" = weakref.WeakSet()
"""Providers tracerl's processor was added to (the SDK has no way to take it off again; spans
from one capture moved away from still reach their rollout by trace id)."""


def get_processor() -> CaptureProcessor:
    _ensure_setup()
    assert _processor is not None
    return _processor


def get_tracer() -> trace.Tracer:
    _ensure_setup()
    assert _tracer is not None
    return _tracer


def get_span_ids() -> PresetIds:
    """The id generator of tracerl's tracer (lets spans made from records keep their ids)."""
    return install_preset_ids(get_tracer())


def emit_spans(calls: list[ModelCallSpan]) -> None:
    """OpenTelemetry spans from a rollout's records, when something listens (``recorded.py``).

    Each call whose input is a delta (``input_delta.py``) comes after the call it continues:
    the exporter rebuilds full inputs in the order it receives spans, and a base can end after
    the call that continues it (two conversations in flight at once in one rollout).
    """
    if calls and listening(_provider):
        tracer, ids = get_tracer(), get_span_ids()
        for call in bases_first(calls):
            with guard("model_call_span"):  # one failing must not lose the others
                call.emit(tracer, ids)


def bases_first(calls: list[ModelCallSpan]) -> list[ModelCallSpan]:
    """``calls`` in their order, except that a call's input base (when among them) comes before it."""
    by_id = {call.context.span_id: call for call in calls}
    placed: set[int] = set()
    ordered: list[ModelCallSpan] = []
    for call in calls:
        chain: list[ModelCallSpan] = []
        while call is not None and call.context.span_id not in placed:
            placed.add(call.context.span_id)
            chain.append(call)
            base = getattr(call.request, "base", None)
            call = by_id.get(base[0]) if base else None
        ordered.extend(reversed(chain))
    return ordered


def get_tracer_provider() -> TracerProvider:
    _ensure_setup()
    assert _provider is not None
    return _provider


def configure(tracer_provider: TracerProvider | None = None) -> CaptureProcessor:
    """Attach tracerl's processor to ``tracer_provider``.

    Without an argument: the global provider when it is an SDK ``TracerProvider`` (so
    spans from other instrumentors and the MCP SDK are seen too), else a private one
    (tracerl never replaces the global provider).  Calling it again with another
    provider moves capture there.
    """
    global _processor, _provider, _tracer
    with _setup_lock:
        if tracer_provider is None:
            if _provider is not None:
                return _processor  # type: ignore[return-value]
            global_provider = trace.get_tracer_provider()
            tracer_provider = global_provider if isinstance(global_provider, TracerProvider) else CaptureTracerProvider()
        if tracer_provider is _provider and _processor is not None:
            return _processor
        processor = _processor or CaptureProcessor()
        if isinstance(tracer_provider, CaptureTracerProvider):
            tracer_provider.capture_processor = processor
        if tracer_provider not in _attached:  # moving back to a provider must not attach it twice
            tracer_provider.add_span_processor(processor)  # (each span would reach a rollout twice)
            _attached.add(tracer_provider)
        _processor = processor
        _provider = tracer_provider
        _tracer = tracer_provider.get_tracer(semconv.SCOPE, "0.1.0")
        install_preset_ids(_tracer)
        return processor


def _ensure_setup() -> None:
    if _provider is None:
        configure()
