"""Warm-start the calculator agent without worked examples: SFT then GRPO, against context distillation.

The demo's SmolLM2-135M only uses its ``add`` tool when worked examples sit in every prompt
(``examples/demo.py``).  Here the *student* never sees one; the held-out reward is measured
greedily without worked examples at every stage:

1. **base**: the student as it starts (it almost never writes a tool call);
2. **SFT set by rejection sampling**: the base model *with* three worked examples attempts
   ``--sft-tasks`` training tasks ``--sft-samples`` times at T=1; attempts with the full reward
   (``filter_by_reward(groups, --min-reward)``, 1.0 by default) become SFT examples with the worked examples removed,
   so the student learns the behaviour, not the crutch;
3. **after SFT** (``backend.train_sft``, one checkpoint step), then **after RL**
   (``--rl-steps`` GRPO steps of the student, no worked examples);
4. **context distillation on the same budget** (a second model from the base): the student
   samples without worked examples, the teacher is the same base model *with* them
   (``tracerl.served_teacher(model, context=tracerl.with_worked_examples(...))``), and the
   per-token reverse KL is the only training signal (rewards zeroed in the training copy) for
   as many rollouts as the SFT→RL arm sampled (rejection sampling included).

Results go to ``--out`` (JSON, one file per seed) and a plot of held-out reward against
rollouts sampled, every seed found next to it, to ``--plot``.

    python examples/sft_then_rl.py --seed 0 --inference transformers
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import tracerl
from demo import ADD_TOOL, SYSTEM, make_tasks, score_call, worked_examples

FEW_SHOT = [(12, 30), (205, 118), (431, 287)]
"""Three worked examples: the base model then writes a correct call in about half its T=1 samples."""


def view(task: dict[str, int], examples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, *examples, {"role": "user", "content": f"What is {task['a']} + {task['b']}?"}]


async def rollout(
    model: tracerl.TrainableModel, task: dict[str, int], *, examples: list[dict[str, Any]], temperature: float, seed: int | None
) -> tracerl.Trajectory:
    """The demo's two-turn attempt (tool call, tool result, answer), shown ``examples`` first."""
    client = model.openai_client()
    trajectory = tracerl.Trajectory(messages_and_choices=view(task, examples), tools=[ADD_TOOL], metadata=dict(task))

    async def turn(max_tokens: int) -> tracerl.Choice:
        completion = await client.chat.completions.create(
            model=model.get_inference_name(), messages=trajectory.messages(), tools=[ADD_TOOL], max_tokens=max_tokens,
            temperature=temperature, logprobs=True, seed=seed, extra_body={"return_token_ids": True},
        )
        choice = tracerl.Choice.from_openai(completion.choices[0], completion)
        trajectory.messages_and_choices.append(choice)
        return choice

    first = await turn(40)
    reward, call_ok = score_call(first, task)
    if call_ok:
        result = str(task["a"] + task["b"])
        trajectory.messages_and_choices.append({"role": "tool", "tool_call_id": first.message["tool_calls"][0]["id"], "content": result})
        answer = await turn(12)
        reward += 0.2 if result in (answer.message.get("content") or "") else 0.0
    trajectory.reward = reward
    trajectory.metrics["tool_call_ok"] = float(call_ok)
    return trajectory


async def held_out(model: tracerl.TrainableModel, tasks: list[dict[str, int]], examples: list[dict[str, Any]] | None = None) -> float:
    """Mean greedy reward on ``tasks`` (no worked examples unless given)."""
    runs = await tracerl.gather_trajectories(
        (rollout(model, t, examples=examples or [], temperature=0.0, seed=0) for t in tasks), pbar_desc="held-out", max_exceptions=0
    )
    return sum(t.reward for t in runs) / len(runs)


async def sample_groups(model: tracerl.TrainableModel, tasks: list[dict[str, int]], n: int, *, examples: list[dict[str, Any]], seed: int, desc: str) -> list[tracerl.TrajectoryGroup]:
    return await tracerl.gather_trajectory_groups(
        (
            tracerl.TrajectoryGroup(rollout(model, task, examples=examples, temperature=1.0, seed=seed * 1_000_003 + g * 31 + i) for i in range(n))
            for g, task in enumerate(tasks)
        ),
        pbar_desc=desc,
        max_exceptions=0,
    )


