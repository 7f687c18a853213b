"""An OpenEnv environment, built with OpenEnv's own classes, trained on with tracerl.

    python examples/openenv_guess.py --steps 10

The environment is a number-guessing game written against ``openenv-core`` (``Environment``,
``Action``, ``Observation``, ``State``), served by OpenEnv's ``create_fastapi_app`` under
uvicorn on loopback (no Docker), and played through OpenEnv's own async client
(``GenericEnvClient``, WebSockets).  Each rollout is one episode: the policy served by tracerl
guesses, the environment answers "higher" or "lower", up to four guesses.  Step rewards are
summed (:func:`tracerl.envs.openenv.openenv_episode`): +1 for the right number, -0.1
per wrong guess, -0.3 for a reply with no number in range.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import re
import uuid
from typing import Any, Optional

from openenv.core import Action, Environment, Observation, State
from openenv.core.env_server import create_fastapi_app

import tracerl
from tracerl.envs.openenv import openenv_episode
from tracerl.net.http_server import BackgroundUvicorn

LOW, HIGH, MAX_GUESSES = 1, 16, 4


class GuessAction(Action):
    guess: int


class GuessObservation(Observation):
    feedback: str = ""
    guesses_left: int = MAX_GUESSES


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    """Guess the secret number; the feedback says higher or lower."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # every WebSocket session gets its own instance

    def __init__(self) -> None:
        super().__init__()
        self._secret, self._state = LOW, State(episode_id=None, step_count=0)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> GuessObservation:
        self._secret = random.Random(seed).randint(LOW, HIGH)
        self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
        return GuessObservation(feedback=f"I am thinking of a number from {LOW} to {HIGH}.", guesses_left=MAX_GUESSES)

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        left = MAX_GUESSES - self._state.step_count
        if not LOW <= action.guess <= HIGH:
            return GuessObservation(feedback=f"That is not a number from {LOW} to {HIGH}.", guesses_left=left, reward=-0.3, done=left <= 0)
        if action.guess == self._secret:
            return GuessObservation(feedback="Correct!", guesses_left=left, reward=1.0, done=True)
        hint = "higher" if action.guess < self._secret else "lower"
        return GuessObservation(feedback=f"No, it is {hint} than {action.guess}.", guesses_left=left, reward=-0.1, done=left <= 0)

    @property
    def state(self) -> State:
        return self._state


class _QuietClientClose(logging.Filter):
    """OpenEnv's server closes a WebSocket the client already closed and uvicorn logs a traceback
    for each finished episode; nothing failed, so those records are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and type(record.exc_info[1]).__name__ == "WebSocketDisconnect")


def serve_environment() -> BackgroundUvicorn:
    """OpenEnv's app for the environment, on a free loopback port (``.port``; ``.stop()`` ends it)."""
    logging.getLogger("uvicorn.error").addFilter(_QuietClientClose())
    app = create_fastapi_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=64)
    server = BackgroundUvicorn(app, host="127.0.0.1", name="openenv-guess")
    server.start()
    return server


SYSTEM = f"We play a guessing game. Each turn, reply with one whole number from {LOW} to {HIGH} and nothing else."


def first_messages(observation: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{observation['feedback']} Your guess?"}]


def act(text: str) -> dict[str, Any]:
    numbers = re.findall(r"-?\d+", text)
    return {"guess": int(numbers[0]) if numbers else LOW - 1}


def observe(result: Any) -> str:
    return f"{result.observation['feedback']} {result.observation['guesses_left']} guesses left. Your guess?"


async def rollout(model: tracerl.TrainableModel, url: str, seed: int, *, temperature: float = 1.0) -> tracerl.Trajectory:
    """One episode through OpenEnv's client; ``seed`` picks the secret number."""
    from openenv.core import GenericEnvClient

    async with GenericEnvClient(base_url=url, message_timeout_s=30) as env:
        trajectory = await openenv_episode(
            model, env, first_messages=first_messages, act=act, observe=observe, max_turns=MAX_GUESSES,
            reset_kwargs={"seed": seed}, completion_kwargs={"max_tokens": 6, "temperature": temperature}, task=seed,
        )  # fmt: skip
    trajectory.metrics["solved"] = float(1.0 in trajectory.metadata["env_step_rewards"])
    return trajectory


async def main(args: argparse.Namespace) -> None:
    server = serve_environment()
    url = f"http://127.0.0.1:{server.port}"
    model = tracerl.TrainableModel(f"guess-s{args.seed}", "openenv", "smollm2-135m", base_path=args.data)
    backend = tracerl.LocalBackend(inference=args.inference)
    await model.register(backend)
    try:
        rng = random.Random(args.seed)
        for batch in tracerl.iterate_dataset([rng.randrange(10**6) for _ in range(400)], groups_per_step=args.groups, num_epochs=1, initial_step=await model.get_step(), use_tqdm=False):
            if batch.step >= args.steps:
                break
            groups = await tracerl.gather_trajectory_groups(
                (tracerl.TrajectoryGroup(rollout(model, url, seed) for _ in range(args.rollouts)) for seed in batch.items),
                pbar_desc=f"step {batch.step + 1}", max_exceptions=0.25,
            )  # fmt: skip
            result = await backend.train(model, groups, learning_rate=args.lr)
            row = await model.log(groups, split="train", metrics=result.metrics, step=result.step)
            print(f"step {result.step}: reward {row['train/reward']:.3f}, solved {row['train/solved']:.2f}, guesses {row['train/env_steps']:.2f}", flush=True)
    finally:
        await backend.close()
        server.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--groups", type=int, default=2, help="secret numbers per step")
    p.add_argument("--rollouts", type=int, default=6, help="episodes per secret number")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--inference", choices=["auto", "vllm", "transformers"], default="transformers")
    p.add_argument("--data", default=".tracerl")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
