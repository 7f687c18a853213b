"""Anthropic's Messages API (``POST /v1/messages``) on tracerl's chat-completions path.

Why: an agent on the ``anthropic`` SDK (or LiteLLM's Anthropic route) pointed at tracerl's
endpoint should sample from the policy like any other, with token truth kept.  vLLM's own
``/v1/messages`` drops token ids and logprobs, so a Messages request becomes one
chat-completions request here, and the answer a ``message`` that also carries what the engine
sampled, as tracerl extension fields: ``prompt_token_ids``, ``token_ids``, ``token_logprobs`` (of the
sampled distribution) and ``sampling`` (the temperature, top-p and top-k applied).

A ``tool_use`` block's ``input`` is an object, while the model wrote its arguments as text:
the text of each call this server made is remembered (bounded) by the call's id, and when the
conversation sends that call back with the same ``input`` the model's own text is what the chat
template renders again (so the next turn's prompt extends the sampled tokens).

Accepted fields are :data:`ACCEPTED`; anything else, or a value this server cannot honour
(images, extended thinking), is a 400 in Anthropic's error shape naming it.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator

from ..net.http_server import OpenAIError
from .protocol import joined_text

ACCEPTED = frozenset({
    "model", "messages", "max_tokens", "system", "tools", "tool_choice", "temperature", "top_p", "top_k",
    "stop_sequences", "stream", "metadata", "service_tier", "thinking", "container", "context_management",
    "cache_control", "diagnostics", "inference_geo", "output_config", "speed", "user_profile_id", "workspace_id",
})  # fmt: skip
"""Every request field this server reads or accepts (the rest is a 400).  The ``anthropic`` SDK 2.x has no
``temperature``, ``top_p`` or ``top_k`` arguments; they are read here when a client sends them
(``extra_body``), and sampling defaults to temperature 1 otherwise."""

DEFAULT_REMEMBERED_CALLS = 4096


def error_body(error: OpenAIError) -> dict[str, Any]:
    """``error`` in Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``)."""
    kinds = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
             413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}  # fmt: skip
    return {"type": "error", "error": {"type": kinds.get(error.status, "api_error"), "message": error.message}}


class CallTexts:
    """The arguments text of recent tool calls, by call id, so ``tool_use`` blocks render as sampled."""

    def __init__(self, max_items: int = DEFAULT_REMEMBERED_CALLS) -> None:
        self.max_items = max_items
        self._items: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, call_id: str, arguments: str) -> None:
        with self._lock:
            self._items[call_id] = arguments
            while len(self._items) > self.max_items:
                self._items.popitem(last=False)

    def arguments(self, call_id: str, tool_input: Any) -> str:
        """The text the model wrote for this call when ``tool_input`` is still what it meant, else canonical JSON."""
        with self._lock:
            written = self._items.get(call_id)
        if written is not None:
            try:
                if json.loads(written) == tool_input:
                    return written
            except ValueError:
                pass
        return json.dumps(tool_input, ensure_ascii=False)


@dataclass
class Turn:
    """A translated request: the chat body to sample and the request it came from."""

    chat: dict[str, Any]
    request: dict[str, Any]


def chat_messages(message: Any, where: str, calls: CallTexts) -> list[dict[str, Any]]:
    """One Messages-API message as chat messages (tool results become ``tool`` messages first)."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise OpenAIError(f"{where} needs a 'role' of user or assistant", param="messages")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise OpenAIError(f"{where}: content must be a string or a list of blocks", param="messages")
    texts: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        at = f"{where}.content[{index}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            call_id, name, tool_input = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(tool_input, dict):
                raise OpenAIError(f"{at}: a tool_use block needs 'id', 'name' and an 'input' object", param="messages")
            arguments = calls.arguments(call_id, tool_input)
            tool_calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind == "tool_result" and role == "user":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise OpenAIError(f"{at}: a tool_result block needs its 'tool_use_id'", param="messages")
            output = block.get("content")
            result = "" if output is None else joined_text(output, at, param="messages")
            results.append({"role": "tool", "tool_call_id": call_id, "content": result})
        else:
            raise OpenAIError(f"{at}: {kind or type(block).__name__!r} blocks are not supported in a {role} message here",
                              param="messages")  # fmt: skip
    text = "".join(texts)
    if role == "assistant":
        answer: dict[str, Any] = {"role": "assistant", "content": text or None}
        if tool_calls:
            answer["tool_calls"] = tool_calls
        return [answer]
    return results + ([{"role": "user", "content": text}] if texts or not results else [])


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not isinstance(tools, list):
        raise OpenAIError("'tools' must be a list", param="tools")
    chat = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or tool.get("type") not in (None, "custom"):
            raise OpenAIError(f"tools[{index}]: only client tools with a 'name' and an 'input_schema' run here", param="tools")
        function: dict[str, Any] = {"name": tool["name"]}  # OpenAI's order: the chat template writes it as it is
        if tool.get("description"):
            function["description"] = tool["description"]
        function["parameters"] = tool.get("input_schema") or {"type": "object", "properties": {}}
        chat.append({"type": "function", "function": function})
    return chat