def student_example(trajectory: tracerl.Trajectory, n_examples: int) -> tracerl.Trajectory:
    """A few-shot attempt as the student would have made it: worked examples removed, turns as plain messages.

    Plain assistant messages are trained by ``train_sft`` (rendered by the chat template, tools included).
    """
    messages = trajectory.messages()
    student = [messages[0], *messages[1 + n_examples :]]
    return tracerl.Trajectory(messages_and_choices=student, tools=[ADD_TOOL], reward=trajectory.reward)


def distill_only(groups: list[tracerl.TrajectoryGroup]) -> list[tracerl.TrajectoryGroup]:
    """Training copies whose rewards are equal: the teacher's token advantages are the only signal."""
    return [
        tracerl.TrajectoryGroup(
            [t.model_copy(update={"reward": 0.0, "metrics": {**t.metrics, "task_reward": t.reward}}) for t in g.trajectories]
        )
        for g in groups
    ]


async def sft_then_rl(args: argparse.Namespace, backend: tracerl.LocalBackend, val: list[dict[str, int]], train: list[dict[str, int]]) -> dict[str, Any]:
    model = tracerl.TrainableModel(f"sft-rl-s{args.seed}", "sft_then_rl", args.base_model, base_path=args.data, lora_config={"r": 16, "alpha": 32})
    await model.register(backend)
    check_fresh(model)
    started = time.monotonic()
    few_shot = worked_examples(FEW_SHOT)
    points = [(0, await held_out(model, val))]
    teacher_reward = await held_out(model, val, few_shot)
    print(f"[sft->rl] base: held-out {points[0][1]:.3f} without worked examples, {teacher_reward:.3f} with them", flush=True)

    sft_tasks = train[: args.sft_tasks]
    groups = await sample_groups(model, sft_tasks, args.sft_samples, examples=few_shot, seed=args.seed, desc="rejection sampling")
    kept = tracerl.filter_by_reward(groups, args.min_reward)
    rollouts = len(sft_tasks) * args.sft_samples
    print(f"[sft->rl] rejection sampling: kept {len(kept)}/{rollouts} few-shot attempts with reward >= {args.min_reward}", flush=True)
    if not kept:
        raise SystemExit(f"no few-shot attempt reached reward {args.min_reward}: raise --sft-samples or --sft-tasks")
    examples = [student_example(t, len(few_shot)) for t in kept]
    config = tracerl.SFTConfig(
        learning_rate=args.sft_lr, batch_size=4, epochs=args.sft_epochs, schedule_type="cosine", warmup_ratio=0.1, show_progress=False
    )
    sft = await backend.train_sft(model, examples, config)
    points.append((rollouts, await held_out(model, val)))
    print(f"[sft->rl] after SFT (step {sft.step}, loss {sft.metrics['loss']:.3f}): held-out {points[-1][1]:.3f}", flush=True)

    rl_tasks = train[args.sft_tasks :]
    for step in range(args.rl_steps):
        batch = rl_tasks[step * args.groups_per_step : (step + 1) * args.groups_per_step]
        groups = await sample_groups(model, batch, args.rollouts, examples=[], seed=args.seed + 100 + step, desc=f"RL step {step + 1}")
        result = await backend.train(model, groups, learning_rate=args.rl_lr)
        await model.log(groups, split="train", metrics=result.metrics, step=result.step)
        rollouts += len(batch) * args.rollouts
    points.append((rollouts, await held_out(model, val)))
    print(f"[sft->rl] after {args.rl_steps} GRPO steps: held-out {points[-1][1]:.3f}", flush=True)
    return {"points": points, "sft_examples": len(kept), "teacher_reward": teacher_reward, "seconds": time.monotonic() - started}


