"""Responses-API and Messages-API calls in chat-completions shape, for the capture hooks.

A call on OpenAI's Responses API or Anthropic's Messages API is recorded exactly as a chat
completion is (one model-call span, one record, the same trajectory), so its hook only turns the
request into chat keyword arguments and the answer into a chat completion.  The conversions are
the ones tracerl's servers use to answer those APIs (:mod:`tracerl.inference.responses_api`,
:mod:`tracerl.inference.messages_api`), so a conversation reads the same on both sides.  A
tracerl endpoint's answer carries the sampled ``prompt_token_ids``, ``token_ids`` and
``token_logprobs`` and the ``sampling`` parameters applied; they become the completion's token fields.

Requests to other providers may use what tracerl's servers refuse (hosted tools, reasoning,
images): only the conversation and the function tools are read here, and a shape that cannot
be read raises :class:`~tracerl.net.http_server.OpenAIError` for the hook to count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tracerl.inference import messages_api, responses_api

from .completions import extra_field, field
from .messages import openai_tool_call, to_plain
from .spans import given

_STORED = responses_api.ResponseStore()
"""Conversations behind the response ids this process saw (``previous_response_id``)."""
_CALL_TEXTS = messages_api.CallTexts()
"""Stays empty on the client side: a ``tool_use`` block's arguments are read as canonical JSON."""


def _completion(answer: Any, texts: list[str], calls: list[dict[str, Any]], finish: str) -> dict[str, Any]:
    """The chat completion of one answer (a ``Response`` or a ``Message``, SDK object or dict): its text,
    its tool calls, usage, and the token fields a tracerl endpoint adds."""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    usage = field(answer, "usage")
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
    completion: dict[str, Any] = {
        "id": field(answer, "id"), "model": field(answer, "model"), "choices": [choice],
        "usage": {"prompt_tokens": field(usage, "input_tokens"), "completion_tokens": field(usage, "output_tokens")},
    }  # fmt: skip
    fields = ("token_ids", "prompt_token_ids", "token_logprobs", "sampling")
    return _with_tokens(completion, *(extra_field(answer, name) for name in fields))


def _with_tokens(completion: dict[str, Any], ids: Any, prompt_ids: Any, logprobs: Any, sampling: Any = None) -> dict[str, Any]:
    """``completion`` with the token fields a tracerl endpoint sent (each None when it sent none)."""
    choice = completion["choices"][0]
    if ids is not None:
        choice["token_ids"] = list(ids)
    if prompt_ids is not None:
        completion["prompt_token_ids"] = list(prompt_ids)
    if logprobs is not None:
        choice["logprobs"] = {"content": [{"logprob": float(value)} for value in logprobs]}
    if sampling is not None:
        choice["sampling"] = sampling
    return completion


def _chat(kwargs: dict[str, Any], messages: list[Any], keep: Callable[[Any], Any], convert: Callable[[Any], Any]) -> dict[str, Any]:
    """Chat keyword arguments: ``messages``, the tools ``keep`` accepts (``convert``-ed to chat's), temperature, stream."""
    chat: dict[str, Any] = {"model": kwargs.get("model"), "messages": messages}
    tools = kwargs.get("tools")
    if given(tools) and tools:
        chat["tools"] = convert([to_plain(tool) for tool in tools if keep(tool)])
    for key in ("temperature", "stream"):
        if given(kwargs.get(key)):
            chat[key] = kwargs[key]
    return chat


