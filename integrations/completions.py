"""Reading a chat completion (OpenAI SDK objects, LiteLLM's responses, plain dicts), once.

Shared by the hooks (``spans.finish_chat_span``) and streams (``streams.py``): what a response
says about its call is read in one place.  Fields beyond the OpenAI schema (``token_ids``,
``prompt_token_ids`` from vLLM and tracerl's servers, and the ``sampling`` parameters tracerl's
servers put beside each choice's ``token_ids``) are read as pydantic extras, dict keys or
attributes.  ``sampling`` is read only from the answer: a server that does not send it leaves
it unknown (None), whatever temperature the request asked for.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from tracerl.types import SamplingParams

from .messages import openai_tool_call


def field(obj: Any, name: str) -> Any:
    """``obj.name`` or ``obj[name]``; None when absent or ``obj`` is None."""
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def extra_field(obj: Any, name: str) -> Any:
    """A field a server added beyond the OpenAI schema: a pydantic model's extra (``model_extra``), a
    dict key or an attribute, else LiteLLM's ``provider_specific_fields``."""
    if obj is None or isinstance(obj, dict):
        return field(obj, name)
    value = (getattr(obj, "model_extra", None) or {}).get(name)
    if value is None:
        value = getattr(obj, name, None)
    if value is None:
        specific = getattr(obj, "provider_specific_fields", None)
        value = specific.get(name) if isinstance(specific, dict) else None
    return value


def logprob_values(logprobs: Any) -> list[float] | None:
    """The sampled tokens' logprobs of a choice's ``logprobs`` (None when it has none)."""
    content = field(logprobs, "content")
    if not content:
        return None
    return [float(field(entry, "logprob")) for entry in content]


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
    reasoning = extra_field(message, "reasoning_content")  # vLLM's and tracerl's servers' reasoning field
    if isinstance(reasoning, str):
        out["reasoning_content"] = reasoning
    calls = getattr(message, "tool_calls", None)
    if calls:
        out["tool_calls"] = [openai_tool_call(getattr(c, "id", None), c.function.name, c.function.arguments) for c in calls]
    return out


def sampling_of(choice: Any) -> SamplingParams | None:
    """The sampling parameters a tracerl server sent with ``choice`` (its ``sampling`` field), else None."""
    return SamplingParams.from_field(extra_field(choice, "sampling"))


TokenIds = tuple[list[int] | None, list[int] | None, list[float] | None, SamplingParams | None]
"""(prompt token ids, completion token ids, completion logprobs, the sampling parameters those
logprobs are of) of a call's first choice."""


def token_ids(completion: Any, first: Any) -> TokenIds | None:
    """The exact tokens a tracerl-served (or vLLM) response carries for its first choice, else None."""
    ids = extra_field(first, "token_ids")
    prompt_ids = extra_field(completion, "prompt_token_ids") or extra_field(first, "prompt_token_ids")
    logprobs = logprob_values(field(first, "logprobs"))
    if ids is None and prompt_ids is None and logprobs is None:
        return None
    return (list(prompt_ids) if prompt_ids is not None else None, ints(ids), logprobs, sampling_of(first))


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
    return ChatOutcome(messages, finishes, field(completion, "id"), field(completion, "model"), field(usage, "prompt_tokens"),
                       field(usage, "completion_tokens"), token_ids(completion, choices[0]) if choices else None)  # fmt: skip
