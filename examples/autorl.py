"""AutoRL: train a model on a task from nothing but its description (ART's AutoRL recipe): generate
inputs, roll out, score each group with RULER, train with GRPO.

    python examples/autorl.py --steps 10 --seed 0
    python examples/autorl.py --judge openai/o4-mini          # any LiteLLM model string as the judge
    python examples/autorl.py --judge-url http://host:8000/v1 --judge-model my-judge

1. **Inputs.** The served model is asked, from :data:`TASK` alone, for inputs one per line (plain
   text, so any server and any model can answer; lines are cleaned, bounded and deduplicated) until
   ``--train-inputs`` + ``--val-inputs`` distinct ones exist.  They are saved in the run folder
   (``inputs.jsonl``), so a resumed run uses the same ones.
2. **Rollouts.** ``TASK`` is the system message, the input the user's; the reply is the trajectory.
3. **Reward.** RULER scores each group of replies relative to each other (``after_each``); the
   judge's scores are what GRPO trains on.  The default judge is the policy itself, because no other
   model exists on this machine.
4. **What is measured.** This task can also be checked in code (:func:`check`: the reply is the
   input in capitals), so the held-out curve is the checked outcome, ``val/exact``, and each training
   group records whether the judge agreed with the check (``judge_agrees``, pairwise; chance 0.5) or
   gave every reply the same score (``judge_tied``).  With SmolLM2-135M as the judge, expect the
   judge to be the limit: ``docs/ruler.md`` measured it at chance.  Replace the judge with a capable
   model and the same recipe trains on the judge's scores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
from pathlib import Path

import gallery  # this folder's shared game loop
import openai
import tracerl
from tracerl.ruler import JudgeEndpoint, RulerJudge

TASK = (
    "You are a text formatter. The user sends one sentence; you reply with the same sentence written "
    "entirely in capital letters. Keep every word and punctuation mark in the same order, add nothing "
    "(no quotes, no greeting, no explanation) and leave nothing out."
)
GENERATE = "Write {k} different sentences a user could send to this system, one per line. No numbering, no explanations."
MAX_GENERATION_CALLS = 400
WORDS = (3, 16)
"""An input's length bounds, in words."""


def clean(line: str) -> str | None:
    """A generated line as an input (numbering, bullets and quotes removed), or None when unusable."""
    line = re.sub(r"^\s*(?:[-*•]|\d+[.)])\s*", "", line).strip().strip('"').strip()
    if not WORDS[0] <= len(line.split()) <= WORDS[1] or not re.search(r"[a-z]", line):
        return None
    return line


async def generate_inputs(model: tracerl.TrainableModel, n: int, *, seed: int, k: int = 8, concurrency: int = 8) -> list[str]:
    """``n`` distinct inputs for :data:`TASK`, asked of ``model`` ``k`` at a time (T=1, seeded; ``concurrency`` calls at once)."""
    client = model.openai_client()
    messages = [{"role": "system", "content": f"Task description:\n{TASK}"}, {"role": "user", "content": GENERATE.format(k=k)}]

    async def ask(call: int) -> str:
        completion = await client.chat.completions.create(
            model=model.get_inference_name(), messages=messages, temperature=1.0, seed=seed * 10_000 + call, max_completion_tokens=160
        )
        return completion.choices[0].message.content or ""

    found: dict[str, str] = {}
    calls = 0
    while len(found) < n:
        if calls >= MAX_GENERATION_CALLS:
            raise RuntimeError(f"the generator wrote {len(found)} usable distinct inputs in {calls} calls; {n} are needed")
        for reply in await asyncio.gather(*(ask(calls + i) for i in range(concurrency))):
            for line in reply.splitlines():
                text = clean(line)
                if text is not None:
                    found.setdefault(text.lower(), text)
        calls += concurrency
    return list(found.values())[:n]


def check(reply: str, text: str) -> bool:
    """The reply is the input in capitals (surrounding spaces and quotes aside)."""
    return reply.strip().strip('"').strip() == text.upper()


