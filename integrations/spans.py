"""Model calls as every hook records them: request, answer, the converter's record, and the
GenAI-semconv attributes of the span made for exporters (shared by all model-call hooks)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

from . import layers
from . import semconv as sc
from .completions import TokenIds, chat_outcome
from .convert import new_model_call
from .input_delta import delta_attributes
from .messages import openai_message, to_plain, to_semconv
from .processor import TokenRecord, get_processor
from .recorded import ModelCallSpan, new_span_id
from .current import current_rollout



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


def given(value: Any) -> bool:
    """An argument the caller passed (not None, not the SDK's ``omit`` / ``NOT_GIVEN`` sentinels)."""
    return value is not None and type(value).__name__ not in ("Omit", "NotGiven")


@dataclass
class ChatRequest:
    """What a hook saw of a model call's request (the messages as a snapshot: the agent appends to its list)."""

    layer: str
    kwargs: dict[str, Any]
    """The call's keyword arguments without ``messages``."""
    provider: str
    base_url: Any
    token_ids_requested: bool
    tail: list[Any]
    """The input messages after the ``base`` call's first ``base[1]`` (all of them without a base)."""
    base: tuple[int, int] | None
    """(span id, prefix length) of the earlier call this one's input continues (``input_delta.py``)."""


@dataclass
class ChatAnswer:
    """What a model call returned: every choice's assistant message (OpenAI shape) and the rest."""

    messages: list[dict[str, Any]]
    finishes: list[Any]
    response_id: Any = None
    model: Any = None
    input_tokens: Any = None
    output_tokens: Any = None


def start_chat_span(
    layer: str,
    kwargs: dict[str, Any],
    *,
    provider: str,
    base_url: Any = None,
    token_ids_requested: bool = False,
    messages: Any = None,
    context: Any = None,
) -> ModelCallSpan:
    """Open the record of a model call (:class:`~.recorded.ModelCallSpan`) described by ``kwargs``
    (not made current: the hook does that, in ``context`` when it has it already).

    Inside a rollout the input is kept as a delta of an earlier call's (:mod:`.input_delta`).
    """
    if context is None:
        context = otel_context.get_current()
    parent = trace.get_current_span(context)
    sent = messages if messages is not None else kwargs.get("messages") or ()
    request = kwargs.copy()
    request.pop("messages", None)
    span_id = new_span_id()
    scope = current_rollout()
    if scope is not None and scope.inputs is not None:
        tail, base = scope.inputs.open(layer, sent, span_id)
    else:
        tail, base = [dict(m) if type(m) is dict else m for m in sent], None
    span = ModelCallSpan(f"chat {request.get('model')}", parent.get_span_context(), _attributes,
                         span_id=span_id, on_end=get_processor().add_call)  # fmt: skip
    span.request = ChatRequest(layer, request, provider, base_url, token_ids_requested, tail, base)
    layers.note_start(parent, span_id, parent_is_plain=scope is not None and parent is scope.root_span)
    return span


def finish_chat_span(span: Any, completion: Any, *, end_ns: int | None = None) -> None:
    """Record a (non-streamed) chat completion as ``span``'s answer, keep its token ids, end it."""
    outcome = chat_outcome(completion)
    answer = ChatAnswer(outcome.messages, outcome.finishes, outcome.response_id, outcome.model,
                        outcome.input_tokens, outcome.output_tokens)  # fmt: skip
    end_chat_span(span, answer, tokens=outcome.tokens, end_ns=end_ns)


def end_chat_span(span: Any, answer: ChatAnswer, *, tokens: TokenIds | None = None, end_ns: int | None = None) -> None:
    """``span``'s answer (``tokens``: the first choice's exact ids, when the server sent them): the
    converter's record of the call is built here, from the hook's own values; then the span ends
    (at ``end_ns``: now, unless the call ended elsewhere, e.g. on the gateway)."""
    span.answer = answer
    request: ChatRequest = span.request
    now = end_ns or time.time_ns()
    if answer.messages:
        model, tools = request.kwargs.get("model"), request.kwargs.get("tools")
        response_id = str(answer.response_id) if answer.response_id else None
        span.call = new_model_call(
            span_id=span.context.span_id,
            start=span.start_ns,
            end=now,
            layer=request.layer,
            inputs=[openai_message(m) for m in request.tail],
            output=openai_message({**answer.messages[0], "role": "assistant"}),
            finish_reason=answer.finishes[0] if answer.finishes else None,
            model=(str(answer.model) if answer.model else None) or (str(model) if given(model) else None),
            response_id=response_id,
            usage=(_count(answer.input_tokens), _count(answer.output_tokens)),
            record=TokenRecord(response_id, span.context.span_id, *tokens) if tokens is not None else None,
            base=request.base,
            tool_definitions=json_text(tool_definitions(tools)) if given(tools) and tools else None,
        )
    span.end(now)


def _count(value: Any) -> int:
    return value if isinstance(value, int) else 0


def _attributes(span: ModelCallSpan) -> dict[str, Any]:
    """The GenAI-semconv attributes of a call's span, for exporters (made only when one listens)."""
    request: ChatRequest = span.request
    kwargs = request.kwargs
    attributes: dict[str, Any] = {
        sc.OPERATION_NAME: sc.OP_CHAT,
        sc.PROVIDER_NAME: request.provider,
        sc.LAYER: request.layer,
        sc.INPUT_MESSAGES: json_text([to_semconv(m) for m in request.tail]),
        **delta_attributes(request.base),
    }
    model = kwargs.get("model")
    if given(model):
        attributes[sc.REQUEST_MODEL] = str(model)
    tools = kwargs.get("tools")
    if given(tools) and tools:
        attributes[sc.TOOL_DEFINITIONS] = json_text(tool_definitions(tools))
    temperature = kwargs.get("temperature")
    if given(temperature) and isinstance(temperature, (int, float)):
        attributes[sc.REQUEST_TEMPERATURE] = float(temperature)
    if request.base_url is not None:
        attributes[sc.SERVER_ADDRESS] = str(request.base_url)
    if kwargs.get("stream") is True:
        attributes[sc.STREAM] = True
    if request.token_ids_requested:
        attributes[sc.TOKEN_IDS_REQUESTED] = True
    answer: ChatAnswer | None = getattr(span, "answer", None)
    if answer is None:
        return attributes
    outputs = [{**to_semconv(message), "finish_reason": finish} for message, finish in zip(answer.messages, answer.finishes)]
    attributes[sc.OUTPUT_MESSAGES] = json_text(outputs)
    if answer.response_id:
        attributes[sc.RESPONSE_ID] = str(answer.response_id)
    if answer.model:
        attributes[sc.RESPONSE_MODEL] = str(answer.model)
    reasons = [str(r) for r in answer.finishes if r]
    if reasons:
        attributes[sc.RESPONSE_FINISH_REASONS] = reasons
    if isinstance(answer.input_tokens, int):
        attributes[sc.USAGE_INPUT_TOKENS] = answer.input_tokens
    if isinstance(answer.output_tokens, int):
        attributes[sc.USAGE_OUTPUT_TOKENS] = answer.output_tokens
    return attributes


def end_with_error(span: Any, error: BaseException) -> None:
    """Mark ``span`` failed with ``error`` (exception event, ERROR status, ``error.type``) and end it."""
    span.record_exception(error)
    span.set_status(trace.Status(trace.StatusCode.ERROR, type(error).__name__))
    span.set_attribute(sc.ERROR_TYPE, type(error).__name__)
    span.end()