async def distill(args: argparse.Namespace, backend: tracerl.LocalBackend, val: list[dict[str, int]], train: list[dict[str, int]], budget: int) -> dict[str, Any]:
    model = tracerl.TrainableModel(f"distill-s{args.seed}", "sft_then_rl", args.base_model, base_path=args.data, lora_config={"r": 16, "alpha": 32})
    await model.register(backend)
    check_fresh(model)
    started = time.monotonic()
    teacher = tracerl.served_teacher(model, context=tracerl.with_worked_examples(worked_examples(FEW_SHOT)), tokenizer=backend.tokenizer(model))
    points = [(0, await held_out(model, val))]
    per_step = args.groups_per_step * args.rollouts
    steps = max(1, round(budget / per_step))  # the nearest whole number of steps to the other arm's rollouts
    kls = []
    for step in range(steps):
        batch = [train[(step * args.groups_per_step + g) % len(train)] for g in range(args.groups_per_step)]
        groups = await sample_groups(model, batch, args.rollouts, examples=[], seed=args.seed + 500 + step, desc=f"distill step {step + 1}")
        scored = await tracerl.add_teacher_advantages(groups, teacher, kl_coef=1.0)
        kls.append(scored["teacher_reverse_kl"])
        result = await backend.train(model, distill_only(groups), learning_rate=args.distill_lr)
        await model.log(groups, split="train", metrics={**result.metrics, **scored}, step=result.step)
        print(f"[distill] step {result.step}: reverse KL to the teacher {scored['teacher_reverse_kl']:.3f}", flush=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == steps:
            points.append(((step + 1) * per_step, await held_out(model, val)))
            print(f"[distill] after {step + 1} steps ({points[-1][0]} rollouts): held-out {points[-1][1]:.3f}", flush=True)
    return {"points": points, "reverse_kl": kls, "seconds": time.monotonic() - started}


def check_fresh(model: tracerl.TrainableModel) -> None:
    if model.run_dir.latest_step():
        raise SystemExit(f"{model.run_dir.root} already holds a run: delete it or pass another --data")


async def main(args: argparse.Namespace) -> None:
    val = make_tasks(10_000 + args.seed, args.val_tasks)
    train = make_tasks(args.seed, args.sft_tasks + args.rl_steps * args.groups_per_step + 64)
    backend = tracerl.LocalBackend(inference=args.inference)
    try:
        first = await sft_then_rl(args, backend, val, train)
        second = await distill(args, backend, val, train, budget=first["points"][-1][0])
    finally:
        await backend.close()
    result = {"seed": args.seed, "settings": vars(args), "sft_then_rl": first, "distill": second}
    out = Path(args.out.format(data=args.data, seed=args.seed))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps({k: result[k] for k in ("sft_then_rl", "distill")}, default=str))
    print(f"results: {out}   plot: {plot(out.parent, Path(args.plot.format(data=args.data)))}")


def plot(folder: Path, target: Path) -> Path:
    """Held-out reward against rollouts sampled, for every ``sft_then_rl_s*.json`` in ``folder``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for path in sorted(folder.glob("sft_then_rl_s*.json")):
        data = json.loads(path.read_text())
        seed = data["seed"]
        ax.plot(*zip(*data["sft_then_rl"]["points"]), marker="o", color="tab:blue", alpha=0.8, label=f"SFT → GRPO, seed {seed}")
        ax.plot(*zip(*data["distill"]["points"]), marker="s", color="tab:orange", alpha=0.8, label=f"context distillation, seed {seed}")
        ax.axhline(data["sft_then_rl"]["teacher_reward"], color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("training rollouts sampled (rejection sampling included)")
    ax.set_ylabel("held-out reward, no worked examples (greedy)")
    ax.set_title("SmolLM2-135M calculator agent, no worked examples (dotted: base with 3)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=120)
    plt.close(fig)
    return target


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inference", choices=["auto", "vllm", "transformers"], default="auto")
    p.add_argument("--base-model", default="smollm2-135m")
    p.add_argument("--val-tasks", type=int, default=16)
    p.add_argument("--sft-tasks", type=int, default=24, help="training tasks the few-shot base model attempts")
    p.add_argument("--sft-samples", type=int, default=2, help="few-shot attempts per task")
    p.add_argument("--min-reward", type=float, default=1.0, help="rejection sampling threshold (1.0: call and answer right)")
    p.add_argument("--sft-epochs", type=int, default=2)
    p.add_argument("--sft-lr", type=float, default=1e-3)
    p.add_argument("--rl-steps", type=int, default=3)
    p.add_argument("--groups-per-step", type=int, default=2)
    p.add_argument("--rollouts", type=int, default=8, help="rollouts per group")
    p.add_argument("--rl-lr", type=float, default=1e-4)
    p.add_argument("--distill-lr", type=float, default=1e-4)
    p.add_argument("--eval-every", type=int, default=3, help="distillation steps between held-out evaluations")
    p.add_argument("--data", default=".tracerl")
    p.add_argument("--out", default="{data}/sft_then_rl_s{seed}.json", help="results JSON ({data} and {seed} are replaced)")
    p.add_argument("--plot", default="{data}/sft_then_rl.png", help="held-out curves of every results JSON beside --out ({data} is replaced)")
    return p.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
