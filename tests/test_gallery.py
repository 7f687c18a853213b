"""The Tic Tac Toe gallery example (``examples/tictactoe.py``): its rules checked in code, and one
real-model step (SmolLM2 on the transformers server) in which every move is a sampled turn."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _example():
    sys.path.insert(0, str(EXAMPLES))  # it imports the demo's backend settings
    try:
        spec = importlib.util.spec_from_file_location("tictactoe", EXAMPLES / "tictactoe.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    finally:
        sys.path.remove(str(EXAMPLES))
    return module


def test_lines_moves_and_rewards_follow_the_rules():
    t = _example()
    board = list("XXXOO    ")
    assert t.winner(board) == "X" and t.winner(list("O  O  O  ")) == "O" and t.winner(list("XOXXOOOXX")) is None
    assert t.free_cells(board) == [6, 7, 8, 9]
    assert t.parse_move("6", board) == 6 and t.parse_move("I take cell 9.", board) == 9
    assert t.parse_move("1", board) is None and t.parse_move("the middle", board) is None  # taken; no number
    assert "X | X | X\nO | O | 6\n7 | 8 | 9\nFree cells: 6, 7, 8, 9." in t.render(board)
    assert [t.outcome_reward(o) for o in ("win", "draw", "loss", "invalid")] == [1.0, 0.5, 0.0, -0.5]


@pytest.mark.real_model
def test_games_are_multi_turn_sampled_trajectories_and_a_step_trains(tmp_path, capsys):
    t = _example()
    args = t.parse_args(["--steps", "1", "--groups", "2", "--rollouts", "4", "--val-games", "2", "--inference", "transformers",
                         "--data", str(tmp_path)])  # fmt: skip
    asyncio.run(t.main(args))
    assert "step 1: reward" in capsys.readouterr().out
    from tracerl.integrations.importers import read_jsonl
    from tracerl.runs.storage import RunDir

    run = RunDir(tmp_path, "tictactoe", "tictactoe-s0")
    games = read_jsonl(run.trajectories_path("train", 1))
    assert len(games) == 8
    for game in games:
        turns = game.sampled_turns()
        assert len(turns) == game.metrics["moves"] >= 1 and all(c.token_ids and c.logprobs for c in turns)
        outcome = [name for name in t.OUTCOME_REWARD if game.metrics[name] == 1.0]
        assert len(outcome) == 1 and game.reward == t.OUTCOME_REWARD[outcome[0]]
        board = game.metadata["board"]
        assert board.count("X") - board.count("O") in (0, 1)  # X moved first, O answered each valid move
        if outcome[0] == "win":
            assert t.winner(list(board)) == "X"
    rows = run.read_history()
    assert [r["step"] for r in rows if "val/reward" in r] == [0, 1]
    [train] = [r for r in rows if "train/reward" in r]
    varied = sum(len({g.reward for g in games[i * 4 : i * 4 + 4]}) > 1 for i in range(2))
    assert train["train/num_groups_trainable"] == varied
    if varied:
        assert train["train/trained_tokens"] > 0
    assert (run.root / "reward_curve.png").stat().st_size > 0
