"""Train agents written in TypeScript: a Python driver runs each rollout's agent as a Node process.

    make install-ts                                     # once: the npm packages (Node >= 20)
    .venv/bin/python examples/typescript/train.py [--agent langgraph|openai] [--steps 3] [--group 4]

Each rollout hands its agent the rollout's gateway (``r.gateway_env()``: ``OPENAI_BASE_URL`` and
``OPENAI_API_KEY``): every model call the agent makes, in whatever process or language, joins the
rollout's trajectory with the token ids the engine sampled.  The reward checks the sum in the
agent's answer; GRPO trains a LoRA on the embedded SmolLM2-135M, on CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
from pathlib import Path

import tracerl

HERE = Path(__file__).resolve().parent
AGENTS = {"langgraph": "langgraph_agent.ts", "openai": "openai_agent.ts"}
TIMEOUT_S = 600


async def run_agent(r: tracerl.Rollout, model: tracerl.Model, agent: str, task: str) -> str:
    """Run one TypeScript agent on ``task`` through ``r``'s gateway; its final answer."""
    tsx = HERE / "node_modules" / ".bin" / "tsx"
    if not tsx.exists():
        raise FileNotFoundError(f"{tsx} is missing: run `make install-ts` first")
    env = {**os.environ, **r.gateway_env(), "TRACERL_MODEL": model.get_inference_name()}
    process = await asyncio.create_subprocess_exec(
        str(tsx), str(HERE / AGENTS[agent]), task, cwd=HERE, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(process.communicate(), TIMEOUT_S)
    except TimeoutError:
        process.kill()
        raise
    if process.returncode != 0:
        raise RuntimeError(f"the {agent} agent failed ({process.returncode}): {err.decode()[-2000:]}")
    return json.loads(out.decode().strip().splitlines()[-1])["answer"]


async def rollout(model: tracerl.Model, agent: str, a: int, b: int) -> tracerl.Trajectory:
    async with tracerl.rollout(model, task=f"{a}+{b}") as r:
        answer = await run_agent(r, model, agent, f"Add {a} and {b}.")
        r.reward = float(str(a + b) in re.findall(r"-?\d+", answer))
    return r.trajectory


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agent", choices=sorted(AGENTS), default="langgraph")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--group", type=int, default=4, help="rollouts per task")
    parser.add_argument("--tasks", type=int, default=2, help="tasks (groups) per step")
    args = parser.parse_args()
    rng = random.Random(0)
    backend = tracerl.LocalBackend(inference="transformers")
    model = tracerl.TrainableModel(f"ts-{args.agent}", "typescript", "smollm2-135m")
    await model.register(backend)
    try:
        for step in range(args.steps):
            tasks = [(rng.randint(1, 50), rng.randint(1, 50)) for _ in range(args.tasks)]
            groups = await tracerl.gather_trajectory_groups(
                tracerl.TrajectoryGroup(rollout(model, args.agent, a, b) for _ in range(args.group)) for a, b in tasks
            )
            rewards = [t.reward for g in groups for t in g.trajectories]
            result = await backend.train(model, groups, learning_rate=1e-5)
            print(f"step {step}: mean reward {sum(rewards) / len(rewards):.2f} -> checkpoint {result.step}")
    finally:
        await backend.close()


if __name__ == "__main__":
    asyncio.run(main())
