"""A deferred model call straight to the converter's :class:`~.convert.ModelCall`, without a span.

Why: when tracerl's processor is the only listener on the provider (nothing exports, see
``deferred.CaptureOnlyTracer``), the span of a model call exists only to be read back by the
converter a moment later.  Writing its attributes, making the span, routing it through the
processor and reading the attributes back was about a third of the work at rollout end.  Here
the hook's own values (the request it sent, the completion it got) become the record directly.

The record is the one the converter would read from that span: the same normalisation of every
message (``messages.openai_message``: the semconv round trip, built directly), the same model, usage, finish reason,
tool definitions (read per rollout by the converter, from the same JSON), input delta and token
ids.  ``tests/test_capture_direct_calls.py`` checks that equality on real calls; a call that cannot be
described this way (streamed, failed, events or status on its span, a sampler other than the
SDK's default) still becomes a span.
"""

from __future__ import annotations

from typing import Any

from .completions import field, message_dict, token_ids
from .convert import LAYER_PRIORITY, GENAI_PRIORITY, ModelCall
from .messages import canonical, openai_message
from .processor import TokenRecord


def model_call(
    layer: str,
    tail: list[Any],
    base: tuple[int, int] | None,
    span_id: int,
    start_ns: int,
    end_ns: int,
    *,
    request_model: str | None,
    tool_definitions: str | None,
    completion: Any,
) -> ModelCall | None:
    """The converter's record of one call (None where its span would hold no model call: no choices).

    ``tail``: the input messages after the ``base`` call's first ``base[1]`` (``input_delta.py``).
    Only the first choice is read: it is the one the converter keeps from a span.
    """
    choices = field(completion, "choices")
    if not choices:
        return None
    first = choices[0]
    if isinstance(completion, dict) or isinstance(first, dict):
        message, finish = field(first, "message"), field(first, "finish_reason")
        model, response_id, usage = field(completion, "model"), field(completion, "id"), field(completion, "usage")
    else:  # SDK objects: ``field`` is ``getattr(obj, name, None)`` for them, called here without its frame
        message, finish = getattr(first, "message", None), getattr(first, "finish_reason", None)
        model, response_id = getattr(completion, "model", None), getattr(completion, "id", None)
        usage = getattr(completion, "usage", None)
    output = openai_message({**message_dict(message), "role": "assistant"})
    output["role"] = "assistant"
    inputs = [openai_message(m) for m in tail]
    model = (str(model) if model else None) or request_model
    response_id = str(response_id) if response_id else None
    tokens = token_ids(completion, first)
    return ModelCall(
        span_id=span_id,
        start=start_ns,
        end=end_ns or start_ns,
        layer=layer,
        priority=LAYER_PRIORITY.get(layer, GENAI_PRIORITY),
        inputs=inputs,
        output=output,
        finish_reason=finish,
        model=model or None,
        response_id=response_id,
        usage=_counts(usage),
        record=TokenRecord(response_id, span_id, *tokens) if tokens is not None else None,
        keys=[canonical(m) for m in inputs],
        base=(int(base[0]), int(base[1])) if base is not None else None,
        tool_definitions=tool_definitions,
    )


def _counts(usage: Any) -> tuple[int, int]:
    """(prompt, completion) token counts as the span path keeps them (only ints are written; absent reads as 0)."""
    prompt, completion = field(usage, "prompt_tokens"), field(usage, "completion_tokens")
    return (int(prompt) if isinstance(prompt, int) else 0, int(completion) if isinstance(completion, int) else 0)
