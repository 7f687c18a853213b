"""Render a group of trajectories into the judge's prompt.

The longest common message prefix is shown once (``<context>``), then each
trajectory's remainder (``<trajectory id="k">``), with tool calls and tool results
written out as such, every additional history of the trajectory, and the tools on offer.
Ids are positions in the order shown (``"1"`` … ``"K"``); the caller maps them back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

Message = dict[str, Any]
Tool = dict[str, Any]


@dataclass(frozen=True)
class Candidate:
    """What the judge sees of one trajectory: its histories and the tools it had."""

    messages: list[Message]
    additional_histories: list[list[Message]] = field(default_factory=list)
    tools: list[Tool] | None = None


@dataclass(frozen=True)
class RenderedGroup:
    """A group rendered once; :func:`user_prompt` lays it out in any order."""

    context: str
    """The shared message prefix ('' when there is none)."""
    tools: str
    """The tools on offer to every trajectory ('' when none or when they differ)."""
    bodies: list[str]
    """Per candidate: its remainder, additional histories and (when they differ) its tools."""


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def _text(content: Any) -> str:
    """Message content as text (multi-part contents joined, images named), tags neutralised."""
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif isinstance(part, dict):
                parts.append(f"[{part.get('type', 'part')}]")
            else:
                parts.append(str(part))
        content = "\n".join(parts)
    text = str(content)
    # a trajectory must not be able to close its own block or open a fake one
    return text.replace("</trajectory", "<\\/trajectory").replace("<trajectory ", "<\\trajectory ")


def _tool_call(call: dict[str, Any]) -> str:
    function = call.get("function") or {}
    name = function.get("name", call.get("name", "?"))
    arguments = function.get("arguments", call.get("arguments", ""))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    call_id = f' id="{call["id"]}"' if call.get("id") else ""
    return f'<tool_call name="{name}"{call_id}>{_text(arguments)}</tool_call>'


def render_message(message: Message) -> str:
    role = message.get("role", "?")
    attributes = f'role="{role}"'
    if message.get("tool_call_id"):
        attributes += f' tool_call_id="{message["tool_call_id"]}"'
    if message.get("name"):
        attributes += f' name="{message["name"]}"'
    lines = []
    text = _text(message.get("content"))
    if text:
        lines.append(text)
    for call in message.get("tool_calls") or []:
        lines.append(_tool_call(call))
    if message.get("function_call"):
        lines.append(_tool_call({"function": message["function_call"]}))
    body = "\n".join(lines)
    return f"<message {attributes}>\n{body}\n</message>"


def render_messages(messages: Sequence[Message]) -> str:
    return "\n".join(render_message(m) for m in messages)


def render_tools(tools: Sequence[Tool] | None) -> str:
    """Tools as a JSON list of ``{name, description, parameters}`` (the OpenAI schema, flattened)."""
    if not tools:
        return ""
    flat = []
    for tool in tools:
        function = tool.get("function", tool)
        flat.append(
            {
                "name": function.get("name"),
                "description": function.get("description", ""),
                "parameters": function.get("parameters", {}),
            }
        )
    return json.dumps(flat, ensure_ascii=False, indent=1)


def common_prefix_length(message_lists: Sequence[Sequence[Message]]) -> int:
    """How many leading messages all lists share; every list keeps at least its last message."""
    if not message_lists:
        return 0
    shortest = min(len(m) for m in message_lists)
    n = 0
    while n < shortest and len({_canonical(m[n]) for m in message_lists}) == 1:
        n += 1
    return max(0, min(n, shortest - 1))


def _body(candidate: Candidate, prefix: list[Message], own_tools: bool) -> str:
    remainder = candidate.messages[len(prefix) :]
    parts = [render_messages(remainder) if remainder else "(no messages after the shared context)"]
    prefix_keys = [_canonical(m) for m in prefix]
    for index, history in enumerate(candidate.additional_histories, start=2):
        shared = 0  # leading messages this history shares with the context: not repeated
        while shared < min(len(prefix), len(history) - 1) and _canonical(history[shared]) == prefix_keys[shared]:
            shared += 1
        note = f' after_context_messages="{shared}"' if shared else ""
        parts.append(f'<history index="{index}"{note}>\n{render_messages(history[shared:])}\n</history>')
    if own_tools:
        parts.append(f"<tools>\n{render_tools(candidate.tools) or '(none)'}\n</tools>")
    return "\n".join(parts)


def render_group(candidates: Sequence[Candidate], tools: Sequence[Tool] | None = None) -> RenderedGroup:
    """Render every candidate once; ``tools`` (if given) are on offer to all of them."""
    prefix_length = common_prefix_length([c.messages for c in candidates])
    prefix = list(candidates[0].messages[:prefix_length]) if candidates else []
    own = {_canonical(c.tools or []) for c in candidates}
    shared_tools = tools if tools is not None else (candidates[0].tools if len(own) == 1 and candidates else None)
    own_tools = tools is None and len(own) > 1
    return RenderedGroup(
        context=render_messages(prefix) if prefix else "",
        tools=render_tools(shared_tools),
        bodies=[_body(c, prefix, own_tools) for c in candidates],
    )


def user_prompt(rendered: RenderedGroup, order: Sequence[int]) -> str:
    """The user message: context, tools, then the candidates in ``order`` with ids ``1..K``."""
    sections = []
    if rendered.context:
        sections.append(f"<context>\n{rendered.context}\n</context>")
    if rendered.tools:
        sections.append(f"<tools>\n{rendered.tools}\n</tools>")
    for position, index in enumerate(order, start=1):
        sections.append(f'<trajectory id="{position}">\n{rendered.bodies[index]}\n</trajectory>')
    ids = ", ".join(f'"{p}"' for p in range(1, len(order) + 1))
    sections.append(f"Score every trajectory (ids {ids}) with the rubric. Answer with the JSON object only.")
    return "\n\n".join(sections)


def candidate_key(candidate: Candidate) -> str:
    """Content identity used to judge identical trajectories once."""
    return _canonical([candidate.messages, candidate.additional_histories, candidate.tools or []])
