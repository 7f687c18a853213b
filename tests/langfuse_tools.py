"""Where Langfuse puts a model call's tools: a Python port of its tool normalisation.

Ported from Langfuse's ``packages/shared/src/server/ingestion/extractToolsBackend.ts``
(``normalizeToolsForObservation``, called by ``OtelIngestionProcessor.processToEvent`` on
every span with the span's input, output and metadata).  The span attributes Langfuse did not
use as input or output end up in ``metadata.attributes``; tool definitions found there
(``gen_ai.tool.definitions``, ``ai.prompt.tools``, OpenInference's
``llm.tools.{i}.tool.json_schema``, pydantic-ai's ``model_request_parameters.function_tools``)
or in ``metadata.tools`` are moved into the observation's input (``{"messages": [...],
"tools": [...]}``: what the generation view shows as the offered tools) and indexed in the
observation's ``tool_definitions`` (name -> ``{"description", "parameters"}`` JSON) and
``tool_calls`` / ``tool_call_names`` (the calls the output holds).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_TOOL_METADATA_KEYS = re.compile(
    r'"(?:ai\.prompt\.tools|gen_ai\.tool\.definitions|model_request_parameters|llm\.tools\.\d+\.tool\.json_schema)"\s*:'
)
_INDEXED_TOOL = re.compile(r"^llm\.tools\.(\d+)\.tool\.json_schema$")


@dataclass
class Tools:
    """``normalizeToolsForObservation``'s result."""

    input: Any
    output: Any
    metadata: Any
    tool_definitions: dict[str, str] = field(default_factory=dict)
    tool_calls: list[str] = field(default_factory=list)
    tool_call_names: list[str] = field(default_factory=list)


def normalize_tools(input_: Any, output: Any, metadata: Any) -> Tools:
    normalized_input, normalized_metadata, for_extraction = _normalize_tool_metadata(input_, metadata)
    definitions = _definitions_of(for_extraction if for_extraction is not None else _parse(normalized_input))
    calls = _calls_of(_parse(output))
    seen: set[str] = set()
    unique = []
    for call in calls:
        key = call["id"] or f"{call['name']}-{call['arguments']}"
        if key not in seen:
            seen.add(key)
            unique.append(call)
    return Tools(
        input=normalized_input, output=output, metadata=normalized_metadata,
        tool_definitions={d["name"]: _stringify({"description": d.get("description") or "", "parameters": d.get("parameters") or ""})
                          for d in definitions},
        tool_calls=[_stringify({"id": c["id"], "arguments": c["arguments"], "type": c.get("type") or "", "index": c.get("index") or 0})
                    for c in unique],
        tool_call_names=[c["name"] for c in unique],
    )  # fmt: skip


# -- normalizeToolMetadataForObservation -------------------------------------------------------------
def _normalize_tool_metadata(input_: Any, metadata: Any) -> tuple[Any, Any, Any]:
    parsed = _parse(metadata)
    if not isinstance(parsed, dict):
        return input_, metadata, None
    tools, cleaned = _collect_tools(parsed)
    if not tools:
        return input_, metadata, None
    merged, mapped = _append_tools(input_, tools)
    if not mapped:
        return input_, metadata, None
    return merged, cleaned, merged