def _tool_choice(choice: Any) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise OpenAIError(f"tool_choice {choice!r} is not supported here (auto, any, tool or none)", param="tool_choice")


def chat_request(body: Any, calls: CallTexts) -> Turn:
    """The chat-completions request for a Messages request body; raises :class:`OpenAIError` (400)."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    unknown = sorted(set(body) - ACCEPTED)
    if unknown:
        raise OpenAIError(f"unsupported field(s) for /v1/messages: {', '.join(unknown)}", param=unknown[0])
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled"):
        raise OpenAIError("extended thinking is not supported by this model server", param="thinking")
    for key in ("container", "context_management"):
        if body.get(key) is not None:
            raise OpenAIError(f"'{key}' is not supported here", param=key)
    output_config = body.get("output_config")
    if isinstance(output_config, dict) and output_config.get("format") is not None:
        raise OpenAIError("structured output (output_config.format) is not supported here", param="output_config.format")
    model, max_tokens = body.get("model"), body.get("max_tokens")
    if not isinstance(model, str) or not model:
        raise OpenAIError("'model' is required", param="model")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise OpenAIError("'max_tokens' is required: a positive integer", param="max_tokens")
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise OpenAIError("'messages' must be a non-empty list", param="messages")
    messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": joined_text(body["system"], "system", param="system")})
    for index, message in enumerate(body["messages"]):
        messages += chat_messages(message, f"messages[{index}]", calls)
    chat: dict[str, Any] = {
        "model": model, "messages": messages, "max_tokens": max_tokens, "logprobs": True, "return_token_ids": True,
    }  # fmt: skip
    tools = chat_tools(body.get("tools"))
    tool_choice = _tool_choice(body["tool_choice"]) if body.get("tool_choice") is not None else None
    if tools:
        chat["tools"] = tools
        if tool_choice is not None:
            chat["tool_choice"] = tool_choice
    for key in ("temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            chat[key] = body[key]
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise OpenAIError("'stop_sequences' must be a list of non-empty strings", param="stop_sequences")
        chat["stop"] = stop
    return Turn(chat=chat, request=body)


def message_from_chat(completion: dict[str, Any], turn: Turn, calls: CallTexts) -> dict[str, Any]:
    """The ``message`` object for a finished chat completion."""
    choice = completion["choices"][0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        arguments = call["function"]["arguments"]
        try:
            tool_input = json.loads(arguments)
        except ValueError:
            tool_input = None
        if not isinstance(tool_input, dict):  # the parser keeps only JSON objects: a guard, not a path
            content.append({"type": "text", "text": arguments})
            continue
        calls.put(call["id"], arguments)
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": tool_input})
    finish = choice.get("finish_reason")
    stopped_by = choice.get("stop_reason")
    stop_sequence = stopped_by if isinstance(stopped_by, str) and stopped_by in (turn.request.get("stop_sequences") or ()) else None
    if any(block["type"] == "tool_use" for block in content):
        reason = "tool_use"
    elif finish == "length":
        reason = "max_tokens"
    elif stop_sequence is not None:
        reason = "stop_sequence"
    else:
        reason = "end_turn"
    usage = completion.get("usage") or {}
    logprobs = (choice.get("logprobs") or {}).get("content") or []
    return {
        "id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant",
        "model": completion.get("model") or turn.request["model"], "content": content,
        "stop_reason": reason, "stop_sequence": stop_sequence,
        "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0),
                  "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
        # tracerl's extensions: what the engine sampled for this call
        "prompt_token_ids": choice.get("prompt_token_ids") or completion.get("prompt_token_ids"),
        "token_ids": choice.get("token_ids"),
        "token_logprobs": [entry["logprob"] for entry in logprobs] if logprobs else None,
        "sampling": choice.get("sampling"),
    }  # fmt: skip


def message_events(message: dict[str, Any]) -> Iterator[str]:
    """A finished ``message`` as the Messages API's server-sent events, in its order."""

    def event(kind: str, **data: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    usage = message["usage"]
    opened = {**message, "content": [], "stop_reason": None, "stop_sequence": None, "usage": {**usage, "output_tokens": 0}}
    yield event("message_start", message=opened)
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
            yield event("content_block_delta", index=index, delta={"type": "text_delta", "text": block["text"]})
        else:
            yield event("content_block_start", index=index, content_block={**block, "input": {}})
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            yield event("content_block_delta", index=index, delta=delta)
        yield event("content_block_stop", index=index)
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    yield event("message_delta", delta=delta, usage={"output_tokens": usage["output_tokens"]})
    yield event("message_stop")
