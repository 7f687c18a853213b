"""A LiteLLM agent loop captured by tracerl (``litellm.acompletion`` with one tool).

    python examples/litellm_agent.py                      # serve SmolLM2-135M here (CPU)
    python examples/litellm_agent.py --base-url URL       # any tracerl-served endpoint

The agent code is ordinary LiteLLM code; ``tracerl.integrations.instrument()`` plus a
rollout scope turn each attempt into a trajectory with exact token ids.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Any

import tracerl
import tracerl.integrations as ti

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

SYSTEM = (
    "You never answer arithmetic in words: you call a tool. Example:\n"
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
)
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
QUESTIONS = [("What is 17 + 25?", 42), ("What is 3 + 4?", 7)]


def add(a: int, b: int) -> int:
    return int(a) + int(b)


async def run_agent(params: dict[str, Any], question: str, *, max_turns: int = 3) -> str:
    import litellm

    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    for _ in range(max_turns):
        response = await litellm.acompletion(messages=messages, tools=[ADD_TOOL], max_tokens=64, **params)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            try:
                result = str(add(**json.loads(call.function.arguments or "{}")))
            except Exception as error:  # noqa: BLE001 - a bad call is the model's; report it back
                result = f"error: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


async def collect(model: tracerl.Model, *, rollouts_per_question: int = 2) -> list[tracerl.TrajectoryGroup]:
    ti.instrument("litellm", "openai")
    params = model.litellm_completion_params()
    groups = []
    for question, expected in QUESTIONS:
        group = await ti.trajectory_group(
            lambda q=question: run_agent(params, q), n=rollouts_per_question, model=model, task=question
        )
        for trajectory in group:
            trajectory.reward = float(str(expected) in json.dumps(trajectory.messages()))
        groups.append(group)
    return groups


async def main(base_url: str | None = None) -> list[tracerl.TrajectoryGroup]:
    backend = None
    if base_url:
        ti.register_endpoint(base_url)
        model: tracerl.Model = tracerl.Model("litellm-agent", "examples", inference_base_url=base_url, inference_model_name="base")
    else:
        model = tracerl.TrainableModel("litellm-agent", "examples", "smollm2-135m")
        backend = tracerl.LocalBackend(inference="transformers")
        await model.register(backend)
    try:
        groups = await collect(model)
    finally:
        if backend is not None:
            await backend.close()
    for group in groups:
        for t in group:
            print(f"reward={t.reward} turns={len(t.sampled_turns())} token_ids={t.metrics['capture_turns_with_token_ids']}")
    return groups


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="a tracerl-served OpenAI-compatible endpoint (default: serve SmolLM2 here)")
    asyncio.run(main(parser.parse_args().base_url))
