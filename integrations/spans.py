"""Writing GenAI-semconv model-call spans (shared by the OpenAI, LiteLLM and LangChain hooks)."""

from __future__ import annotations

import copy
import functools
import json
from typing import Any, Iterable

from opentelemetry import context as otel_context
from opentelemetry import trace

from . import layers
from . import semconv as sc
from . import direct_calls
from .completions import chat_outcome
from .deferred import MAKE_SPAN, DeferredSpan, new_span_id
from .input_delta import delta_attributes
from .messages import to_plain, to_semconv, to_semconv_list
from .processor import TokenRecord, get_processor, get_tracer
from .rollout import current_rollout

_SPAN_KIND = trace.SpanKind.CLIENT


def json_text(value: Any) -> str:
    return json.dumps(value, default=str, ensure_ascii=False)


def tool_definitions(tools: Any) -> list[dict[str, Any]]:
    """OpenAI tool schemas -> semconv's flat ``{type, name, description, parameters}``."""
    out = []
    for tool in tools or ():
        tool = to_plain(tool)
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict):
            out.append({"type": tool.get("type", "function"), **function})
        elif isinstance(tool, dict):
            out.append(tool)
    return out


_TOOLS_JSON: dict[int, tuple[Any, Any, str]] = {}
_TOOLS_JSON_ENTRIES = 16


def _tool_definitions_json(tools: Any) -> str:
    """``tool_definitions(tools)`` as JSON, reused while the agent passes the same, unchanged list.

    An agent sends the same tool list with every call; the cache holds the list itself (so
    its id is not reused), a deep copy to compare with (so a list changed in place is
    serialised again) and the JSON.
    """
    cached = _TOOLS_JSON.get(id(tools))
    if cached is not None and cached[0] is tools and cached[1] == tools:
        return cached[2]
    text = json_text(tool_definitions(tools))
    if isinstance(tools, list):
        if len(_TOOLS_JSON) >= _TOOLS_JSON_ENTRIES:
            _TOOLS_JSON.pop(next(iter(_TOOLS_JSON)), None)
        _TOOLS_JSON[id(tools)] = (tools, copy.deepcopy(tools), text)
    return text


_last_url: tuple[Any, str] = (None, "")


def _url_text(url: Any) -> str:
    """``str(url)``, kept for the client's URL object (httpx rebuilds the text on every ``str``)."""
    global _last_url
    known, text = _last_url
    if known is not url:
        text = str(url)
        _last_url = (url, text)
    return text


def given(value: Any) -> bool:
    """An argument the caller passed (not None, not the SDK's ``omit`` / ``NOT_GIVEN`` sentinels)."""
    return value is not None and type(value).__name__ not in ("Omit", "NotGiven")


def start_chat_span(
    layer: str,
    kwargs: dict[str, Any],
    *,
    provider: str,
    base_url: Any = None,
    token_ids_requested: bool = False,
    messages: Any = None,
    context: Any = None,
) -> Any:
    """Start (not make current) a ``chat {model}`` span describing the request in ``kwargs``.

    Inside a rollout the span is a :class:`~.deferred.DeferredSpan`: the request is
    snapshotted (the agent will append to its message list) and described when the
    rollout materialises its spans, its input as a delta of an earlier call's
    (:mod:`.input_delta`); outside one, a real span starts now.  ``context``: the
    OpenTelemetry context current at the call, when the caller has it already (it makes the
    span current in it right after).
    """
    scope = current_rollout()
    pending = scope.pending_spans if scope is not None else None
    if pending is not None:
        request = kwargs.copy()
        request.pop("messages", None)  # a list per call would be O(turns²)
        if context is None:
            context = otel_context.get_current()
        parent = trace.get_current_span(context)
        span_id = new_span_id()
        tail, base = pending.inputs.open(layer, messages if messages is not None else kwargs.get("messages") or (), span_id)
        start = functools.partial(_start_span, layer, request, provider, base_url, token_ids_requested, tail, base=base)
        describe = functools.partial(_describe_call, layer, request, tail, base)
        span = pending.open(start, describe, context=context, parent_span=parent, span_id=span_id)
        layers.note_start(parent, span_id, parent_is_plain=parent is scope._span)  # real spans: on_start
        return span
    return _start_span(layer, kwargs, provider, base_url, token_ids_requested, messages)


