"""The gallery's shared loop: a game played by ``play(model, game, temperature=, seed=)``, trained with GRPO.

Each step plays ``--groups`` games ``--rollouts`` times each at T=1 (a group per game), trains one
step and logs it; every ``--eval-every`` steps the held-out games (fixed seeds, never trained on)
are played greedily.  The backend is the demo's laptop-sized one (vLLM serving the merged policy
when installed).  ``examples/tictactoe.py`` and ``examples/game_2048.py`` are built on it.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Awaitable, Callable, Sequence

import demo  # this folder's demo: its laptop-sized backend and step helpers
import tracerl

Play = Callable[..., Awaitable[tracerl.Trajectory]]


async def move(model: tracerl.TrainableModel, trajectory: tracerl.Trajectory, board: str, *, temperature: float, seed: int | None) -> str:
    """One move, as ART's examples write a turn: the board appended, ``trajectory.messages()`` sent, the
    SDK's ``Choice`` appended as it comes (tracerl's servers return its token ids and logprobs unasked);
    the reply's text.  ``seed`` is offset by the number of moves made before this one."""
    made = len(trajectory.sampled_turns())
    trajectory.messages_and_choices.append({"role": "user", "content": board})
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=trajectory.messages(), max_completion_tokens=6,
        temperature=temperature, seed=None if seed is None else seed + made,
    )  # fmt: skip
    choice = completion.choices[0]
    trajectory.messages_and_choices.append(choice)
    return choice.message.content or ""


async def evaluate(model: tracerl.TrainableModel, play: Play, games: Sequence[int]) -> list[tracerl.TrajectoryGroup]:
    """Greedy held-out games (one each)."""
    played = await tracerl.gather_trajectories(
        (play(model, g, temperature=0.0, seed=0) for g in games), pbar_desc="held-out", max_exceptions=len(games)
    )
    return [tracerl.TrajectoryGroup([t]) for t in played]


async def train(args: argparse.Namespace, name: str, play: Play, shown: Sequence[str], title: str) -> tracerl.TrainableModel:
    """Train ``{name}-s{seed}`` for ``args.steps`` steps (resuming a run that was stopped); ``shown``:
    the metrics printed each step and drawn, with the reward, in the run's ``reward_curve.png``."""
    model = tracerl.TrainableModel(f"{name}-s{args.seed}", name, "smollm2-135m", base_path=args.data,
                                   lora_config={"r": 16, "alpha": 32})  # fmt: skip
    backend_args = argparse.Namespace(inference=args.inference, serving="auto", gradient_checkpointing=True,
                                      checkpoint_every_n_layers=2, kv_cache_mib=256)  # fmt: skip
    backend = demo.make_backend(backend_args)
    started = time.monotonic()
    await model.register(backend)
    held_out = range(10_000, 10_000 + args.val_games)

    def line(row: dict, split: str) -> str:
        return ", ".join(f"{key} {row[f'{split}/{key}']:.2f}" for key in ("reward", *shown))

    try:
        step = await model.get_step()
        if not demo.already_logged(model, "val", step):
            await model.log(await evaluate(model, play, held_out), split="val", step=step)
        rng = random.Random(args.seed)
        games = [rng.randrange(10**6) for _ in range(4000)]
        for batch in tracerl.iterate_dataset(games, groups_per_step=args.groups, num_epochs=1, initial_step=step, use_tqdm=False):
            if batch.step >= args.steps:
                break
            groups = await tracerl.gather_trajectory_groups(
                (tracerl.TrajectoryGroup(play(model, game, temperature=1.0, seed=game * 31 + i) for i in range(args.rollouts))
                 for game in batch.items),
                pbar_desc=f"step {batch.step + 1}/{args.steps}", max_exceptions=0.25,
            )  # fmt: skip
            result = await backend.train(model, groups, learning_rate=args.lr)
            row = await model.log(groups, split="train", metrics=result.metrics, step=result.step)
            elapsed = (time.monotonic() - started) / 60
            print(f"step {result.step}: {line(row, 'train')}  {demo.step_split(result.metrics)}  {elapsed:.1f} min", flush=True)
            if result.step % args.eval_every == 0 or result.step == args.steps:
                val = await model.log(await evaluate(model, play, held_out), split="val", step=result.step)
                print(f"held-out at step {result.step}: {line(val, 'val')}", flush=True)
    finally:
        await backend.close()
    from tracerl.runs.plots import plot_history

    curve = ["train/reward", "val/reward", *(f"val/{key}" for key in shown)]
    out = plot_history(model.history(), curve, model.run_dir.root / "reward_curve.png", title=f"{title}, seed {args.seed}")
    print(f"curve: {out}   history: {model.run_dir.history_path}")
    return model


def parse_args(doc: str | None, argv: list[str] | None, *, steps: int, val_games: int = 64) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--groups", type=int, default=2, help="games per step (each a group)")
    p.add_argument("--rollouts", type=int, default=8, help="plays of each game")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--val-games", type=int, default=val_games, help="held-out games (fixed seeds)")
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--inference", choices=["auto", "vllm", "transformers"], default="auto")
    p.add_argument("--data", default=".tracerl")
    return p.parse_args(argv)


def run(main: Callable[[argparse.Namespace], Awaitable[object]], args: argparse.Namespace) -> None:
    """``python examples/<game>.py``: under jemalloc when installed (as the demo: ~0.9 GB less peak per step)."""
    import asyncio

    from tracerl.train.allocator import relaunch_with_jemalloc

    relaunch_with_jemalloc()
    asyncio.run(main(args))
