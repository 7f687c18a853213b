"""Reading a chat completion (OpenAI SDK objects, LiteLLM's responses, plain dicts), once.

Shared by the hooks (``spans.finish_chat_span``) and streams (``streams.py``): what a response
says about its call is read in one place.  Fields beyond the OpenAI schema (``token_ids``,
``prompt_token_ids`` from vLLM and tracerl's servers) are read as pydantic extras, dict keys or
attributes.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, NamedTuple


def field(obj: Any, name: str) -> Any:
    """``obj.name`` or ``obj[name]``; None when absent or ``obj`` is None."""
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


@functools.lru_cache(maxsize=256)
def _model_fields(kind: type) -> Any:
    """A pydantic class's field names (pydantic 2.11 makes ``model_fields`` a computed property)."""
    fields = getattr(kind, "model_fields", None)
    return frozenset(fields) if fields is not None else None


def extra_field(obj: Any, name: str) -> Any:
    """A field a server added beyond the OpenAI schema (pydantic extra, dict key, attribute).

    Pydantic models are read through ``model_extra`` / ``model_fields`` so that absent
    names cost a dict lookup, not a raised-and-caught ``AttributeError``.
    """
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    fields = _model_fields(type(obj))
    if fields is not None:
        extra = getattr(obj, "__pydantic_extra__", None) or {}  # what ``model_extra`` returns, without its property call
        if name in extra:
            return extra[name]
        if name in fields:
            return getattr(obj, name)
        specific = extra.get("provider_specific_fields")
        if specific is None and "provider_specific_fields" in fields:
            specific = obj.provider_specific_fields
        return specific.get(name) if isinstance(specific, dict) else None
    value = getattr(obj, name, None)
    if value is None:
        specific = getattr(obj, "provider_specific_fields", None)
        if isinstance(specific, dict):
            value = specific.get(name)
    return value


_LOGPROB_KEY = operator.itemgetter("logprob")
_LOGPROB_ATTRIBUTE = operator.attrgetter("logprob")


def logprob_values(logprobs: Any) -> list[float] | None:
    """The sampled tokens' logprobs of a choice's ``logprobs`` (None when it has none).

    One entry per completion token: read by ``map`` (a loop in C) with the getter the first entry
    needs; entries of mixed kinds take the per-entry loop.
    """
    content = logprobs.get("content") if isinstance(logprobs, dict) else getattr(logprobs, "content", None)
    if not content:
        return None
    getter = _LOGPROB_KEY if isinstance(content[0], dict) else _LOGPROB_ATTRIBUTE
    try:
        return list(map(float, map(getter, content)))
    except (AttributeError, KeyError, TypeError):
        return [float(e["logprob"] if isinstance(e, dict) else e.logprob) for e in content]


def ints(values: Any) -> list[int] | None:
    """``[int(v) for v in values]``, looped in C (a completion's ids, per model call)."""
    return None if values is None else list(map(int, values))


def message_dict(message: Any) -> dict[str, Any]:
    """An assistant message as a dict, reading SDK objects directly (cheaper than ``model_dump``)."""
    if message is None:
        return {}
    if isinstance(message, dict):
        return message
    out: dict[str, Any] = {"content": getattr(message, "content", None)}
    calls = getattr(message, "tool_calls", None)
    if calls:
        out["tool_calls"] = [
            {
                "id": getattr(call, "id", None),
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for call in calls
        ]
    return out


TokenIds = tuple[list[int] | None, list[int] | None, list[float] | None]
"""(prompt token ids, completion token ids, completion logprobs) of a call's first choice."""


def token_ids(completion: Any, first: Any) -> TokenIds | None:
    """The exact tokens a tracerl-served (or vLLM) response carries for its first choice, else None."""
    ids = extra_field(first, "token_ids")
    prompt_ids = extra_field(completion, "prompt_token_ids") or extra_field(first, "prompt_token_ids")
    logprobs = logprob_values(field(first, "logprobs"))
    if ids is None and prompt_ids is None and logprobs is None:
        return None
    return (list(prompt_ids) if prompt_ids is not None else None, ints(ids), logprobs)


class ChatOutcome(NamedTuple):
    """What a chat completion says about its call, read once (for a span)."""

    messages: list[dict[str, Any]]
    """Each choice's assistant message, OpenAI-style (``role`` set)."""
    finishes: list[Any]
    """Each choice's ``finish_reason`` as the response gave it."""
    response_id: Any
    model: Any
    input_tokens: Any
    output_tokens: Any
    tokens: TokenIds | None


def chat_outcome(completion: Any) -> ChatOutcome:
    """A (non-streamed) chat completion's every choice, usage and first choice's token ids."""
    choices = list(field(completion, "choices") or ())
    messages = [{**message_dict(field(choice, "message")), "role": "assistant"} for choice in choices]
    finishes = [field(choice, "finish_reason") for choice in choices]
    usage = field(completion, "usage")
    return ChatOutcome(
        messages,
        finishes,
        field(completion, "id"),
        field(completion, "model"),
        field(usage, "prompt_tokens"),
        field(usage, "completion_tokens"),
        token_ids(completion, choices[0]) if choices else None,
    )
