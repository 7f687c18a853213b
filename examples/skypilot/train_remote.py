"""The laptop side of ``tracerl-serve.yaml``: rollouts here, training and serving on the cloud GPU.

The agent code is the ART-style loop of the README, unchanged except for the backend:
``RemoteBackend(url)`` instead of ``LocalBackend()``.  ``model.openai_client()`` then talks
to the server's ``/v1`` proxy (token included), and each ``backend.train`` runs the GRPO
step on the GPU and hot-loads ``name@step`` there before the next rollouts.

    export TRACERL_SERVE_TOKEN=...                      # the token the cluster was launched with
    python examples/skypilot/train_remote.py --cluster tracerl          # asks SkyPilot for the endpoint
    python examples/skypilot/train_remote.py --url http://127.0.0.1:8000  # an SSH tunnel, or any serve

Only ``tracerl`` itself (no torch) is needed on the laptop; ``--cluster`` also needs the
``sky`` command (``pip install skypilot``) with the cluster's cloud credentials.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess

import tracerl


def cluster_url(cluster: str, port: int = 8000) -> str:
    """``http://host:port`` of ``cluster``'s exposed ``port``, as ``sky status --endpoint`` prints it."""
    out = subprocess.run(["sky", "status", cluster, "--endpoint", str(port)], capture_output=True, text=True, check=True)
    endpoint = out.stdout.strip().splitlines()[-1].strip()
    return endpoint if endpoint.startswith(("http://", "https://")) else f"http://{endpoint}"


def addition_tasks(count: int, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    tasks = []
    for _ in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        tasks.append({"question": f"What is {a} + {b}? Answer with the number only.", "answer": str(a + b)})
    return tasks


async def rollout(model: tracerl.TrainableModel, task: dict[str, str], max_tokens: int) -> tracerl.Trajectory:
    messages = [{"role": "user", "content": task["question"]}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=max_tokens,
        logprobs=True, extra_body={"return_token_ids": True})
    choice = tracerl.Choice.from_openai(completion.choices[0], completion)  # sampled: trainable
    reward = float(task["answer"] in (choice.message["content"] or ""))
    return tracerl.Trajectory(messages_and_choices=[*messages, choice], reward=reward)


async def train(url: str, *, steps: int, group_size: int = 8, groups_per_step: int = 2, max_tokens: int = 16,
                base_model: str = "smollm2-135m", token: str | None = None, name: str = "adder",
                project: str = "skypilot-demo") -> list[tracerl.TrainResult]:
    """Train ``steps`` GRPO steps through ``tracerl serve`` at ``url``; return each step's result."""
    backend = tracerl.RemoteBackend(url, token=token)  # token: $TRACERL_SERVE_TOKEN when None
    model = tracerl.TrainableModel(name, project, base_model=base_model)
    results = []
    try:
        await model.register(backend)
        start = await model.get_step()
        for batch in tracerl.iterate_dataset(addition_tasks(steps * groups_per_step), groups_per_step=groups_per_step,
                                             initial_step=start, use_tqdm=False):
            groups = await tracerl.gather_trajectory_groups(
                (tracerl.TrajectoryGroup(rollout(model, task, max_tokens) for _ in range(group_size)) for task in batch.items),
                pbar_desc=None)
            result = await backend.train(model, groups, learning_rate=1e-5)
            await model.log(groups, split="train", metrics=result.metrics, step=result.step)
            print(f"step {result.step}: reward {groups.metrics['reward']:.3f}", flush=True)
            results.append(result)
    finally:
        await backend.close()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--cluster", help="SkyPilot cluster name (from `sky launch -c NAME ...`)")
    where.add_argument("--url", help="tracerl serve's URL, e.g. http://127.0.0.1:8000 through an SSH tunnel")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--base-model", default="smollm2-135m")
    args = p.parse_args()
    url = args.url or cluster_url(args.cluster, args.port)
    print(f"tracerl serve at {url}", flush=True)
    asyncio.run(train(url, steps=args.steps, base_model=args.base_model))


if __name__ == "__main__":
    main()
