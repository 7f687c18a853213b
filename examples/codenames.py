"""Codenames, one round, scored by the rules: the policy guesses for its team, learned with GRPO
(ART's gallery has Codenames; on a 135M model this plays the guesser's side of a small board).

    python examples/codenames.py --steps 21 --seed 0

A board is nine words from a small list of ten categories: three are the team's, three the other
team's, two neutral, one the assassin.  The spymaster (in code, by the rules) gives the clue: a
category that exactly two of the team's words belong to and no other word on the board does, and
the number 2.  The policy then guesses one word per turn, as guessers do: a team word is revealed
and it guesses again (up to 2); another team's or a neutral word ends the round; the assassin loses
the game.  The reward is checked in code (:data:`OUTCOME_REWARD`): both words found 1.0, one 0.5,
none 0.0, the assassin -1.0, and a word not on the board (or already revealed) ends it at -0.5.
Step 1 is SFT on ``--sft-examples`` worked rounds (the base model at T=1 names a board word
in about one reply of ten); GRPO makes the steps after it.

Held-out: 64 boards (fixed seeds) played greedily; ``val/both`` is the share of rounds in which
both clue words were found, against 2/9 x 1/8 = 0.028 for random guesses among the board's words.
"""

from __future__ import annotations

import argparse
import random
import re

import gallery  # this folder's shared game loop
import openai
import tracerl

CATEGORIES = {
    "animal": ["dog", "horse", "tiger", "rabbit", "eagle", "shark"],
    "fruit": ["apple", "banana", "cherry", "grape", "lemon", "mango"],
    "color": ["red", "blue", "green", "yellow", "purple", "pink"],
    "tool": ["hammer", "saw", "drill", "wrench", "shovel", "chisel"],
    "vehicle": ["car", "truck", "bus", "train", "bicycle", "boat"],
    "instrument": ["piano", "guitar", "violin", "drum", "flute", "trumpet"],
    "body part": ["hand", "knee", "elbow", "nose", "shoulder", "ankle"],
    "weather": ["rain", "snow", "storm", "wind", "fog", "thunder"],
    "sport": ["tennis", "soccer", "golf", "hockey", "boxing", "rugby"],
    "country": ["France", "Japan", "Brazil", "Egypt", "Canada", "India"],
}
CLUE_NUMBER = 2
OUTCOME_REWARD = {"both": 1.0, "one": 0.5, "none": 0.0, "assassin": -1.0, "invalid": -0.5}
SYSTEM = (
    "You play Codenames as the guesser. Your spymaster gives a clue: a category and a number. "
    "Each turn, reply with exactly one word from the board that belongs to the clue's category, and nothing else."
)


def board(item: int) -> tuple[list[str], dict[str, str], str]:
    """Item ``item``'s board (nine words, in the order shown), each word's side (``team``, ``other``,
    ``neutral``, ``assassin``) and the clue's category."""
    rng = random.Random(item)
    clue, *rest = rng.sample(sorted(CATEGORIES), 8)  # the clue's category, then one category per other word
    sides = dict.fromkeys(rng.sample(CATEGORIES[clue], CLUE_NUMBER), "team")
    for side, category in zip(["team", "other", "other", "other", "neutral", "neutral", "assassin"], rest[:7], strict=True):
        sides[rng.choice(CATEGORIES[category])] = side
    words = list(sides)
    rng.shuffle(words)
    return words, sides, clue


def render(words: list[str], revealed: list[str], clue: str) -> str:
    left = [w for w in words if w not in revealed]
    found = f"Found so far: {', '.join(revealed)}. " if revealed else ""
    return f"Board: {', '.join(left)}.\n{found}Clue: {clue}, {CLUE_NUMBER}. Your guess?"


def parse_guess(reply: str, words: list[str], revealed: list[str]) -> str | None:
    """The first unrevealed board word in the reply (whole word, any case), else None."""
    left = {w.lower(): w for w in words if w not in revealed}
    for token in re.findall(r"[A-Za-z]+", reply):
        if token.lower() in left:
            return left[token.lower()]
    return None


@tracerl.retry(max_attempts=2, exceptions=(openai.APITimeoutError,))
async def play(model: tracerl.TrainableModel, item: int, *, temperature: float, seed: int | None) -> tracerl.Trajectory:
    """One round on board ``item``; the metrics say how it ended (each guess is one sampled turn)."""
    words, sides, clue = board(item)
    trajectory = tracerl.Trajectory(messages_and_choices=[{"role": "system", "content": SYSTEM}], reward=0, metadata={"item": item})
    revealed: list[str] = []
    outcome = "both"
    while len(revealed) < CLUE_NUMBER:
        reply = await gallery.move(model, trajectory, render(words, revealed, clue), temperature=temperature, seed=seed)
        guess = parse_guess(reply, words, revealed)
        if guess is None:
            outcome = "invalid"
            break
        if sides[guess] != "team":
            outcome = "assassin" if sides[guess] == "assassin" else ("one" if revealed else "none")
            break
        revealed.append(guess)
    trajectory.reward = OUTCOME_REWARD[outcome]
    trajectory.metrics.update({name: float(name == outcome) for name in OUTCOME_REWARD} | {"found": float(len(revealed))})
    trajectory.metadata.update(clue=clue, revealed=revealed)
    return trajectory


def worked_round(item: int) -> list[tuple[str, str]]:
    """A worked round (SFT's example): each turn's board and clue, then one of the clue's words."""
    words, sides, clue = board(item)
    team = [w for w in words if w in CATEGORIES[clue]]  # the clue's words (the third team word is not one)
    return [(render(words, team[:i], clue), team[i]) for i in range(CLUE_NUMBER)]


async def main(args: argparse.Namespace) -> tracerl.TrainableModel:
    sft = gallery.sft_warmup(args, SYSTEM, worked_round, "worked rounds")
    return await gallery.train(args, "codenames", play, ("both", "one", "none", "assassin", "invalid"), "Codenames, the guesser: SFT, then GRPO",
                               warmup=sft)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = gallery.parser(__doc__, steps=21, sft_examples=128)
    parser.set_defaults(lr=2e-4)
    return parser.parse_args(argv)


if __name__ == "__main__":
    gallery.run(main, parse_args())
