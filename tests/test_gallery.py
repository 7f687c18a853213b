"""The gallery's games (``examples/tictactoe.py``, ``examples/game_2048.py``): their rules checked in
code, and one real-model step each (SmolLM2 on the transformers server) in which every move is a
sampled turn.  The full runs: ``make gallery``."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _example(name: str = "tictactoe"):
    sys.path.insert(0, str(EXAMPLES))  # it imports the gallery's loop and the demo's backend settings
    try:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
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


def test_2048_slides_merges_and_scores_as_the_game_does():
    g = _example("game_2048")
    assert g.slide_row_left([2, 2, 2, 2]) == [4, 4, 0, 0] and g.slide_row_left([2, 0, 2, 4]) == [4, 4, 0, 0]
    assert g.slide_row_left([4, 4, 8, 0]) == [8, 8, 0, 0]  # a merged tile does not merge again in the same move
    board = [[2, 0, 0, 2], [2, 0, 0, 0], [0] * 4, [0] * 4]
    assert g.moved(board, "right")[0] == [0, 0, 0, 4] and g.moved(board, "down")[3] == [4, 0, 0, 2]
    assert g.moved(board, "up")[0] == [4, 0, 0, 2] and g.moved(board, "left")[0] == [4, 0, 0, 0]
    assert g.parse_move("Up!") == "up" and g.parse_move("I'd go down, then left") == "down" and g.parse_move("upward") is None
    assert g.reward_of(16, False) == 1.0 and g.reward_of(8, False) == 0.75 and g.reward_of(64, True) == -0.5


@pytest.mark.real_model
def test_2048_games_are_sampled_turns_and_a_step_trains(tmp_path, capsys):
    g = _example("game_2048")
    args = g.parse_args(["--steps", "1", "--groups", "1", "--rollouts", "4", "--val-games", "2", "--inference", "transformers",
                         "--data", str(tmp_path)])  # fmt: skip
    asyncio.run(g.main(args))
    assert "step 1: reward" in capsys.readouterr().out
    from tracerl.integrations.importers import read_jsonl
    from tracerl.runs.storage import RunDir

    games = read_jsonl(RunDir(tmp_path, "game2048", "game2048-s0").trajectories_path("train", 1))
    assert len(games) == 4
    for game in games:
        assert len(game.sampled_turns()) == game.metrics["moves"] <= g.MAX_MOVES
        assert all(c.token_ids and c.logprobs for c in game.sampled_turns())
        assert game.reward == g.reward_of(int(game.metrics["largest"]), bool(game.metrics["invalid"]))
