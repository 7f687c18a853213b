"""Which model-call spans are outer layers of one model request, decided as the calls happen.

One request is often seen by several layers: LangChain's ``ChatOpenAI`` calls the OpenAI
SDK, LiteLLM calls the OpenAI SDK, OpenInference's instrumentors wrap the same calls as
ours.  Each layer writes a model-call span with the model name and the usage, and an
observability backend that sums usage over its model-call spans (Langfuse sums every
``generation``, and prices any span that names a known model) would count the request
once per layer.  So the innermost span (closest to the wire) stays the model call and
every span that has a model-call child is an *outer layer*; exporters then send outer
layers as plain spans, without model or usage (``export/langfuse.py``).

The decision is made where the information is, never guessed at export:

* when a model-call span starts while another model-call span is current (our hooks,
  :func:`note_start`; any instrumentor's span through the processor's ``on_start``);
* when a span that only says it is a model call after it started (OpenInference's
  LiteLLM span sets its kind after ``start_span``) ends under a known model call
  (:func:`note_end`, from the processor's ``on_end``, before its parent can end);
* when a call starts inside a LangChain chat-model run: our handler makes the run's span
  current (``langchain_runs.RunScope``), so the OpenAI SDK's span is its child and the
  first rule applies; the handler also marks the run with :func:`langchain_run_started`, and
  calls that start before :func:`langchain_run_ended` in a context the run's attachment
  did not reach still make it an outer layer;
* when two callback handlers record the same LangChain run side by side (OpenInference's
  LangChain tracer never makes its span current): :func:`note_langchain_twin`.

Memory is bounded (the oldest ids are forgotten first); every function here is cheap
(a few dict operations) and never raises into the code that starts or ends a span.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from contextvars import ContextVar
from typing import Any, Mapping
from uuid import UUID

from opentelemetry import trace

from . import semconv as sc
from .health import record_error

_REMEMBERED = 50_000
_lock = threading.Lock()
_model_calls: OrderedDict[int, None] = OrderedDict()  # span ids known to describe a model call
_outer: OrderedDict[int, int] = OrderedDict()  # outer-layer span id -> the span id that made it one
_parents: OrderedDict[int, None] = OrderedDict()  # span ids a model call started under


def is_model_call_attributes(attributes: Mapping[str, Any] | None) -> bool:
    """Whether span attributes describe one model call (GenAI semconv or OpenInference)."""
    if not attributes:
        return False
    return attributes.get(sc.OPERATION_NAME) in sc.LLM_OPERATIONS or attributes.get(sc.OI_SPAN_KIND) == "LLM"


def is_outer_layer(span_id: int) -> bool:
    """Whether the span with this id is an outer layer of a model call recorded below it."""
    return span_id in _outer


_running: ContextVar[Any] = ContextVar("tracerl_langchain_model_run", default=None)


def langchain_run_started(run_id: UUID, span: Any) -> None:
    """Our LangChain handler opened ``span`` for chat-model run ``run_id`` (inline, caller's context)."""
    try:
        _running.set(span)
        note_langchain_twin(run_id, span)
    except Exception as error:  # noqa: BLE001 - never raise into LangChain
        record_error("layers_langchain", error)


def langchain_run_ended(run_id: UUID, span: Any) -> None:
    """The run ended (or failed): later calls in this context are not inside it."""
    if span is None:
        return
    try:
        if _running.get() is span:
            _running.set(None)
        note_langchain_twin(run_id, span)
    except Exception as error:  # noqa: BLE001 - never raise into LangChain
        record_error("layers_langchain", error)


def _running_langchain_call(span_id: int) -> Any:
    span = _running.get()
    if span is None or span.get_span_context().span_id == span_id:
        return None
    return span if span.is_recording() else None


def has_model_call_child(span_id: int) -> bool:
    """Whether a model call started while the span with this id was current (e.g. a judge's call)."""
    return span_id in _parents


def note_start(parent: Any, span_id: int, *, parent_is_plain: bool = False) -> None:
    """A model-call span ``span_id`` starts while ``parent`` (a span object) is current.

    ``parent_is_plain``: the caller knows the parent is no model call (a rollout's root span).
    """
    try:
        enclosing = _running_langchain_call(span_id)
        parent_id = parent.get_span_context().span_id if parent is not None else None
        outer = parent_id is not None and not parent_is_plain and (
            parent_id in _model_calls or is_model_call_attributes(getattr(parent, "attributes", None))
        )
        with _lock:  # one acquisition for what this start teaches
            _store(_model_calls, span_id, None)
            if enclosing is not None:
                _store(_outer, enclosing.get_span_context().span_id, span_id)
            if parent_id is not None:
                _store(_parents, parent_id, None)
                if outer:
                    _store(_outer, parent_id, span_id)
    except Exception as error:  # noqa: BLE001 - never raise into the hook
        record_error("layers_start", error)


def on_start(span: Any, parent_context: Any) -> None:
    """Processor ``on_start``: a span from any instrumentor that says it is a model call.

    A span tracerl's hooks already announced (:func:`note_start` at call time, then made from
    the call's record for exporters, ``recorded.py``) is known: nothing new to learn from it.
    """
    try:
        span_id = span.get_span_context().span_id
        if span_id not in _model_calls and is_model_call_attributes(span.attributes):
            note_start(trace.get_current_span(parent_context), span_id)
    except Exception as error:  # noqa: BLE001 - never raise into whoever starts the span
        record_error("layers_start", error)


def note_end(span: Any) -> None:
    """Processor ``on_end``: a model call known only now makes its (still open) parent an outer layer."""
    try:
        if is_model_call_attributes(getattr(span, "attributes", None)):
            note_model_call_end(span.context.span_id, span.parent)
    except Exception as error:  # noqa: BLE001 - never raise into whoever ends the span
        record_error("layers_end", error)


def note_model_call_end(span_id: int, parent: Any) -> None:
    """A model call ``span_id`` ended under ``parent`` (a span context or None): see :func:`note_end`."""
    if span_id not in _model_calls:
        _remember(_model_calls, span_id, None)
    if parent is not None and parent.span_id in _model_calls and parent.span_id not in _outer:
        _remember(_outer, parent.span_id, span_id)


def note_langchain_twin(run_id: UUID, ours: Any) -> None:
    """OpenInference's LangChain tracer recorded run ``run_id`` too: its span is the same request.

    Called by our LangChain handler at the start and at the end of a chat-model run (one
    of the two sees the other handler's span, whichever order LangChain calls them in).
    """
    module = sys.modules.get("openinference.instrumentation.langchain")
    if module is None:
        return
    try:
        twin = module.LangChainInstrumentor().get_span(run_id)
        if twin is not None and twin.get_span_context().is_valid:
            _remember(_outer, twin.get_span_context().span_id, ours.get_span_context().span_id)
    except Exception as error:  # noqa: BLE001 - a foreign API that may change; count, keep going
        record_error("layers_langchain_twin", error)


def forget() -> None:
    """Drop everything remembered (tests)."""
    with _lock:
        _model_calls.clear()
        _outer.clear()
        _parents.clear()


def _remember(store: OrderedDict[int, Any], key: int, value: Any) -> None:
    with _lock:
        _store(store, key, value)


def _store(store: OrderedDict[int, Any], key: int, value: Any) -> None:
    """Remember ``key`` as the newest entry (caller holds ``_lock``); forget the oldest past the bound."""
    store[key] = value
    store.move_to_end(key)
    while len(store) > _REMEMBERED:
        store.popitem(last=False)
