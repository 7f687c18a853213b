"""Conversations of the families' tests (``test_family_matrix.py``, ``test_family_training.py``): each
assistant turn forced to be the template's own rendering of it."""

from __future__ import annotations

import tracerl
from tracerl.train.tokenization import render_ids

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}]  # fmt: skip


def _call(i: int, city: str) -> dict:
    return {"id": f"call{i:05d}", "type": "function", "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}


def conversation(answer: str, *, follow_up: bool = False, system: str = "You are terse.") -> list[dict]:
    """Two tool rounds, each after reasoning, then an answer after reasoning (and, with ``follow_up``, a second question)."""
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Weather in Paris, then Rome?"},
        {"role": "assistant", "content": "", "reasoning_content": "Paris first.", "tool_calls": [_call(1, "Paris")]},
        {"role": "tool", "tool_call_id": "call00001", "content": "sunny"},
        {"role": "assistant", "content": "", "reasoning_content": "Now Rome.", "tool_calls": [_call(2, "Rome")]},
        {"role": "tool", "tool_call_id": "call00002", "content": "rainy"},
        {"role": "assistant", "content": answer, "reasoning_content": "Both are known."},
    ]
    if follow_up:
        messages += [{"role": "user", "content": "And tomorrow?"},
                     {"role": "assistant", "content": "No forecast.", "reasoning_content": "Nothing to call for that."}]  # fmt: skip
    return messages


def _plain(follow_up: bool, first: str) -> list[dict]:
    turns = [(first, "Sunny."), ("And Rome?", "Rainy.")] + ([("Thanks.", "Welcome.")] if follow_up else [])
    return [m for q, a in turns for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]


def family_conversation(family: str, *, follow_up: bool, variant: int = 0) -> tuple[list[dict], list | None]:
    """The family's conversation and tools: reasoning, two tool rounds and an answer (gpt-oss: its
    reasoning in ``thinking``; a second question comes before the tool rounds); Gemma 3: plain
    turns.  ``variant`` 1 words the first message otherwise (a different trajectory of the same shape)."""
    if family == "gemma3":
        return _plain(follow_up, ["Weather in Paris?", "How is Paris today?"][variant]), None
    messages = conversation("Paris is sunny, Rome is rainy.", follow_up=follow_up, system=["You are terse.", "Be brief."][variant])
    if family == "gptoss":
        rounds = [{**{k: v for k, v in m.items() if k != "reasoning_content"}, "thinking": m["reasoning_content"]}
                  if "reasoning_content" in m else m for m in messages[:7]]  # fmt: skip
        if follow_up:
            rounds = [*rounds[:2], {"role": "assistant", "content": "Checking.", "thinking": "Say so."},
                      {"role": "user", "content": "Go on."}, *rounds[2:]]  # fmt: skip
        return rounds, TOOLS
    return messages, TOOLS


def forced_turns(tokenizer, family: str, messages: list[dict], tools: list | None) -> list:
    """The conversation's items, each assistant turn a ``Choice`` of the template's own tokens for it."""
    from tracerl.families.models import stop_token_ids

    stops = set(stop_token_ids(tokenizer, family))
    items: list = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            items.append(message)
            continue
        prompt = render_ids(tokenizer, messages[:i], tools, add_generation_prompt=True)
        full = render_ids(tokenizer, messages[: i + 1], tools, add_generation_prompt=False)
        start = len(prompt)
        if full[:start] != prompt:  # the template moved something (Mistral: the system text to the last question)
            start = max(k for k in range(2, len(full) + 1) if full[k - 2 : k] == prompt[-2:])  # after the generation prompt
        completion = full[start:]
        if family == "gptoss" and i == len(messages) - 1 and message.get("thinking") and not message.get("tool_calls"):
            completion = _harmony_final(tokenizer, message)
        end = next(k for k, token in enumerate(completion) if token in stops)
        items.append(tracerl.Choice(message=message, token_ids=completion[: end + 1], prompt_token_ids=prompt,
                                    logprobs=[-1.0] * (end + 1)))  # fmt: skip
    return items


def _harmony_final(tokenizer, message: dict) -> list[int]:
    """A gpt-oss final answer as the model samples it: its analysis, then the final channel.  (The
    template renders a final message of the history without its analysis, so the rendering is not
    what was sampled; the turn is the last of its conversation, so nothing is rendered after it.)"""
    text = (f"<|channel|>analysis<|message|>{message['thinking']}<|end|>"
            f"<|start|>assistant<|channel|>final<|message|>{message['content']}<|return|>")  # fmt: skip
    return tokenizer(text, add_special_tokens=False)["input_ids"]


async def scored_conversation(model, tokenizer, family: str, messages: list[dict], tools: list | None, reward: float):
    """The conversation as a trajectory whose assistant turns are the template's tokens (``forced_turns``),
    each scored by the served policy: the logprobs a sampler would have returned."""
    from tracerl.train.distill import TeacherQuery, served_teacher

    served = served_teacher(model, model_name=model.get_inference_name())
    items = forced_turns(tokenizer, family, messages, tools)
    for i, item in enumerate(items):
        if isinstance(item, tracerl.Choice):
            query = TeacherQuery(messages[:i], tools, item.prompt_token_ids, item.token_ids)
            items[i] = item.model_copy(update={"logprobs": await served.score(query)})
    return tracerl.Trajectory(messages_and_choices=items, tools=tools, reward=reward)
