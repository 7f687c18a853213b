"""An OpenAI Agents SDK agent learns to use its calculator tool, with GRPO, on a laptop CPU.

The agent is the SDK's own: ``agents.Agent`` with a ``@function_tool`` ``add``, run by
``Runner.run`` on the SDK's default model class (``OpenAIResponsesModel``, the Responses API),
pointed at tracerl's endpoint.  Nothing in it knows about tracerl: each attempt runs inside
``tracerl.rollout(...)`` and its calls become the trajectory, with the token ids the engine
sampled.  The task and the reward are the demo's (``examples/demo.py``): "What is A + B?" with
two worked examples; the first sampled turn is scored for the tool call (shaped, up to 0.8),
+0.2 for a final answer holding the sum.

    .venv/bin/python examples/agents_sdk_learns.py --steps 10 --seed 0

Offline the SDK must not export its own traces to OpenAI: ``OPENAI_AGENTS_DISABLE_TRACING=1``
(set here before the SDK is imported).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")

import agents  # noqa: E402 - after the environment variable above
from openai import AsyncOpenAI  # noqa: E402

import tracerl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo import SYSTEM, WORKED_PAIRS, make_backend, make_tasks, score_call  # noqa: E402


@agents.function_tool
def add(a: int, b: int) -> int:
    """Add two integers and return the sum."""
    return a + b


def worked_examples() -> list[dict]:
    """The demo's two solved tasks, as Responses API input items."""
    items: list[dict] = []
    for i, (a, b) in enumerate(WORKED_PAIRS):
        items += [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"type": "function_call", "call_id": f"call_{i}", "name": "add", "arguments": json.dumps({"a": a, "b": b})},
            {"type": "function_call_output", "call_id": f"call_{i}", "output": str(a + b)},
            {"role": "assistant", "content": f"The answer is {a + b}."},
        ]
    return items


def make_agent(model: tracerl.TrainableModel, temperature: float) -> agents.Agent:
    client = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key, max_retries=0, timeout=600)
    return agents.Agent(
        name="calculator", instructions=SYSTEM, tools=[add],
        model=agents.OpenAIResponsesModel(model=model.get_inference_name(), openai_client=client),
        model_settings=agents.ModelSettings(temperature=temperature, max_tokens=40),
    )  # fmt: skip


async def rollout(model: tracerl.TrainableModel, task: dict[str, int], temperature: float) -> tracerl.Trajectory:
    async with tracerl.rollout(model, task=f"{task['a']}+{task['b']}") as r:
        try:
            result = await agents.Runner.run(make_agent(model, temperature), [*worked_examples(),
                {"role": "user", "content": f"What is {task['a']} + {task['b']}?"}], max_turns=3)  # fmt: skip
            final = str(result.final_output)
        except agents.exceptions.AgentsException:  # the policy rambled past its turns: no answer
            final = ""
    trajectory = r.trajectory
    turns = trajectory.sampled_turns()
    reward, call_ok = score_call(turns[0], task) if turns else (0.0, False)
    answered = call_ok and re.search(rf"\b{task['a'] + task['b']}\b", final) is not None
    trajectory.reward = reward + (0.2 if answered else 0.0)
    trajectory.metrics.update(tool_call_ok=float(call_ok), answer_ok=float(answered))
    return trajectory


async def evaluate(model: tracerl.TrainableModel, tasks: list[dict[str, int]]) -> float:
    """Mean held-out reward, greedy."""
    trajectories = await tracerl.gather_trajectories((rollout(model, t, 0.0) for t in tasks), pbar_desc=None)
    return sum(t.reward for t in trajectories) / len(trajectories)


async def main(args: argparse.Namespace) -> None:
    train_tasks, val_tasks = make_tasks(args.seed, 400), make_tasks(10_000 + args.seed, args.val_tasks)
    model = tracerl.TrainableModel(f"agents-sdk-s{args.seed}", "agents-sdk", "smollm2-135m", base_path=args.data,
                                   lora_config={"r": 16, "alpha": 32})  # fmt: skip
    backend = make_backend(args)
    started = time.monotonic()
    await model.register(backend)
    try:
        curve = [(await model.get_step(), await evaluate(model, val_tasks))]
        print(f"held-out reward at step {curve[0][0]}: {curve[0][1]:.3f}", flush=True)
        batches = tracerl.iterate_dataset(train_tasks, groups_per_step=args.groups_per_step, num_epochs=100,
                                          initial_step=curve[0][0], use_tqdm=False)  # fmt: skip
        for batch in batches:
            if batch.step >= args.steps:
                break
            groups = await tracerl.gather_trajectory_groups(
                (tracerl.TrajectoryGroup(rollout(model, task, 1.0) for _ in range(args.rollouts)) for task in batch.items),
                pbar_desc=None, max_exceptions=0.25,
            )  # fmt: skip
            result = await backend.train(model, groups, learning_rate=args.lr)
            await model.log(groups, split="train", metrics=result.metrics, step=result.step)
            rewards = [t.reward for g in groups for t in g]
            print(f"step {result.step}/{args.steps}  train reward {sum(rewards) / len(rewards):.3f}  "
                  f"{(time.monotonic() - started) / 60:.1f} min", flush=True)  # fmt: skip
            if result.step % args.eval_every == 0 or result.step == args.steps:
                curve.append((result.step, await evaluate(model, val_tasks)))
                print(f"held-out reward at step {result.step}: {curve[-1][1]:.3f}", flush=True)
    finally:
        await backend.close()
    print("held-out curve: " + ", ".join(f"step {s}: {v:.3f}" for s, v in curve))
    print(f"wall time {(time.monotonic() - started) / 60:.1f} min")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rollouts", type=int, default=8, help="rollouts per task (a group)")
    p.add_argument("--groups-per-step", type=int, default=2)
    p.add_argument("--val-tasks", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--data", default=".tracerl/agents-sdk", help="where runs are kept")
    p.add_argument("--inference", choices=["auto", "vllm", "transformers"], default="auto")
    p.add_argument("--serving", choices=["auto", "merged", "lora"], default="auto")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--checkpoint-every-n-layers", type=int, default=2)
    p.add_argument("--kv-cache-mib", type=int, default=256)
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
