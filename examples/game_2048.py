"""2048 on a 4×4 board, capped at 10 moves, learned with GRPO (ART's gallery plays the whole game).

    python examples/game_2048.py --steps 12 --seed 0

The policy sees the board (``.`` for an empty cell) and answers a move: left, right, up or down.
Tiles slide and merge as in 2048; after each move a 2 (or, one time in ten, a 4) appears on a
random empty cell, seeded per game.  The game is capped at ``MAX_MOVES`` moves: a 135M model
playing a whole game (hundreds of moves, a conversation of tens of thousands of tokens) is out of
reach on this CPU, so the task is "the largest tile in 10 moves".  Reward, checked in code
(:func:`reward_of`): log2 of the largest tile over 4 (a 16 scores 1.0, an 8 0.75); a reply that
names no move, or a move that changes nothing, ends the game at -0.5.  The task outcome is
``reached_16``: a 16 tile within the cap.
"""

from __future__ import annotations

import argparse
import math
import random
import re

import gallery  # this folder's shared game loop
import openai
import tracerl

MAX_MOVES = 10
MOVES = ("left", "right", "up", "down")
SYSTEM = (
    "You play 2048 on a 4x4 board. Tiles slide as far as they can in the direction you choose, and two equal tiles "
    "that meet merge into one. Reply with one move, left, right, up or down, and nothing else."
)


WORKED = [
    {"role": "user", "content": " .  .  .  .\n .  2  .  2\n .  .  .  .\n .  .  4  .\nYour move (left, right, up or down)?"},
    {"role": "assistant", "content": "left"},
]
"""One answered turn shown before the game (context, never trained).  Without it SmolLM2-135M named a move
in fewer than 1 game in 10 at T=1 and in none greedily: 12 steps left every held-out game invalid."""


def slide_row_left(row: list[int]) -> list[int]:
    """One row after a move to the left: tiles packed, equal neighbours merged once, left to right."""
    tiles = [v for v in row if v]
    out: list[int] = []
    while tiles:
        if len(tiles) > 1 and tiles[0] == tiles[1]:
            out.append(tiles[0] * 2)
            tiles = tiles[2:]
        else:
            out.append(tiles.pop(0))
    return out + [0] * (len(row) - len(out))


def moved(board: list[list[int]], move: str) -> list[list[int]]:
    """The board after ``move`` (no new tile yet)."""
    if move in ("up", "down"):
        columns = [list(c) for c in zip(*board)]
        return [list(r) for r in zip(*moved(columns, "left" if move == "up" else "right"))]
    if move == "right":
        return [slide_row_left(row[::-1])[::-1] for row in board]
    return [slide_row_left(row) for row in board]


def add_tile(board: list[list[int]], rng: random.Random) -> None:
    empty = [(r, c) for r in range(4) for c in range(4) if not board[r][c]]
    if empty:
        r, c = rng.choice(empty)
        board[r][c] = 4 if rng.random() < 0.1 else 2


def new_board(rng: random.Random) -> list[list[int]]:
    board = [[0] * 4 for _ in range(4)]
    add_tile(board, rng)
    add_tile(board, rng)
    return board


def render(board: list[list[int]]) -> str:
    rows = "\n".join(" ".join(f"{v or '.':>2}" for v in row) for row in board)
    return f"{rows}\nYour move (left, right, up or down)?"


def parse_move(text: str) -> str | None:
    """The first move the reply names, if any."""
    found = re.search(r"\b(left|right|up|down)\b", text.lower())
    return found.group(1) if found else None


def reward_of(largest: int, invalid: bool) -> float:
    return -0.5 if invalid else math.log2(largest) / 4


@tracerl.retry(max_attempts=2, exceptions=(openai.APITimeoutError,))
async def play(model: tracerl.TrainableModel, game: int, *, temperature: float, seed: int | None) -> tracerl.Trajectory:
    """Up to ``MAX_MOVES`` moves of one game; ``game`` seeds its tiles."""
    rng = random.Random(game)
    board = new_board(rng)
    trajectory = tracerl.Trajectory(messages_and_choices=[{"role": "system", "content": SYSTEM}, *WORKED], reward=0, metadata={"game": game})
    invalid, moves = False, 0
    while moves < MAX_MOVES:
        reply = await gallery.move(model, trajectory, render(board), temperature=temperature, seed=seed)
        moves += 1
        move = parse_move(reply)
        after = moved(board, move) if move else board
        if after == board:  # no move named, or one that changes nothing
            invalid = True
            break
        board = after
        add_tile(board, rng)
    largest = max(max(row) for row in board)
    trajectory.reward = reward_of(largest, invalid)
    trajectory.metrics.update(largest=float(largest), reached_16=float(largest >= 16 and not invalid), invalid=float(invalid), moves=float(moves))
    return trajectory


async def main(args: argparse.Namespace) -> tracerl.TrainableModel:
    return await gallery.train(args, "game2048", play, ("reached_16", "largest", "invalid"), f"2048, {MAX_MOVES} moves")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return gallery.parse_args(__doc__, argv, steps=12)


if __name__ == "__main__":
    gallery.run(main, parse_args())