def _collect_tools(metadata: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    tools: list[Any] = []
    cleaned = dict(metadata)
    found = _tool_array(metadata.get("tools"), every=True, provider_without_name=False)
    if found:
        tools += found
        del cleaned["tools"]
    raw = metadata.get("attributes")
    attributes = _parse(raw) if not isinstance(raw, str) or _TOOL_METADATA_KEYS.search(raw) else None
    if not isinstance(attributes, dict):
        return _dedupe(tools), cleaned
    kept = dict(attributes)
    for key, provider_without_name in (("ai.prompt.tools", True), ("gen_ai.tool.definitions", False)):
        found = _tool_array(attributes.get(key), every=True, provider_without_name=provider_without_name)
        if found is not None:
            tools += found
            del kept[key]
    parameters = _parse(attributes.get("model_request_parameters"))
    if isinstance(parameters, dict):
        found = _tool_array(parameters.get("function_tools"), every=True, provider_without_name=False)
        rest = {k: v for k, v in parameters.items() if not (found is not None and k == "function_tools")}
        if found is not None:
            tools += found
        if rest:
            kept["model_request_parameters"] = _stringify(rest) if isinstance(attributes["model_request_parameters"], str) else rest
        else:
            kept.pop("model_request_parameters", None)
    indexed = sorted(((int(m.group(1)), k) for k in attributes if (m := _INDEXED_TOOL.match(k))))
    for _, key in indexed:
        tool = _parse(attributes[key])
        if _tool_entry(tool, provider_without_name=False):
            tools.append(tool)
            del kept[key]
    if kept:
        cleaned["attributes"] = kept
    else:
        cleaned.pop("attributes", None)
    return _dedupe(tools), cleaned


def _append_tools(input_: Any, tools: list[Any]) -> tuple[Any, bool]:
    def merge(value: Any) -> tuple[Any, bool]:
        if isinstance(value, list):
            return {"messages": value, "tools": tools}, True
        if isinstance(value, dict):
            if value.get("tools") is not None:
                existing = _tool_array(value["tools"])
                if existing is None:  # not a list of tools: left as it is
                    return input_, False
                return {**value, "tools": _dedupe(existing + tools)}, True
            return {**value, "tools": tools}, True
        if value is None:
            return {"tools": tools}, True
        if isinstance(value, str):
            return {"prompt": value, "tools": tools}, True
        return input_, False

    if isinstance(input_, str):
        try:
            return merge(json.loads(input_))
        except ValueError:
            return {"prompt": input_, "tools": tools}, True
    return merge(input_)


def _tool_array(value: Any, *, every: bool = False, provider_without_name: bool = True) -> list[Any] | None:
    items = _array(value)
    if items is None:
        return None
    items = [_parse(i) for i in items]
    if not items:
        return []
    entries = [i for i in items if _tool_entry(i, provider_without_name=provider_without_name)]
    if every and len(entries) != len(items):
        return None
    return entries or None


def _tool_entry(tool: Any, *, provider_without_name: bool) -> bool:
    tool = _parse(tool)
    if not isinstance(tool, dict):
        return False
    return bool(_flat_definition(tool).get("name")) or (provider_without_name and isinstance(tool.get("type"), str))


def _dedupe(tools: list[Any]) -> list[Any]:
    seen: set[str] = set()
    out = []
    for tool in tools:
        name = _flat_definition(tool).get("name")
        if name and name in seen:
            continue
        if name:
            seen.add(name)
        out.append(tool)
    return out


# -- extractToolsFromObservation ------------------------------------------------------------------
def _flat_definition(tool: Any) -> dict[str, Any]:
    tool = _parse(tool)
    if not isinstance(tool, dict):
        return {}
    data = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    return {
        "name": data.get("name"),
        "description": data.get("description", data.get("desc")),
        "parameters": data.get("parameters") or data.get("parameters_json_schema") or data.get("inputSchema"),
    }


def _definitions_of(input_: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(tool: Any) -> None:
        flat = _flat_definition(tool)
        if flat.get("name") and not any(d["name"] == flat["name"] for d in out):
            params = flat.get("parameters")
            out.append({"name": flat["name"], "description": flat.get("description"),
                        "parameters": _stringify(params) if params else None})  # fmt: skip

    if not isinstance(input_, (dict, list)):
        return out
    obj = {"messages": input_} if isinstance(input_, list) else input_
    for tool in obj.get("tools") if isinstance(obj.get("tools"), list) else []:
        add(tool)
    for message in obj.get("messages") if isinstance(obj.get("messages"), list) else []:
        if isinstance(message, dict):
            for tool in message.get("tools") if isinstance(message.get("tools"), list) else []:
                add(tool)
            content = message.get("content")
            if message.get("role") == "tool" and isinstance(content, dict) and content.get("type") == "function" and content.get("function"):
                add(content)  # LangChain's offered tools, appended as tool messages
    return out


def _calls_of(output: Any) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    if not output:
        return calls
    if isinstance(output, list):
        for item in output:
            if isinstance(item, dict):
                if _call_like(item) and not _message_like(item):
                    _add_call(calls, item)
                else:
                    _calls_of_message(item, calls)
        return calls
    if not isinstance(output, dict):
        return calls
    if _call_like(output) and not _message_like(output):
        _add_call(calls, output)
        return calls
    for call in _array(output.get("tool_calls")) or _array(output.get("toolCalls")) or []:
        _add_call(calls, call)
    for choice in output.get("choices") if isinstance(output.get("choices"), list) else []:
        message = choice.get("message") if isinstance(choice, dict) else None
        if isinstance(message, dict):
            for call in _array(message.get("tool_calls")) or _array(message.get("toolCalls")) or []:
                _add_call(calls, call)
    _content_calls(output.get("content"), calls)
    kwargs = output.get("additional_kwargs")
    for call in (_array(kwargs.get("tool_calls")) if isinstance(kwargs, dict) else None) or []:
        _add_call(calls, call)
    return calls


def _calls_of_message(message: dict[str, Any], calls: list[dict[str, Any]]) -> None:
    for call in _array(message.get("tool_calls")) or _array(message.get("toolCalls")) or []:
        _add_call(calls, call)
    _content_calls(message.get("content"), calls)


def _content_calls(content: Any, calls: list[dict[str, Any]]) -> None:
    for part in content if isinstance(content, list) else []:
        if isinstance(part, dict) and part.get("type") == "tool_use":
            _add_call(calls, {"id": part.get("id"), "name": part.get("name"), "arguments": _stringify(part.get("input") or {}),
                              "type": "tool_use"})  # fmt: skip
        elif isinstance(part, dict) and part.get("type") == "tool-call":
            _add_call(calls, part)


def _add_call(calls: list[dict[str, Any]], call: Any) -> None:
    if not isinstance(call, dict):
        return
    function = call.get("function") if isinstance(call.get("function"), dict) else None
    name = (function or {}).get("name") or call.get("name") or call.get("toolName")
    if not name:
        return
    raw = next((v for v in ((function or {}).get("arguments"), call.get("arguments"), call.get("args"), call.get("input")) if v is not None), None)
    calls.append({
        "id": str(call.get("call_id") or call.get("id") or call.get("toolCallId") or ""), "name": name,
        "arguments": raw if isinstance(raw, str) else _stringify(raw if raw is not None else {}),
        "type": call.get("type") or ("function" if function else None), "index": call.get("index"),
    })  # fmt: skip


def _call_like(call: dict[str, Any]) -> bool:
    if call.get("type") == "tool-result":
        return False
    function = call.get("function") if isinstance(call.get("function"), dict) else {}
    marker = "id" in call or "index" in call or str(call.get("type")) in ("function", "function_call", "tool-call", "tool_use")
    return bool(
        (function.get("name") and "arguments" in function)
        or (call.get("toolName") and (call.get("type") == "tool-call" or "input" in call or "args" in call))
        or (call.get("call_id") and call.get("name") and "arguments" in call)
        or (call.get("type") == "tool_use" and call.get("name") and "input" in call)
        or (call.get("name") and "arguments" in call and marker)
    )


def _message_like(value: dict[str, Any]) -> bool:
    return any(k in value for k in ("role", "content", "tool_calls", "additional_kwargs"))


def _array(value: Any) -> list[Any] | None:
    if isinstance(value, list):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return None
        return parsed if isinstance(parsed, list) else None
    return None


def _stringify(value: Any) -> str:
    """``JSON.stringify``: no spaces after separators."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _parse(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value
