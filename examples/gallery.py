"""The gallery's shared loop: a game (or a one-turn task) played by ``play(model, item, temperature=, seed=)``, trained with GRPO.

Each step plays ``--groups`` items ``--rollouts`` times each at T=1 (a group per item), trains one
step and logs it; every ``--eval-every`` steps the held-out items (fixed seeds, never trained on)
are played greedily.  A task may make step 1 an SFT warm-up (:func:`sft_warmup`).  The backend is
the demo's laptop-sized one (vLLM serving the merged policy when installed).  Built on it:
``examples/tictactoe.py``, ``game_2048.py``, ``text_to_sql.py``, ``temporal_clue.py``, ``summarizer.py``.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Awaitable, Callable, Container, Sequence

import demo  # this folder's demo: its laptop-sized backend and step helpers
import tracerl

Play = Callable[..., Awaitable[tracerl.Trajectory]]
AfterEach = Callable[[tracerl.TrajectoryGroup], Awaitable[tracerl.TrajectoryGroup | None]]
Warmup = Callable[[tracerl.TrainableModel, tracerl.Backend], Awaitable[str]]
"""A first training step before GRPO (:func:`sft_warmup`); returns a line to print."""
HELD_OUT_FROM = 10_000
"""Held-out items are seeds from here on (``--val-games`` of them); training items are never among the next 100."""


def items_outside(seed: int, n: int, held_out: Container[int] = range(HELD_OUT_FROM, HELD_OUT_FROM + 100)) -> list[int]:
    """``n`` random item seeds (drawn with ``seed``), none of them in ``held_out``."""
    rng = random.Random(seed)
    items: list[int] = []
    while len(items) < n:
        item = rng.randrange(10**6)
        if item not in held_out:
            items.append(item)
    return items


Worked = Callable[[int], "tuple[str, str] | list[tuple[str, str]]"]
"""An item's worked example: (prompt, reference answer), or a multi-turn game's (prompt, answer) turns."""


def sft_warmup(
    args: argparse.Namespace, system: str, worked: Worked, what: str, items: Callable[[int, int], Sequence[int]] = items_outside
) -> Warmup | None:
    """Step 1 as SFT on ``--sft-examples`` training items (``items(seed, n)``, drawn apart from the
    GRPO steps' items): ``worked(item)`` gives the prompt and the reference answer (or a game's turns),
    trained as one conversation after ``system`` (``--sft-lr``, one epoch, cosine, batches of 8).
    None (no warm-up) when ``--sft-examples`` is 0."""
    if not args.sft_examples:
        return None
    chosen = items(args.seed + 7_919, args.sft_examples)

    def conversation(item: int) -> list[dict[str, str]]:
        turns = worked(item)
        messages = [{"role": "system", "content": system}]
        for prompt, answer in [turns] if isinstance(turns, tuple) else turns:
            messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        return messages

    async def warmup(model: tracerl.TrainableModel, backend: tracerl.Backend) -> str:
        conversations = [conversation(item) for item in chosen]
        examples = [tracerl.Trajectory(messages_and_choices=messages) for messages in conversations]
        config = tracerl.SFTConfig(learning_rate=args.sft_lr, batch_size=8, epochs=1, schedule_type="cosine", warmup_ratio=0.1,
                                   seed=args.seed, show_progress=False)  # fmt: skip
        result = await backend.train_sft(model, examples, config)
        return f"step {result.step}: SFT on {len(examples)} {what}, loss {result.metrics['loss']:.3f}"

    return warmup


async def move(
    model: tracerl.TrainableModel, trajectory: tracerl.Trajectory, board: str, *, temperature: float, seed: int | None, max_tokens: int = 6
) -> str:
    """One move, as ART's examples write a turn: the board appended, ``trajectory.messages()`` sent, the
    SDK's ``Choice`` appended as it comes (tracerl's servers return its token ids and logprobs unasked);
    the reply's text.  ``seed`` is offset by the number of moves made before this one."""
    made = len(trajectory.sampled_turns())
    trajectory.messages_and_choices.append({"role": "user", "content": board})
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=trajectory.messages(), max_completion_tokens=max_tokens,
        temperature=temperature, seed=None if seed is None else seed + made,
    )  # fmt: skip
    choice = completion.choices[0]
    trajectory.messages_and_choices.append(choice)
    return choice.message.content or ""


async def answer(
    model: tracerl.TrainableModel, system: str, prompt: str, item: int, *, temperature: float, seed: int | None, max_tokens: int
) -> tuple[tracerl.Trajectory, str]:
    """A one-turn task: a trajectory (``system``, ``prompt``, the sampled reply; ``metadata["item"]``) and the reply's text."""
    trajectory = tracerl.Trajectory(messages_and_choices=[{"role": "system", "content": system}], reward=0, metadata={"item": item})
    return trajectory, await move(model, trajectory, prompt, temperature=temperature, seed=seed, max_tokens=max_tokens)


