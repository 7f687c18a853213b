"""Messages as a model's chat template expects them: tool-call arguments as objects or as strings.

OpenAI messages carry a tool call's ``arguments`` as a JSON *string*.  Some templates (tracerl's
own, Qwen3's) write a string back verbatim, which keeps exactly the text the model sampled; others
(Qwen2.5, Llama 3.1, Mistral NeMo, gpt-oss) always apply ``tojson``, so a string comes out quoted
and escaped (``"arguments": "{\\"city\\": ...}"``): a history the model never wrote, and a prompt
that no longer extends the tokens it sampled.  vLLM converts every call's arguments to an object
before rendering; here the template is asked once, with a probe, which form it writes as the model
would, and strings are kept wherever the template writes them verbatim.  Used for every rendering
tracerl does: the transformers server's prompts and the trainer's (``train/tokenization.py``).
"""

from __future__ import annotations

import json
from typing import Any, Callable

_PROBE_ARGUMENTS = '{"probe": 1}'
_PROBE = [
    {"role": "user", "content": "probe"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call00001", "type": "function", "function": {"name": "probe", "arguments": _PROBE_ARGUMENTS}}]},
]  # fmt: skip  (a 9-character call id, as Mistral's template requires)
_PROBE_TOOLS = [{"type": "function", "function": {"name": "probe", "description": "probe", "parameters": {"type": "object", "properties": {}}}}]
_renderings: dict[str, str] = {}
_REASONING_PROBE = "probe-reasoning-7f3a"
_reasoning: dict[str, bool] = {}


def _per_template(cache: dict[str, Any], tokenizer: Any, render: Callable[[Any], Any], failed: Any) -> Any:
    """``render(tokenizer)`` once per template text (``failed`` when the template raises)."""
    template = getattr(tokenizer, "chat_template", None)
    key = template if isinstance(template, str) else repr(template)
    if key not in cache:
        try:
            cache[key] = render(tokenizer)
        except Exception:  # noqa: BLE001 - the template cannot render the probe
            cache[key] = failed
    return cache[key]


def probe_rendering(tokenizer: Any) -> str:
    """``tokenizer``'s chat template's rendering of a probe tool call ``probe({"probe": 1})`` with its
    string arguments ("" when the template cannot render a tool call); rendered once per template text."""
    return _per_template(_renderings, tokenizer, lambda t: t.apply_chat_template(_PROBE, tools=_PROBE_TOOLS, tokenize=False), "")


def renders_reasoning(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s chat template writes an assistant turn's ``reasoning_content`` (Qwen3's
    ``<think>``): then a reply's reasoning is its own field, as the template expects it back."""
    probe = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": "done", "reasoning_content": _REASONING_PROBE}]
    return _per_template(_reasoning, tokenizer, lambda t: _REASONING_PROBE in t.apply_chat_template(probe, tokenize=False), False)


def wants_object_arguments(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s chat template quotes a string ``arguments`` (then it is given objects);
    a template that cannot render the probe (no tool support) keeps strings."""
    text = probe_rendering(tokenizer)
    return _PROBE_ARGUMENTS not in text and json.dumps(_PROBE_ARGUMENTS) in text


def template_messages(tokenizer: Any, messages: list[Any]) -> list[Any]:
    """``messages`` with tool-call arguments parsed into objects when the template wants them
    (:func:`wants_object_arguments`); the list itself when nothing changes.  Arguments that are not a
    JSON object stay strings."""
    if not any(isinstance(m, dict) and m.get("tool_calls") for m in messages) or not wants_object_arguments(tokenizer):
        return messages
    return [_with_object_arguments(m) if isinstance(m, dict) and m.get("tool_calls") else m for m in messages]


def _with_object_arguments(message: dict[str, Any]) -> dict[str, Any]:
    calls = []
    for call in message["tool_calls"]:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError:
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**function, "arguments": parsed}}
        calls.append(call)
    return {**message, "tool_calls": calls}
