"""A verifiers environment, run by verifiers in its own virtual environment, trained on with tracerl.

    make install-verifiers                                  # .venv-verifiers: verifiers==0.4.0
    .venv/bin/python examples/verifiers_env/train.py --steps 5

verifiers pins ``openai<3`` and ``mcp==2.0.0``, which tracerl's environment cannot share, so the
environment (``arithmetic_env.py``, written with verifiers' own v1 API: taskset, task rewards,
harness) runs in ``.venv-verifiers``: one ``run_rollout.py`` process per rollout, on verifiers'
local subprocess runtime, with its own OpenAI-compatible client.  Each process is pointed at
its rollout's gateway (``tracerl.rollout(...).gateway_env()``), so the model calls verifiers
makes come back to this process as the rollout's sampled turns, with the served token ids;
the environment's score becomes the trajectory's reward and its metrics the trajectory's.
A verifiers process that fails (the endpoint, a timeout) is an ``InfrastructureError``: an
exception in its group, never a trajectory to train on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
from pathlib import Path

import tracerl
from tracerl.errors import InfrastructureError

HERE = Path(__file__).resolve().parent
VERIFIERS_PYTHON = HERE.parents[1] / ".venv-verifiers" / "bin" / "python"
NUM_TASKS = 50


async def rollout(model: tracerl.TrainableModel, task_index: int, *, temperature: float = 1.0, timeout: float = 300) -> tracerl.Trajectory:
    """One rollout of task ``task_index``, run by verifiers; its score is the reward."""
    if not VERIFIERS_PYTHON.exists():
        raise FileNotFoundError(f"{VERIFIERS_PYTHON} is missing: run `make install-verifiers`")
    async with tracerl.rollout(model, task=task_index) as r:
        env = {**os.environ, **r.gateway_env(), "TRACERL_MODEL": model.get_inference_name()}
        argv = [str(VERIFIERS_PYTHON), str(HERE / "run_rollout.py"), "--task-index", str(task_index),
                "--temperature", str(temperature), "--max-tokens", "16", "--timeout", str(timeout / 2)]  # fmt: skip
        process = await asyncio.create_subprocess_exec(*argv, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(process.communicate(), timeout)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise InfrastructureError(f"the verifiers rollout of task {task_index} ran past {timeout:g} s") from None
        if process.returncode != 0:
            reason = (err.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
            raise InfrastructureError(f"the verifiers rollout of task {task_index} failed (exit {process.returncode}): {reason}")
        result = json.loads(out.decode().strip().splitlines()[-1])
    trajectory = r.trajectory
    trajectory.reward = float(result["reward"])
    trajectory.metrics.update({k: float(v) for k, v in result["metrics"].items()})
    return trajectory


async def main(args: argparse.Namespace) -> None:
    model = tracerl.TrainableModel(f"arithmetic-s{args.seed}", "verifiers", "smollm2-135m", base_path=args.data)
    backend = tracerl.LocalBackend(inference=args.inference)
    await model.register(backend)
    try:
        indices = list(range(NUM_TASKS))
        random.Random(args.seed).shuffle(indices)
        for batch in tracerl.iterate_dataset(indices, groups_per_step=args.groups, num_epochs=100, initial_step=await model.get_step(), use_tqdm=False):
            if batch.step >= args.steps:
                break
            groups = await tracerl.gather_trajectory_groups(
                (tracerl.TrajectoryGroup(rollout(model, index) for _ in range(args.rollouts)) for index in batch.items),
                pbar_desc=f"step {batch.step + 1}", max_exceptions=0.25,
            )  # fmt: skip
            result = await backend.train(model, groups, learning_rate=args.lr)
            row = await model.log(groups, split="train", metrics=result.metrics, step=result.step)
            print(f"step {result.step}: reward {row['train/reward']:.3f}, has_number {row['train/has_number']:.2f}", flush=True)
    finally:
        await backend.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--groups", type=int, default=2, help="tasks per step")
    p.add_argument("--rollouts", type=int, default=4, help="rollouts per task")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--inference", choices=["auto", "vllm", "transformers"], default="transformers")
    p.add_argument("--data", default=".tracerl")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
