"""OpenAI's Responses API (``POST /v1/responses``) on tracerl's chat-completions path.

Why translate rather than pass through: vLLM's own ``/v1/responses`` does not keep token truth
(token ids only through ``enable_response_messages``; ``previous_response_id`` needs an
unbounded in-memory store).  Here a Responses request becomes one chat-completions request
(the same sampling, chat template and tool-call parsing as every other call), and its answer
becomes a ``response`` object that also carries what the engine sampled, as tracerl extension
fields beside OpenAI's: ``prompt_token_ids``, ``token_ids``, ``token_logprobs`` (of the sampled
distribution) and ``sampling`` (the temperature, top-p and top-k applied).

Accepted request fields are :data:`ACCEPTED`; a field outside it, or a value this server cannot
honour (a hosted tool, structured output, reasoning effort), is a 400 naming it, never a silent
drop.  Fields a client sends by default that change nothing here (``store``, ``metadata``,
``truncation``, ``parallel_tool_calls``, ``user``, ``service_tier``, ``prompt_cache_key``, ...)
are accepted and echoed.  ``strict`` on a function tool is accepted: the call's arguments are
checked after sampling to be a JSON object with the schema's required keys, and a call that is
not is answered as text (the agent sees what the model wrote, nothing is invented).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterator

from ..net.http_server import OpenAIError
from .protocol import joined_text

ACCEPTED = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p",
    "previous_response_id", "store", "stream", "stream_options", "include", "metadata", "parallel_tool_calls",
    "truncation", "user", "text", "reasoning", "top_logprobs", "service_tier", "prompt_cache_key",
    "safety_identifier", "background", "max_tool_calls", "prompt_cache_retention", "conversation",
})  # fmt: skip
"""Every request field this server reads or accepts (the rest is a 400)."""

LOGPROBS_INCLUDE = "message.output_text.logprobs"
TEXT_PARTS = ("input_text", "output_text", "text")
DEFAULT_STORED = 4096
"""Responses remembered for ``previous_response_id`` (oldest forgotten first)."""


@dataclass
class Turn:
    """A translated request: the chat body to sample and what the answer is built from."""

    chat: dict[str, Any]
    request: dict[str, Any]
    messages: list[dict[str, Any]]
    """The whole conversation sent to the model (stored for ``previous_response_id``)."""
    strict: dict[str, list[str]] = field(default_factory=dict)
    """Strict function tools: name -> the schema's required keys."""


class ResponseStore:
    """The conversations behind recent response ids, bounded (``previous_response_id``)."""

    def __init__(self, max_items: int = DEFAULT_STORED) -> None:
        self.max_items = max_items
        self._items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[response_id] = messages
            while len(self._items) > self.max_items:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> list[dict[str, Any]]:
        with self._lock:
            messages = self._items.get(response_id)
        if messages is None:
            raise OpenAIError(
                f"previous_response_id {response_id!r} is unknown here: this server remembers its last {self.max_items} "
                "responses (stored ones only); send the conversation as input instead",
                status=404, type="not_found_error", param="previous_response_id",
            )  # fmt: skip
        return [dict(m) for m in messages]


def input_messages(items: Any) -> list[dict[str, Any]]:
    """Responses input items as chat messages (function calls folded into their assistant turn)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise OpenAIError("'input' must be a string or a list of input items", param="input")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise OpenAIError(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise OpenAIError(f"{where}: role must be user, system, developer or assistant", param="input")
            content = joined_text(item.get("content"), where, param="input", kinds=TEXT_PARTS)
            messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not all(isinstance(v, str) and v for v in (name, call_id)) or not isinstance(arguments, str):
                raise OpenAIError(f"{where}: a function_call needs 'call_id', 'name' and 'arguments' strings", param="input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id:
                raise OpenAIError(f"{where}: a function_call_output needs its 'call_id'", param="input")
            result = joined_text(output, where, param="input", kinds=TEXT_PARTS)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
        else:
            raise OpenAIError(f"{where}: input items of type {kind!r} are not supported here", param="input")
    return messages


def chat_tools(tools: Any) -> tuple[list[dict[str, Any]] | None, dict[str, list[str]]]:
    if tools is None or tools == []:
        return None, {}
    if not isinstance(tools, list):
        raise OpenAIError("'tools' must be a list", param="tools")
    chat, strict = [], {}
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise OpenAIError(f"tools[{index}]: only function tools run here, not {kind!r}", param="tools")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise OpenAIError(f"tools[{index}] needs a 'name'", param="tools")
        function: dict[str, Any] = {"name": name}  # OpenAI's order: the chat template writes it as it is
        if tool.get("description"):
            function["description"] = tool["description"]
        function["parameters"] = tool.get("parameters") or {"type": "object", "properties": {}}
        chat.append({"type": "function", "function": function})
        if tool.get("strict"):
            strict[name] = list((function["parameters"] or {}).get("required") or [])
    return chat, strict


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise OpenAIError(f"tool_choice {choice!r} is not supported here (auto, none, required or a function)", param="tool_choice")


def _check_unsupported(body: dict[str, Any]) -> None:
    unknown = sorted(set(body) - ACCEPTED)
    if unknown:
        raise OpenAIError(f"unsupported field(s) for /v1/responses: {', '.join(unknown)}", param=unknown[0])
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    text_format = (text.get("format") or {}).get("type", "text")
    if text_format != "text":
        raise OpenAIError(f"text.format {text_format!r} is not supported here (plain text only)", param="text.format")
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and any(v is not None for v in reasoning.values()):
        raise OpenAIError("reasoning settings are not supported by this model server", param="reasoning")
    if body.get("background"):
        raise OpenAIError("background responses are not supported here", param="background")
    if body.get("conversation") is not None:
        raise OpenAIError("'conversation' is not supported here: use previous_response_id or send the input", param="conversation")


def chat_request(body: Any, store: ResponseStore) -> Turn:
    """The chat-completions request for a Responses request body; raises :class:`OpenAIError` (400)."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    _check_unsupported(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError("'model' is required", param="model")
    messages: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise OpenAIError("'previous_response_id' must be a string", param="previous_response_id")
        messages = [m for m in store.get(previous) if m["role"] != "system"]  # instructions are not carried over
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise OpenAIError("'instructions' must be a string", param="instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    if body.get("input") is None:
        raise OpenAIError("'input' is required", param="input")
    messages += input_messages(body["input"])
    tools, strict = chat_tools(body.get("tools"))
    chat: dict[str, Any] = {
        "model": model, "messages": messages, "logprobs": True, "return_token_ids": True, "stream": False,
    }  # fmt: skip
    tool_choice = _tool_choice(body.get("tool_choice"))
    if tools:
        chat["tools"] = tools
        if tool_choice is not None:
            chat["tool_choice"] = tool_choice
    for source, target in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                           ("top_logprobs", "top_logprobs")):  # fmt: skip
        if body.get(source) is not None:
            chat[target] = body[source]
    return Turn(chat=chat, request=body, messages=messages, strict=strict)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def as_written(call: dict[str, Any]) -> str:
    """A parsed tool call as the chat template writes it (the text the model sampled, in its canonical layout)."""
    function = call["function"]
    return f'<tool_call>\n{{"name": {json.dumps(function["name"])}, "arguments": {function["arguments"]}}}\n</tool_call>'


