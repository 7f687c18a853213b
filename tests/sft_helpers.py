"""Small SFT data sets for the SFT tests (capital cities; an add tool)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Japan", "Tokyo"), ("Egypt", "Cairo"), ("Peru", "Lima"), ("Kenya", "Nairobi"),
    ("Norway", "Oslo"), ("Chile", "Santiago"), ("Greece", "Athens"), ("Cuba", "Havana"),
]
SYSTEM = {"role": "system", "content": "Answer in one short sentence."}

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
    },
}


def capital_example(country: str, city: str) -> dict[str, Any]:
    """An OpenAI chat fine-tuning record."""
    return {
        "messages": [
            SYSTEM,
            {"role": "user", "content": f"What is the capital of {country}?"},
            {"role": "assistant", "content": f"The capital of {country} is {city}."},
        ]
    }


def tool_example(a: int, b: int, *, first_weight: int | None = None) -> dict[str, Any]:
    """A tool-calling record: a call, its result, the answer (the call's weight optional)."""
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}],
    }
    if first_weight is not None:
        call["weight"] = first_weight
    return {
        "messages": [
            {"role": "system", "content": "Use the add tool for sums."},
            {"role": "user", "content": f"What is {a} + {b}?"},
            call,
            {"role": "tool", "tool_call_id": "call_1", "content": str(a + b)},
            {"role": "assistant", "content": f"{a} + {b} = {a + b}."},
        ],
        "tools": [ADD_TOOL],
    }


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def chat_template_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[Any] | None, **kwargs: Any) -> list[int]:
    """The tokenizer's own rendering, token ids (the oracle the SFT masks are checked against)."""
    clean = [{k: v for k, v in m.items() if k != "weight"} for m in messages]
    return list(tokenizer.apply_chat_template(clean, tools=tools, tokenize=True, return_dict=False, **kwargs))


def expected_mask(tokenizer: Any, record: dict[str, Any]) -> tuple[list[int], list[float]]:
    """Token ids of the whole conversation and 1.0 exactly on each trained assistant turn's tokens
    (from the generation prompt to its end-of-turn token), from the tokenizer's own template."""
    messages, tools = record["messages"], record.get("tools")
    full = chat_template_ids(tokenizer, messages, tools)
    mask = [0.0] * len(full)
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or message.get("weight", 1) == 0:
            continue
        start = len(chat_template_ids(tokenizer, messages[:i], tools, add_generation_prompt=True))
        end = len(chat_template_ids(tokenizer, messages[: i + 1], tools))
        turn = full[start:end]
        stop = turn.index(tokenizer.eos_token_id) + 1  # the end-of-turn token is trained, the newline after it is not
        for t in range(start, start + stop):
            mask[t] = 1.0
    return full, mask
