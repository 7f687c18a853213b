"""Tic Tac Toe against a random opponent, learned with GRPO (ART's gallery has the same game).

    python examples/tictactoe.py --steps 12 --seed 0

The policy plays X and moves first; O plays a uniformly random free cell (seeded per game, so a
held-out game is the same game at every evaluation as long as the policy plays the same moves).
Each of the policy's moves is one sampled turn of a multi-turn conversation: the board, with the
free cells numbered, then the policy's cell number, then the board after O's answer, and so on.
The reward is checked in code (:func:`outcome_reward`): a win 1.0, a draw 0.5, a loss 0.0, and
an invalid move (no number, or a taken cell) ends the game at -0.5.

Held-out: 64 games against fixed opponent seeds, played greedily, every ``--eval-every`` steps;
``val/reward`` and the outcome shares (``val/win``, ``val/draw``, ``val/loss``, ``val/invalid``)
land in the history, and a curve is drawn at the end.  A first mover choosing among the free
cells at random wins about 58% and draws about 13% of games against a random opponent, so the
game rewards first learning to answer with a free cell, then choosing better ones.
"""

from __future__ import annotations

import argparse
import random
import re

import gallery  # this folder's shared game loop
import openai
import tracerl

LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]
OUTCOME_REWARD = {"win": 1.0, "draw": 0.5, "loss": 0.0, "invalid": -0.5}
SYSTEM = (
    "You play Tic Tac Toe as X against O. The cells are numbered 1 to 9, left to right, top to bottom. "
    "Each turn, reply with the number of one free cell and nothing else."
)


def winner(board: list[str]) -> str | None:
    """Who holds a full line ("X" or "O"), else None."""
    for a, b, c in LINES:
        if board[a] != " " and board[a] == board[b] == board[c]:
            return board[a]
    return None


def free_cells(board: list[str]) -> list[int]:
    """The free cells, numbered 1-9."""
    return [i + 1 for i, cell in enumerate(board) if cell == " "]


def render(board: list[str]) -> str:
    """The board with each free cell shown as its number, then the free cells listed."""
    rows = [" | ".join(board[i] if board[i] != " " else str(i + 1) for i in range(r, r + 3)) for r in (0, 3, 6)]
    return "\n".join(rows) + f"\nFree cells: {', '.join(map(str, free_cells(board)))}. Your move?"


def parse_move(text: str, board: list[str]) -> int | None:
    """The cell (1-9) the reply names first, if it is free; None for anything else."""
    found = re.search(r"[1-9]", text)
    return int(found.group()) if found and board[int(found.group()) - 1] == " " else None


def outcome_reward(outcome: str) -> float:
    return OUTCOME_REWARD[outcome]


@tracerl.retry(max_attempts=2, exceptions=(openai.APITimeoutError,))
async def play(model: tracerl.TrainableModel, game: int, *, temperature: float, seed: int | None) -> tracerl.Trajectory:
    """One game; ``game`` seeds the opponent.  The trajectory's metrics say how it ended.

    Written as ART's examples write rollouts (``tracerl.retry``, each turn in :func:`gallery.move`)."""
    opponent = random.Random(game)
    board = [" "] * 9
    trajectory = tracerl.Trajectory(messages_and_choices=[{"role": "system", "content": SYSTEM}], reward=0, metadata={"game": game})
    outcome, moves = "draw", 0
    while free_cells(board):
        reply = await gallery.move(model, trajectory, render(board), temperature=temperature, seed=seed)
        moves += 1
        cell = parse_move(reply, board)
        if cell is None:
            outcome = "invalid"
            break
        board[cell - 1] = "X"
        if winner(board) == "X":
            outcome = "win"
            break
        if not free_cells(board):
            break
        board[opponent.choice(free_cells(board)) - 1] = "O"
        if winner(board) == "O":
            outcome = "loss"
            break
    trajectory.reward = outcome_reward(outcome)
    trajectory.metrics.update({name: float(name == outcome) for name in OUTCOME_REWARD} | {"moves": float(moves)})
    trajectory.metadata.update(board="".join(board), model=model.name)
    return trajectory


async def main(args: argparse.Namespace) -> tracerl.TrainableModel:
    return await gallery.train(args, "tictactoe", play, ("win", "draw", "loss", "invalid"), "Tic Tac Toe vs a random opponent")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return gallery.parse_args(__doc__, argv, steps=12)


if __name__ == "__main__":
    gallery.run(main, parse_args())
