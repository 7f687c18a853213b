"""Tool calls and reasoning in each model family's own format, read from a sampled turn's text.

tracerl's servers read Hermes ``<tool_call>`` blocks (``tool_calls.py``: SmolLM2 with tracerl's
template, Qwen2.5, Qwen3).  Other families write a call otherwise, and some write reasoning beside it:

============  ==========================================================================================
format        a sampled turn
============  ==========================================================================================
``hermes``    ``<think>REASONING</think>`` (Qwen3), then text and ``<tool_call>{"name", "arguments"}</tool_call>`` blocks
``llama3``    the whole reply one JSON object ``{"name", "parameters"}`` (after ``<|python_tag|>`` for built-in tools); several separated by ``;``
``mistral``   text, then ``[TOOL_CALLS]`` and a JSON list of ``{"name", "arguments", "id"}``
``harmony``   gpt-oss's messages: ``<|channel|>analysis<|message|>REASONING<|end|>``, then ``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>ARGS<|call|>`` or ``<|channel|>final<|message|>TEXT<|return|>``
============  ==========================================================================================

Their markers are special tokens of those vocabularies, so the text must be decoded with special
tokens kept.  :func:`detect_format` asks a tokenizer's chat template which format it renders (a probe
call, as :mod:`.chat_template` does), so a family needs no setting; a template without tool calls
gives None.  A turn whose calls cannot be read keeps its text as ``content``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from .chat_template import probe_rendering
from .tool_calls import new_call_id, parse_tool_call_body, parse_tool_calls

Format = Literal["hermes", "llama3", "mistral", "harmony"]
FORMATS: tuple[Format, ...] = ("hermes", "llama3", "mistral", "harmony")
_DECODER = json.JSONDecoder()
THINK_BLOCK = re.compile(r"\A\s*<think>(.*?)</think>\s*", re.DOTALL)
"""A leading ``<think>REASONING</think>`` block (Qwen3)."""
_HARMONY_MESSAGE = re.compile(
    r"(?:<\|start\|>assistant)?(?P<recipient> to=functions\.[^<\s]+)?<\|channel\|>(?P<channel>\w+)[^<]*<\|message\|>"
    r"(?P<body>.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|\Z)",
    re.DOTALL,
)


@dataclass
class ParsedTurn:
    """What a sampled turn said: OpenAI-shaped ``content``, ``tool_calls`` and ``reasoning_content``."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning_content: str | None = None


def detect_format(tokenizer: Any) -> Format | None:
    """The tool-call format ``tokenizer``'s chat template renders, or None when it renders none."""
    text = probe_rendering(tokenizer)
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "to=functions.probe" in text:
        return "harmony"
    if re.search(r'\{"name": "probe", "parameters"', text):
        return "llama3"
    return None


def parse_turn(text: str, format: Format, *, end_markers: tuple[str, ...] = (), reasoning: bool = True) -> ParsedTurn:
    """Read ``text`` (decoded with its special tokens) in ``format``; ``end_markers``: end-of-turn
    tokens to drop from its end (``<|im_end|>``, ``<|eot_id|>``, ``</s>`` ...); ``reasoning``:
    whether a leading ``<think>`` block is reasoning (else it stays in the text)."""
    for marker in end_markers:
        if marker and text.endswith(marker):
            text = text[: -len(marker)]
            break
    if format == "harmony":
        return _harmony(text)
    thought = None
    think = THINK_BLOCK.match(text) if reasoning else None
    if think:
        thought, text = think.group(1).strip(), text[think.end() :]
    if format == "hermes":
        parsed = parse_tool_calls(text)
        return ParsedTurn(parsed.content if parsed.tool_calls else _text(text), parsed.tool_calls, thought)
    if format == "llama3":
        return ParsedTurn(*_llama3(text), thought)
    if format == "mistral":
        return ParsedTurn(*_mistral(text), thought)
    raise ValueError(f"unknown tool-call format {format!r}; known: {', '.join(FORMATS)}")


def _text(text: str) -> str | None:
    return text.strip() or None


def _llama3(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    calls: list[dict[str, Any]] = []
    index = 0
    while index < len(body):
        try:
            _, end = _DECODER.raw_decode(body, index)
        except json.JSONDecodeError:
            return _text(text), []
        call = parse_tool_call_body(body[index:end])
        if call is None:
            return _text(text), []
        calls.append(call)
        index = end
        while index < len(body) and body[index] in " \t\r\n;":  # calls separated by ";"
            index += 1
    return (None, calls) if calls else (_text(text), [])


def _mistral(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    before, marker, after = text.partition("[TOOL_CALLS]")
    if not marker:
        return _text(text), []
    try:
        items = json.loads(after.strip())
    except json.JSONDecodeError:
        return _text(text), []
    items = items if isinstance(items, list) else [items]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not isinstance(item.get("arguments", {}), dict):
            return _text(text), []
        calls.append({"id": str(item.get("id") or new_call_id()), "type": "function",
                      "function": {"name": item["name"], "arguments": json.dumps(item.get("arguments", {}), ensure_ascii=False)}})  # fmt: skip
    return _text(before), calls


def _harmony(text: str) -> ParsedTurn:
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    for message in _HARMONY_MESSAGE.finditer(text):
        channel, body, recipient = message.group("channel"), message.group("body"), message.group("recipient")
        if recipient:
            name = recipient.strip().removeprefix("to=functions.")
            try:
                arguments = json.loads(body)
            except json.JSONDecodeError:
                arguments = None
            if not isinstance(arguments, dict):
                return ParsedTurn(_text(text))
            calls.append({"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": body.strip()}})
        elif channel == "analysis":
            reasoning.append(body.strip())
        else:
            content.append(body)
    if not (reasoning or content or calls):
        return ParsedTurn(_text(text))
    return ParsedTurn("".join(content).strip() or None, calls, "\n".join(reasoning) or None)
