"""OpenAI chat messages <-> GenAI semantic-convention messages (role + parts).

Semconv: ``{"role", "parts": [{"type": "reasoning", "content"}, {"type": "text", "content"},
{"type": "tool_call", "id", "name", "arguments"}, {"type": "tool_call_response", "id", "response"}]}``
(a message's ``reasoning_content``, vLLM's field, is its reasoning part); output
messages also carry ``finish_reason``.  Tool-call arguments are kept as the exact string
the model produced.  Also reads OpenInference's flattened ``llm.*_messages.N.*`` form.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Mapping


def to_plain(value: Any) -> Any:
    """SDK objects (pydantic, LangChain messages) to plain dicts."""
    if isinstance(value, (dict, list, str, int, float, bool)) or value is None:
        return value
    dump = getattr(value, "model_dump", None)
    if dump is not None:
        return dump(exclude_none=True)
    if isinstance(value, tuple):
        return list(value)
    return value


def openai_tool_call(call_id: Any, name: Any, arguments: Any) -> dict[str, Any]:
    """One tool call of an assistant message, OpenAI-style."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def to_semconv(message: Any) -> dict[str, Any]:
    """One OpenAI-format message (dict or SDK object) to a semconv message."""
    message = to_plain(message)
    role = message.get("role", "user")
    parts: list[dict[str, Any]] = []
    content = message.get("content")
    if isinstance(message.get("reasoning_content"), str):
        parts.append({"type": "reasoning", "content": message["reasoning_content"]})
    if role == "tool":
        parts.append({"type": "tool_call_response", "id": message.get("tool_call_id"), "response": content})
    elif isinstance(content, str):
        if content or not message.get("tool_calls"):
            parts.append({"type": "text", "content": content})
    elif isinstance(content, list):
        for part in content:
            part = to_plain(part)
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append({"type": "text", "content": part.get("text", "")})
            elif isinstance(part, dict):
                parts.append({"type": part.get("type", "generic"), "openai": part})
    for call in message.get("tool_calls") or ():
        call = to_plain(call)
        function = to_plain(call.get("function") or {})
        parts.append(
            {"type": "tool_call", "id": call.get("id"), "name": function.get("name"), "arguments": function.get("arguments")}
        )
    out: dict[str, Any] = {"role": role, "parts": parts}
    if message.get("name"):
        out["name"] = message["name"]
    return out


def from_semconv(message: Mapping[str, Any]) -> dict[str, Any]:
    """A semconv message back to an OpenAI-format message dict."""
    role = message.get("role", "user")
    texts: list[str] = []
    other: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    out: dict[str, Any] = {"role": role}
    for part in message.get("parts") or ():
        kind = part.get("type")
        if kind == "text":
            texts.append(part.get("content") or "")
        elif kind == "reasoning":
            out["reasoning_content"] = part.get("content") or ""
        elif kind == "tool_call":
            arguments = part.get("arguments")
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments if arguments is not None else {})
            calls.append(openai_tool_call(part.get("id"), part.get("name"), arguments))
        elif kind == "tool_call_response":
            response = part.get("response")
            out["tool_call_id"] = part.get("id")
            texts.append(response if isinstance(response, str) else json.dumps(response))
        elif "openai" in part:
            other.append(part["openai"])
    if other:
        out["content"] = [{"type": "text", "text": t} for t in texts] + other
    elif texts or role != "assistant" or not calls:
        out["content"] = "".join(texts)
    else:
        out["content"] = None
    if calls:
        out["tool_calls"] = calls
    if message.get("name"):
        out["name"] = message["name"]
    return out


def openai_message(message: Any) -> dict[str, Any]:
    """A message (dict or SDK object) as the converter keeps it: the semconv round trip, so a call
    reads the same from a hook's record and from the span made of it for exporters."""
    return from_semconv(to_semconv(message))


def from_openinference(attributes: Mapping[str, Any], prefix: str) -> list[dict[str, Any]]:
    """Messages from OpenInference's flattened attributes (``llm.input_messages.0.message.role``...)."""
    rows: dict[int, dict[str, Any]] = {}
    head = prefix + "."
    for key, value in attributes.items():
        if not key.startswith(head):
            continue
        index_text, _, rest = key[len(head) :].partition(".")
        if not index_text.isdigit():
            continue
        row = rows.setdefault(int(index_text), {})
        rest = rest.removeprefix("message.")
        if rest == "role":
            row["role"] = value
        elif rest == "content":
            row["content"] = value
        elif rest == "tool_call_id":
            row["tool_call_id"] = value
        elif rest == "name":
            row["name"] = value
        elif rest.startswith("tool_calls."):
            call_index_text, _, field = rest[len("tool_calls.") :].partition(".")
            if call_index_text.isdigit():
                calls = row.setdefault("_calls", {})
                call = calls.setdefault(int(call_index_text), {"type": "function", "function": {}})
                field = field.removeprefix("tool_call.")
                if field == "id":
                    call["id"] = value
                elif field == "function.name":
                    call["function"]["name"] = value
                elif field == "function.arguments":
                    call["function"]["arguments"] = value
    out = []
    for index in sorted(rows):
        row = rows[index]
        calls = row.pop("_calls", None)
        row.setdefault("role", "user")
        row.setdefault("content", "" if not calls else None)
        if calls:
            row["tool_calls"] = [calls[i] for i in sorted(calls)]
        out.append(row)
    return out


def _canonical_arguments(arguments: Any) -> str:
    """Tool-call arguments as sorted-key JSON (a call's arguments are compared as its output and
    again in each later input that repeats it: the form of a text is remembered)."""
    return _canonical_argument_text(arguments) if isinstance(arguments, str) else _sorted_json(arguments)


@functools.lru_cache(maxsize=1024)
def _canonical_argument_text(arguments: str) -> str:
    return _sorted_json(arguments, parse=True)


def _sorted_json(arguments: Any, *, parse: bool = False) -> str:
    try:
        return json.dumps(json.loads(arguments) if parse else arguments, sort_keys=True)
    except (TypeError, ValueError):
        return str(arguments).strip()


def canonical(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """A comparison key that survives re-serialisation by frameworks (whitespace, None vs "")."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    text = (content or "").strip()
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        calls.append((function.get("name"), _canonical_arguments(function.get("arguments"))))
    role = message.get("role")
    if role == "tool":
        return (role, message.get("tool_call_id"), text)
    return (role, text, tuple(calls))