async def evaluate(model: tracerl.TrainableModel, play: Play, games: Sequence[int]) -> list[tracerl.TrajectoryGroup]:
    """Greedy held-out games (one each)."""
    played = await tracerl.gather_trajectories(
        (play(model, g, temperature=0.0, seed=0) for g in games), pbar_desc="held-out", max_exceptions=len(games)
    )
    return [tracerl.TrajectoryGroup([t]) for t in played]


async def train(
    args: argparse.Namespace, name: str, play: Play, shown: Sequence[str], title: str, *, warmup: Warmup | None = None,
    items: Callable[[int, int], Sequence[int]] | None = None, held_out: Sequence[int] | None = None,
    setup: Callable[[tracerl.TrainableModel], Awaitable[None]] | None = None, after_each: AfterEach | None = None,
) -> tracerl.TrainableModel:
    """Train ``{name}-s{seed}`` for ``args.steps`` steps (resuming a run that was stopped); ``shown``:
    the metrics printed each step and drawn, with the reward, in the run's ``reward_curve.png``.
    ``warmup`` (if any) is step 1, evaluated like the others; GRPO makes the steps after it.
    ``items(seed, n)``: the training games (default :func:`items_outside`); ``held_out``: the held-out
    ones (default: ``--val-games`` seeds from :data:`HELD_OUT_FROM`).  ``setup(model)`` runs once the
    policy is served, before anything is played; ``after_each`` scores each training group (RULER)."""
    model = tracerl.TrainableModel(f"{name}-s{args.seed}", name, "smollm2-135m", base_path=args.data,
                                   lora_config={"r": 16, "alpha": 32})  # fmt: skip
    backend_args = argparse.Namespace(inference=args.inference, serving="auto", gradient_checkpointing=True,
                                      checkpoint_every_n_layers=2, kv_cache_mib=256)  # fmt: skip
    backend = demo.make_backend(backend_args)
    started = time.monotonic()
    await model.register(backend)
    held_out = held_out or range(HELD_OUT_FROM, HELD_OUT_FROM + args.val_games)

    def line(row: dict, split: str) -> str:
        return ", ".join(f"{key} {row[f'{split}/{key}']:.2f}" for key in ("reward", *shown))

    try:
        if setup is not None:
            await setup(model)
        step = await model.get_step()
        if not demo.already_logged(model, "val", step):
            val = await model.log(await evaluate(model, play, held_out), split="val", step=step)
            print(f"held-out at step {step}: {line(val, 'val')}", flush=True)
        if warmup is not None and step == 0:
            print(await warmup(model, backend), flush=True)
            step = await model.get_step()
            val = await model.log(await evaluate(model, play, held_out), split="val", step=step)
            print(f"held-out at step {step} (after the warm-up): {line(val, 'val')}", flush=True)
        games = (items or items_outside)(args.seed, 4000)
        for batch in tracerl.iterate_dataset(games, groups_per_step=args.groups, num_epochs=1, initial_step=step, use_tqdm=False):
            if batch.step >= args.steps:
                break
            groups = await tracerl.gather_trajectory_groups(
                (tracerl.TrajectoryGroup(play(model, game, temperature=1.0, seed=game * 31 + i) for i in range(args.rollouts))
                 for game in batch.items),
                pbar_desc=f"step {batch.step + 1}/{args.steps}", max_exceptions=0.25, after_each=after_each,
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
    return parser(doc, steps=steps, val_games=val_games).parse_args(argv)


def parser(doc: str | None, *, steps: int, val_games: int = 64, sft_examples: int | None = None) -> argparse.ArgumentParser:
    """The games' common flags, with ``--sft-examples`` (default ``sft_examples``) and ``--sft-lr``
    for a task whose step 1 is SFT; an example adds its own."""
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
    if sft_examples is not None:
        p.add_argument("--sft-examples", type=int, default=sft_examples, help="worked examples SFT trains on (step 1); 0: GRPO only")
        p.add_argument("--sft-lr", type=float, default=5e-4)
    return p


def run(main: Callable[[argparse.Namespace], Awaitable[object]], args: argparse.Namespace) -> None:
    """``python examples/<game>.py``: under jemalloc when installed (as the demo: ~0.9 GB less peak per step)."""
    import asyncio

    from tracerl.train.allocator import relaunch_with_jemalloc

    relaunch_with_jemalloc()
    asyncio.run(main(args))