class Inputs:
    """The run's inputs: held-out first (``--val-inputs``), then the training ones; generated once
    the policy is served (:meth:`setup`), which also makes the judge."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.texts: list[str] = []
        self.judge: RulerJudge | None = None

    async def setup(self, model: tracerl.TrainableModel) -> None:
        self.judge = judge_of(self.args, model)
        path = Path(model.run_dir.root) / "inputs.jsonl"
        if path.exists():
            self.texts = [json.loads(line)["input"] for line in path.read_text().splitlines()]
        else:
            self.texts = await generate_inputs(model, self.args.val_inputs + self.args.train_inputs, seed=self.args.seed)
            path.write_text("".join(json.dumps({"input": t}) + "\n" for t in self.texts))
        print(f"{len(self.texts)} inputs, e.g. {self.texts[self.args.val_inputs]!r}", flush=True)

    def training(self, seed: int, n: int) -> list[int]:
        """``n`` training items (indices past the held-out ones), drawn with ``seed``."""
        rng = random.Random(seed)
        first = self.args.val_inputs
        return [rng.randrange(first, first + self.args.train_inputs) for _ in range(n)]

    async def score(self, group: tracerl.TrajectoryGroup) -> tracerl.TrajectoryGroup | None:
        """RULER's scores as the group's rewards (None: the judge failed, the group is dropped), with :func:`agreement`."""
        assert self.judge is not None, "setup() makes the judge"
        scored = await self.judge(group)
        return None if scored is None else agreement(scored)


def judge_of(args: argparse.Namespace, model: tracerl.TrainableModel) -> RulerJudge:
    """RULER with ``--judge`` / ``--judge-url``, else the policy itself (its current step)."""
    if args.judge_url:
        target: object = JudgeEndpoint(base_url=args.judge_url, model=args.judge_model, api_key=args.judge_key)
    else:
        target = args.judge or model
    return RulerJudge(target, swallow_exceptions=True, cache=False, extra_litellm_params={"max_tokens": 1100})


def agreement(group: tracerl.TrajectoryGroup) -> tracerl.TrajectoryGroup:
    """Record, on each trajectory, whether the judge tied the group and how often it ordered pairs as the check does."""
    checked = [t.metrics["exact"] for t in group.trajectories]
    judged = [t.reward for t in group.trajectories]
    pairs = [(i, j) for i in range(len(checked)) for j in range(i) if checked[i] != checked[j]]
    agree = sum(1.0 if (checked[i] - checked[j]) * (judged[i] - judged[j]) > 0 else 0.5 if judged[i] == judged[j] else 0.0
                for i, j in pairs)  # fmt: skip
    for t in group.trajectories:
        t.metrics["judge_tied"] = float(len(set(judged)) == 1)
        if pairs:
            t.metrics["judge_agrees"] = agree / len(pairs)
    return group


async def main(args: argparse.Namespace) -> tracerl.TrainableModel:
    inputs = Inputs(args)

    @tracerl.retry(max_attempts=2, exceptions=(openai.APITimeoutError,))
    async def play(model: tracerl.TrainableModel, item: int, *, temperature: float, seed: int | None) -> tracerl.Trajectory:
        text = inputs.texts[item]
        trajectory, reply = await gallery.answer(model, TASK, text, item, temperature=temperature, seed=seed, max_tokens=48)
        exact = check(reply, text)
        trajectory.reward = float(exact)  # training groups get the judge's score instead (RULER keeps this as independent_reward)
        trajectory.metrics.update(exact=float(exact), capitals=float(bool(reply.strip()) and reply.strip() == reply.strip().upper()))
        return trajectory

    return await gallery.train(
        args, "autorl", play, ("exact", "capitals"), "AutoRL (RULER judge): held-out replies exactly in capitals",
        items=inputs.training, held_out=range(args.val_inputs), setup=inputs.setup, after_each=inputs.score,
    )  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = gallery.parser(__doc__, steps=10)
    p.set_defaults(rollouts=4)  # the 135M judge answers a group of 4 in ~15 s; of 8, often not before max_tokens
    p.add_argument("--train-inputs", type=int, default=128)
    p.add_argument("--val-inputs", type=int, default=64)
    p.add_argument("--judge", default=None, help="a LiteLLM model string (default: the policy judges itself)")
    p.add_argument("--judge-url", default=None, help="an OpenAI-compatible base URL serving the judge")
    p.add_argument("--judge-model", default="judge", help="the model name at --judge-url")
    p.add_argument("--judge-key", default=None)
    return p.parse_args(argv)


if __name__ == "__main__":
    gallery.run(main, parse_args())