def _start_span(
    layer: str,
    kwargs: dict[str, Any],
    provider: str,
    base_url: Any,
    token_ids_requested: bool,
    messages: Any,
    *,
    base: tuple[int, int] | None = None,
    context: Any = None,
    start_time: int | None = None,
    tracer: Any = None,
) -> Any:
    model = kwargs.get("model")
    inputs = to_semconv_list(messages if messages is not None else kwargs.get("messages") or ())
    attributes: dict[str, Any] = {
        sc.OPERATION_NAME: sc.OP_CHAT,
        sc.PROVIDER_NAME: provider,
        sc.LAYER: layer,
        sc.INPUT_MESSAGES: inputs if getattr(tracer, "structured_attributes", False) else json_text(inputs),
        **delta_attributes(base),
    }
    if given(model):
        attributes[sc.REQUEST_MODEL] = str(model)
    tools = kwargs.get("tools")
    if given(tools) and tools:
        attributes[sc.TOOL_DEFINITIONS] = _tool_definitions_json(tools)
    temperature = kwargs.get("temperature")
    if given(temperature) and isinstance(temperature, (int, float)):
        attributes[sc.REQUEST_TEMPERATURE] = float(temperature)
    if base_url is not None:
        attributes[sc.SERVER_ADDRESS] = _url_text(base_url)
    if kwargs.get("stream") is True:
        attributes[sc.STREAM] = True
    if token_ids_requested:
        attributes[sc.TOKEN_IDS_REQUESTED] = True
    return (tracer or get_tracer()).start_span(
        f"chat {model}", context=context, kind=_SPAN_KIND, attributes=attributes, start_time=start_time
    )


def _describe_call(
    layer: str,
    kwargs: dict[str, Any],
    tail: list[Any],
    base: tuple[int, int] | None,
    span_id: int,
    start_ns: int,
    end_ns: int,
    finish: tuple[Any, tuple[Any, ...]],
) -> Any:
    """The converter's record of a deferred call, made without a span (``direct_calls.py``);
    :data:`~.deferred.MAKE_SPAN` when the call did not end with :func:`finish_chat_span`."""
    fn, args = finish
    if fn is not finish_chat_span:
        return MAKE_SPAN
    model = kwargs.get("model")
    tools = kwargs.get("tools")
    return direct_calls.model_call(
        layer,
        tail,
        base,
        span_id,
        start_ns,
        end_ns,
        request_model=str(model) if given(model) else None,
        tool_definitions=_tool_definitions_json(tools) if given(tools) and tools else None,
        completion=args[0],
    )


def finish_chat_span(span: Any, completion: Any, *, end_time: int | None = None) -> None:
    """Record a (non-streamed) chat completion on ``span``, keep its token ids, end the span.

    On a deferred span this only notes the completion; the work runs at materialisation.
    """
    if isinstance(span, DeferredSpan):
        span.defer(finish_chat_span, completion)
        return
    outcome = chat_outcome(completion)
    outputs = []
    for message, finish in zip(outcome.messages, outcome.finishes):
        output = to_semconv(message)
        output["finish_reason"] = finish
        outputs.append(output)
    end_chat_span(
        span,
        outputs,
        response_id=outcome.response_id,
        model=outcome.model,
        finish_reasons=[str(finish) for finish in outcome.finishes],
        input_tokens=outcome.input_tokens,
        output_tokens=outcome.output_tokens,
        tokens=outcome.tokens,
        end_time=end_time,
    )


def end_chat_span(
    span: Any,
    outputs: list[dict[str, Any]],
    *,
    response_id: Any = None,
    model: Any = None,
    finish_reasons: Iterable[str] = (),
    input_tokens: Any = None,
    output_tokens: Any = None,
    tokens: tuple[list[int] | None, list[int] | None, list[float] | None] | None = None,
    end_time: int | None = None,
) -> None:
    attributes: dict[str, Any] = {
        sc.OUTPUT_MESSAGES: outputs if getattr(span, "structured_attributes", False) else json_text(outputs)
    }
    if response_id:
        attributes[sc.RESPONSE_ID] = str(response_id)
    if model:
        attributes[sc.RESPONSE_MODEL] = str(model)
    reasons = [r for r in finish_reasons if r]
    if reasons:
        attributes[sc.RESPONSE_FINISH_REASONS] = reasons
    if isinstance(input_tokens, int):
        attributes[sc.USAGE_INPUT_TOKENS] = input_tokens
    if isinstance(output_tokens, int):
        attributes[sc.USAGE_OUTPUT_TOKENS] = output_tokens
    span.set_attributes(attributes)  # one lock and one pass, not one per attribute
    if tokens is not None:
        context = span.get_span_context()
        prompt_ids, token_ids, logprobs = tokens
        get_processor().add_record(
            context.trace_id,
            TokenRecord(str(response_id) if response_id else None, context.span_id, prompt_ids, token_ids, logprobs),
        )
    span.end(end_time)


def end_with_error(span: Any, error: BaseException) -> None:
    """Mark ``span`` failed with ``error`` (exception event, ERROR status, ``error.type``) and end it."""
    span.record_exception(error)
    span.set_status(trace.Status(trace.StatusCode.ERROR, type(error).__name__))
    span.set_attribute(sc.ERROR_TYPE, type(error).__name__)
    span.end()