def _strict_ok(call: dict[str, Any], strict: dict[str, list[str]]) -> bool:
    name = call["function"]["name"]
    if name not in strict:
        return True
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError:
        return False
    return isinstance(arguments, dict) and all(key in arguments for key in strict[name])


def response_from_chat(completion: dict[str, Any], turn: Turn, store: ResponseStore) -> dict[str, Any]:
    """The ``response`` object for a finished chat completion (and the conversation remembered)."""
    choice = completion["choices"][0]
    message = choice.get("message") or {}
    calls = message.get("tool_calls") or []
    text = message.get("content")
    if calls and not all(_strict_ok(call, turn.strict) for call in calls):
        text = "\n".join([*([text] if text else []), *map(as_written, calls)])  # a strict tool never gets bad arguments
        calls = []
    logprobs = (choice.get("logprobs") or {}).get("content") or []
    include = turn.request.get("include") or []
    output: list[dict[str, Any]] = []
    if text:
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if LOGPROBS_INCLUDE in include or turn.request.get("top_logprobs"):
            part["logprobs"] = logprobs
        output.append({"type": "message", "id": _new_id("msg"), "status": "completed", "role": "assistant", "content": [part]})
    for call in calls:
        output.append({
            "type": "function_call", "id": _new_id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": "completed",
        })  # fmt: skip
    usage = completion.get("usage") or {}
    length = choice.get("finish_reason") == "length"
    body = turn.request
    response: dict[str, Any] = {
        "id": _new_id("resp"), "object": "response", "created_at": time.time(), "model": completion.get("model") or body["model"],
        "status": "incomplete" if length else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if length else None, "error": None,
        "output": output, "instructions": body.get("instructions"), "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto", "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"), "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": body.get("previous_response_id"), "metadata": body.get("metadata") or {},
        "store": body.get("store", True), "text": {"format": {"type": "text"}}, "truncation": body.get("truncation") or "disabled",
        "usage": {
            "input_tokens": usage.get("prompt_tokens", 0), "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage.get("completion_tokens", 0), "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.get("total_tokens", 0),
        },
        # tracerl's extensions: what the engine sampled for this call
        "prompt_token_ids": choice.get("prompt_token_ids") or completion.get("prompt_token_ids"),
        "token_ids": choice.get("token_ids"),
        "token_logprobs": [entry["logprob"] for entry in logprobs] if logprobs else None,
        "sampling": choice.get("sampling"),
    }  # fmt: skip
    if body.get("store", True):
        answer: dict[str, Any] = {"role": "assistant", "content": text if text else None}
        if calls:
            answer["tool_calls"] = calls
        store.put(response["id"], [*turn.messages, answer])
    return response


def response_events(response: dict[str, Any]) -> Iterator[str]:
    """A finished ``response`` as the Responses API's server-sent events, in its order."""
    sequence = itertools.count()

    def event(kind: str, **data: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(sequence), **data})}\n\n"

    opened = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    yield event("response.created", response=opened)
    yield event("response.in_progress", response=opened)
    for index, item in enumerate(response["output"]):
        if item["type"] == "message":
            yield event("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "content": []})
            for part_index, part in enumerate(item["content"]):
                ids = {"item_id": item["id"], "output_index": index, "content_index": part_index}
                yield event("response.content_part.added", **ids, part={"type": "output_text", "text": "", "annotations": []})
                yield event("response.output_text.delta", **ids, delta=part["text"], logprobs=part.get("logprobs") or [])
                yield event("response.output_text.done", **ids, text=part["text"], logprobs=part.get("logprobs") or [])
                yield event("response.content_part.done", **ids, part=part)
        else:
            yield event("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "arguments": ""})
            ids = {"item_id": item["id"], "output_index": index}
            yield event("response.function_call_arguments.delta", **ids, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **ids, arguments=item["arguments"], name=item["name"])
        yield event("response.output_item.done", output_index=index, item=item)
    yield event("response.incomplete" if response["status"] == "incomplete" else "response.completed", response=response)
