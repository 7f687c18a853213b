"""Parse Hermes-style tool calls out of generated text into OpenAI ``tool_calls``.

The shipped template (``templates/chatml_tools.jinja``) renders an assistant tool call as::

    <tool_call>
    {"name": "NAME", "arguments": ARGS}
    </tool_call>

and writes an ``arguments`` *string* back verbatim.  So the arguments string we return is the
exact slice of text the model wrote for the arguments object: re-rendering the parsed message
then reproduces the sampled text (and so the sampled tokens) whenever the model wrote the
canonical layout.  Blocks whose JSON cannot be read stay in ``content`` as they were written.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)(?:" + re.escape(TOOL_CALL_END) + r"|\Z)", re.DOTALL)
_DECODER = json.JSONDecoder()
_WS = " \t\r\n"


@dataclass
class ParsedToolCalls:
    """What :func:`parse_tool_calls` found: OpenAI ``tool_calls`` and the remaining text."""

    content: str | None
    """Text outside the parsed blocks, stripped; ``None`` when nothing is left."""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """OpenAI-shaped calls: ``{"id", "type": "function", "function": {"name", "arguments"}}``."""


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _skip_ws(text: str, index: int) -> int:
    while index < len(text) and text[index] in _WS:
        index += 1
    return index


def _top_level_spans(text: str, start: int) -> tuple[dict[str, tuple[int, int]], int] | None:
    """Spans of the values of a JSON object's top-level keys; ``None`` if it is not one object."""
    if start >= len(text) or text[start] != "{":
        return None
    spans: dict[str, tuple[int, int]] = {}
    index = _skip_ws(text, start + 1)
    if index < len(text) and text[index] == "}":
        return spans, index + 1
    while True:
        try:
            key, index = _DECODER.raw_decode(text, index)
        except json.JSONDecodeError:
            return None
        if not isinstance(key, str):
            return None
        index = _skip_ws(text, index)
        if index >= len(text) or text[index] != ":":
            return None
        value_start = _skip_ws(text, index + 1)
        try:
            _, value_end = _DECODER.raw_decode(text, value_start)
        except json.JSONDecodeError:
            return None
        spans[key] = (value_start, value_end)
        index = _skip_ws(text, value_end)
        if index < len(text) and text[index] == ",":
            index = _skip_ws(text, index + 1)
            continue
        if index < len(text) and text[index] == "}":
            return spans, index + 1
        return None


def parse_tool_call_body(body: str) -> dict[str, Any] | None:
    """One ``<tool_call>`` body → an OpenAI tool call, or ``None`` if it is not a valid call."""
    start = _skip_ws(body, 0)
    try:
        obj, end = _DECODER.raw_decode(body, start)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or body[end:].strip():
        return None
    key = "arguments" if "arguments" in obj else ("parameters" if "parameters" in obj else None)
    value = obj.get(key) if key else {}
    if isinstance(value, dict):
        found = _top_level_spans(body, start)
        if found is not None and key in found[0]:
            value_start, value_end = found[0][key]
            arguments = body[value_start:value_end]  # exactly as the model wrote it
        else:
            arguments = json.dumps(value, ensure_ascii=False)
    elif isinstance(value, str):
        try:  # a JSON object already serialised into a string is passed through
            arguments = value if isinstance(json.loads(value), dict) else json.dumps(value, ensure_ascii=False)
        except json.JSONDecodeError:
            return None
    else:
        return None
    return {"id": new_call_id(), "type": "function", "function": {"name": obj["name"], "arguments": arguments}}


def parse_tool_calls(text: str) -> ParsedToolCalls:
    """Split generated ``text`` into content and Hermes-style tool calls.

    An unterminated last block (generation stopped before ``</tool_call>``) is accepted when
    its JSON is complete.  Malformed blocks are left in the content unchanged.
    """
    if TOOL_CALL_START not in text:
        return ParsedToolCalls(content=text)
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    position = 0
    for match in _BLOCK.finditer(text):
        call = parse_tool_call_body(match.group(1))
        if call is None:
            continue
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append(call)
    kept.append(text[position:])
    if not calls:
        return ParsedToolCalls(content=text)
    content = "".join(kept).strip()
    return ParsedToolCalls(content=content or None, tool_calls=calls)
