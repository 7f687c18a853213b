"""Model-call inputs and outputs as other tools store them -> OpenAI chat messages.

Traces hold the same conversation in many shapes; these are the ones a Langfuse
observation's ``input`` / ``output`` takes (what its SDK integrations record, or what its
OpenTelemetry ingestion copies from span attributes):

* a list of OpenAI messages (Langfuse's OpenAI integration), or a request body
  ``{"messages": [...], "tools": [...]}`` (the same with tools; OpenInference's
  ``input.value``);
* LangChain's dicts (Langfuse's LangChain handler): OpenAI-like, but tool calls as
  ``{"name", "args", "id", "type": "tool_call"}`` and the offered tools appended as
  ``{"role": "tool", "content": <tool schema>}``; LangChain's serialised messages
  (``{"lc": 1, "type": "constructor", "id": [..., "AIMessage"], "kwargs": {...}}``) and
  ``{"type": "human" | "ai" | ...}`` dumps;
* GenAI semantic-convention messages (``{"role", "parts": [...]}``, ``gen_ai.*.messages``);
* a chat completion (``{"choices": [...]}``) or a LangChain ``LLMResult``
  (``{"generations": [[...]]}``) as the output; a plain string.

Everything comes out in one shape: OpenAI message dicts with ``role``, ``content``,
``tool_calls`` (arguments as the JSON string), ``tool_call_id``, ``name``.
"""

from __future__ import annotations

import json
from typing import Any

from ..messages import from_semconv

Message = dict[str, Any]
_LC_ROLES = {
    "HumanMessage": "user", "AIMessage": "assistant", "SystemMessage": "system", "ToolMessage": "tool",
    "FunctionMessage": "function", "HumanMessageChunk": "user", "AIMessageChunk": "assistant",
}  # fmt: skip
_TYPE_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool", "function": "function"}


def parse_json(value: Any) -> Any:
    """A JSON string's value (Langfuse's v2 API returns inputs and outputs as raw strings, and
    SDK integrations store a string output JSON-encoded: ``'"5"'``); other text as it is."""
    if isinstance(value, str) and value[:1] in ("{", "[", '"'):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def input_messages(value: Any) -> tuple[list[Message], list[dict[str, Any]]]:
    """A model call's input -> (messages, tool schemas offered)."""
    value = parse_json(value)
    tools: list[dict[str, Any]] = []
    if isinstance(value, dict):
        if isinstance(value.get("tools"), list):
            tools = [t for t in (tool_schema(t) for t in value["tools"]) if t]
        value = value.get("messages", value.get("input", [value]))
    if isinstance(value, str):
        return [{"role": "user", "content": value}], tools
    if not isinstance(value, list):
        return [], tools
    if value and isinstance(value[0], list):  # LangChain batches: [[messages of the first prompt]]
        value = value[0]
    messages: list[Message] = []
    for item in value:
        schema = _offered_tool(item)
        if schema is not None:
            tools.append(schema)
            continue
        message = message_of(item)
        if message is not None:
            messages.append(message)
    return messages, tools


def output_message(value: Any) -> tuple[Message | None, str | None]:
    """A model call's output -> (the assistant message, its finish reason)."""
    value = parse_json(value)
    finish = None
    if isinstance(value, dict) and isinstance(value.get("choices"), list) and value["choices"]:
        choice = value["choices"][0]
        value, finish = choice.get("message") or {}, choice.get("finish_reason")
    elif isinstance(value, dict) and isinstance(value.get("generations"), list) and value["generations"]:
        first = value["generations"][0]
        generation = (first[0] if isinstance(first, list) and first else first) or {}
        finish = (generation.get("generation_info") or {}).get("finish_reason")
        value = generation.get("message") or {"role": "assistant", "content": generation.get("text", "")}
    elif isinstance(value, list):
        if not value:
            return None, None
        value = value[-1]
    if isinstance(value, str):
        return {"role": "assistant", "content": value}, None
    if not isinstance(value, dict):
        return None, None
    finish = finish or value.get("finish_reason")
    message = message_of(value)
    if message is None:
        return None, finish
    message["role"] = "assistant"
    return message, finish


def message_of(item: Any) -> Message | None:
    """One message in any of the shapes above -> an OpenAI message dict (``None`` if not one)."""
    if isinstance(item, str):
        return {"role": "user", "content": item}
    if not isinstance(item, dict):
        return None
    if item.get("lc") == 1 and item.get("type") == "constructor":
        return _from_lc(item)
    if "parts" in item and "role" in item:
        return from_semconv(item)
    role = item.get("role") or _TYPE_ROLES.get(str(item.get("type")))
    if role is None:
        return None
    extra = item.get("additional_kwargs") or {}
    calls = item.get("tool_calls") or extra.get("tool_calls") or []
    message: Message = {"role": role, "content": _content(item.get("content"))}
    if calls:
        message["tool_calls"] = [call for call in (tool_call(c) for c in calls) if call]
        if message["content"] == "":
            message["content"] = None
    for key in ("tool_call_id", "name"):
        if item.get(key):
            message[key] = item[key]
    return message


def tool_call(call: Any) -> dict[str, Any] | None:
    """An OpenAI tool call from its OpenAI or LangChain (``name`` / ``args``) form."""
    if not isinstance(call, dict):
        return None
    function = call.get("function")
    if isinstance(function, dict):
        arguments = function.get("arguments")
        name = function.get("name")
    else:
        arguments, name = call.get("args", call.get("arguments")), call.get("name")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments if arguments is not None else {})
    return {"id": call.get("id"), "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_schema(tool: Any) -> dict[str, Any] | None:
    """An OpenAI tool schema from its OpenAI form or semconv's flat ``{name, parameters}``."""
    tool = parse_json(tool)
    if not isinstance(tool, dict):
        return None
    if isinstance(tool.get("function"), dict):
        return {"type": tool.get("type", "function"), "function": dict(tool["function"])}
    if "name" in tool and ("parameters" in tool or "description" in tool):
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        return {"type": "function", "function": function}
    return None


def _offered_tool(item: Any) -> dict[str, Any] | None:
    """Langfuse's LangChain handler appends the offered tools as ``role: tool`` messages."""
    if isinstance(item, dict) and item.get("role") == "tool" and not item.get("tool_call_id"):
        content = parse_json(item.get("content"))
        if isinstance(content, dict):
            return tool_schema(content)
    return None


def _from_lc(item: dict[str, Any]) -> Message | None:
    ids = item.get("id") or []
    kwargs = dict(item.get("kwargs") or {})
    role = _LC_ROLES.get(str(ids[-1]) if ids else "") or kwargs.get("role") or _TYPE_ROLES.get(str(kwargs.get("type")))
    if role is None:
        return None
    return message_of({**kwargs, "role": role})


def _content(content: Any) -> Any:
    """Text content as a string; OpenAI content parts kept as they are."""
    if content is None or isinstance(content, str):
        return content if content is not None else ""
    if isinstance(content, list):
        if all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            return "".join(str(p.get("text", "")) for p in content)
        return content
    return json.dumps(content, default=str)