# -- OpenAI Responses ------------------------------------------------------------------------------------------
def responses_request(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Chat keyword arguments for ``responses.create(**kwargs)``: the whole conversation it continues."""
    messages: list[dict[str, Any]] = []
    previous = kwargs.get("previous_response_id")
    if given(previous):
        try:
            messages = [m for m in _STORED.get(str(previous)) if m["role"] != "system"]
        except Exception:  # noqa: BLE001 - a conversation this process did not see: its new part is what we have
            messages = []
    instructions = kwargs.get("instructions")
    if given(instructions) and isinstance(instructions, str):
        messages.insert(0, {"role": "system", "content": instructions})
    items = kwargs.get("input")
    if given(items):
        messages += responses_api.input_messages(items if isinstance(items, str) else [to_plain(item) for item in items])
    return _chat(kwargs, messages, lambda tool: field(tool, "type") == "function", lambda tools: responses_api.chat_tools(tools)[0])


def responses_completion(response: Any, request: dict[str, Any]) -> dict[str, Any]:
    """A finished ``Response`` (SDK object or dict) as a chat completion; its conversation is remembered."""
    texts, calls = [], []
    for item in field(response, "output") or ():
        kind = field(item, "type")
        if kind == "message":
            texts += [field(part, "text") or "" for part in field(item, "content") or () if field(part, "type") == "output_text"]
        elif kind == "function_call":
            calls.append(openai_tool_call(field(item, "call_id"), field(item, "name"), field(item, "arguments")))
    finish = "tool_calls" if calls else ("length" if field(response, "status") == "incomplete" else "stop")
    completion = _completion(response, texts, calls, finish)
    if completion["id"]:
        _STORED.put(str(completion["id"]), [*request["messages"], completion["choices"][0]["message"]])
    return completion


# -- Anthropic Messages ----------------------------------------------------------------------------------------
def messages_request(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Chat keyword arguments for ``messages.create(**kwargs)``."""
    chat_messages: list[dict[str, Any]] = []
    system = kwargs.get("system")
    if given(system):
        chat_messages.append({"role": "system", "content": system if isinstance(system, str) else
                              "".join(field(block, "text") or "" for block in system)})  # fmt: skip
    for index, message in enumerate(kwargs.get("messages") or ()):
        chat_messages += messages_api.chat_messages(to_plain(message), f"messages[{index}]", _CALL_TEXTS)
    client_tool = lambda tool: field(tool, "type") in (None, "custom") and field(tool, "name")
    return _chat(kwargs, chat_messages, client_tool, messages_api.chat_tools)


def messages_completion(message: Any) -> dict[str, Any]:
    """A finished Anthropic ``Message`` (SDK object or dict) as a chat completion.

    A ``tool_use`` block carries its arguments as an object: they are written as canonical JSON
    here (the sampled token ids, not this text, are what trains)."""
    texts, calls = [], []
    for block in field(message, "content") or ():
        kind = field(block, "type")
        if kind == "text":
            texts.append(field(block, "text") or "")
        elif kind == "tool_use":
            call_id, tool_input = field(block, "id"), to_plain(field(block, "input"))
            arguments = _CALL_TEXTS.arguments(str(call_id), tool_input)
            calls.append(openai_tool_call(call_id, field(block, "name"), arguments))
    finish = {"tool_use": "tool_calls", "max_tokens": "length"}.get(str(field(message, "stop_reason")), "stop")
    return _completion(message, texts, calls, finish)


# -- OpenAI legacy Completions ---------------------------------------------------------------------------------
def completions_request(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Chat keyword arguments for ``completions.create(prompt=...)``: the prompt as one user message
    (its exact tokens are the ``prompt_token_ids`` the endpoint returns)."""
    prompt = kwargs.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise TypeError("only a text prompt is captured (a batch or token ids is not)")
    return {"model": kwargs.get("model"), "messages": [{"role": "user", "content": prompt}], "stream": kwargs.get("stream")}


def completions_completion(completion: Any, _chat: dict[str, Any]) -> dict[str, Any]:
    """A text ``Completion`` as a chat completion: its first choice's text, token ids and logprobs."""
    first = (field(completion, "choices") or [None])[0]
    answer = {"id": field(completion, "id"), "model": field(completion, "model"), "usage": None}
    usage = field(completion, "usage")
    chat = _completion(answer, [field(first, "text") or ""], [], str(field(first, "finish_reason") or "stop"))
    chat["usage"] = {"prompt_tokens": field(usage, "prompt_tokens"), "completion_tokens": field(usage, "completion_tokens")}
    prompt_ids = extra_field(completion, "prompt_token_ids") or extra_field(first, "prompt_token_ids")
    return _with_tokens(chat, extra_field(first, "token_ids"), prompt_ids, field(field(first, "logprobs"), "token_logprobs"),
                        extra_field(first, "sampling"))  # fmt: skip
