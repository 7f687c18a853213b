"""Temporal Clue-style deduction puzzles, generated and checked in code: who had no alibi at the hour
of the crime?  SFT on worked solutions, then GRPO (ART's gallery trains Temporal Clue with GRPO).

    python examples/temporal_clue.py --steps 13 --seed 0

A puzzle names three suspects, the room and the hour of the crime, and six clues, each "At <hour>,
<suspect> was in <room>": every suspect appears in exactly two clues.  The two innocents were each
somewhere else at the hour of the crime; the culprit's two clues are both at other hours, and a red
herring may put anyone in the crime's room at another hour.  So counting names or spotting the room
does not solve it: the hour must be matched.  The clues read as a timeline (in order of the hour).  A solution lists the alibis at that hour, then names
the one suspect left ("At 9 pm, Ann was in the kitchen and Ben was in the garden, so Cal.").

The reward is checked in code (:func:`verdict`): the last suspect named in the reply is the answer,
1.0 when it is the culprit, 0.0 for another suspect, -0.5 when it names none.  Step 1 is SFT on
``--sft-examples`` worked solutions; GRPO makes the steps after it.  Held-out: 64 puzzles (fixed
seeds) answered greedily; ``val/solved`` is the share solved, against 1/3 for a guess.
"""

from __future__ import annotations

import argparse
import random
import re

import gallery  # this folder's shared game loop
import openai
import tracerl

NAMES = ["Ann", "Ben", "Cal", "Dora", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jade", "Kurt", "Lena"]
ROOMS = ["kitchen", "library", "garden", "hall", "study", "cellar"]
HOURS = ["7 pm", "8 pm", "9 pm", "10 pm", "11 pm"]
SYSTEM = "You solve murder mysteries. Find the one suspect with no alibi at the hour of the crime."


def puzzle(item: int) -> tuple[str, str, str]:
    """Item ``item``'s puzzle text, a worked solution (SFT's reference answer) and its culprit."""
    rng = random.Random(item)
    suspects = rng.sample(NAMES, 3)
    room, hour = rng.choice(ROOMS), rng.choice(HOURS)
    culprit = rng.choice(suspects)
    other_hours = [h for h in HOURS if h != hour]
    clues: list[tuple[int, float, str]] = []
    for suspect in suspects:
        hours = rng.sample(other_hours, 2) if suspect == culprit else [hour, rng.choice(other_hours)]
        for h in hours:
            where = rng.choice([r for r in ROOMS if r != room]) if h == hour else rng.choice(ROOMS)
            clues.append((HOURS.index(h), rng.random(), f"At {h}, {suspect} was in the {where}."))
    clues.sort()  # in order of time, as a timeline; the suspects' order within an hour is random
    alibis = [clue.removeprefix(f"At {hour}, ").rstrip(".") for _, _, clue in clues if clue.startswith(f"At {hour}, ")]
    text = (f"Suspects: {', '.join(suspects)}. The crime happened in the {room} at {hour}.\n"
            + "\n".join(clue for _, _, clue in clues) + "\nWho did it?")  # fmt: skip
    solution = f"At {hour}, {' and '.join(alibis)}, so {culprit}."
    return text, solution, culprit


def verdict(reply: str, item: int) -> str:
    """``solved``, ``wrong`` (another suspect) or ``none`` (no suspect named); the last name counts."""
    text, _, culprit = puzzle(item)
    suspects = text.split("\n")[0].removeprefix("Suspects: ").split(". ")[0].split(", ")
    named = re.findall(r"\b(" + "|".join(suspects) + r")\b", reply)
    if not named:
        return "none"
    return "solved" if named[-1] == culprit else "wrong"


OUTCOME_REWARD = {"solved": 1.0, "wrong": 0.0, "none": -0.5}


@tracerl.retry(max_attempts=2, exceptions=(openai.APITimeoutError,))
async def play(model: tracerl.TrainableModel, item: int, *, temperature: float, seed: int | None) -> tracerl.Trajectory:
    """One puzzle, one answer; the metrics say how it scored."""
    text, _, culprit = puzzle(item)
    trajectory, reply = await gallery.answer(model, SYSTEM, text, item, temperature=temperature, seed=seed, max_tokens=40)
    outcome = verdict(reply, item)
    trajectory.reward = OUTCOME_REWARD[outcome]
    trajectory.metrics.update({name: float(name == outcome) for name in OUTCOME_REWARD})
    trajectory.metadata.update(culprit=culprit)
    return trajectory


async def main(args: argparse.Namespace) -> tracerl.TrainableModel:
    sft = gallery.sft_warmup(args, SYSTEM, lambda item: puzzle(item)[:2], "worked solutions")
    return await gallery.train(args, "temporalclue", play, ("solved", "wrong", "none"), "Temporal Clue-style puzzles: SFT, then GRPO",
                               warmup=sft)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return gallery.parser(__doc__, steps=13, sft_examples=256).parse_args(argv)


if __name__ == "__main__":
    gallery.run(main, parse_args())
