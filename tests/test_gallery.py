"""The gallery (``examples/tictactoe.py``, ``game_2048.py``, ``text_to_sql.py``, ``temporal_clue.py``,
``summarizer.py``, ``codenames.py``, ``autorl.py``): each task's rules checked in code, and a tiny
real-model run of each (SmolLM2 on the transformers server) in which every move is a sampled turn.
The full runs: ``make gallery``."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest

import tracerl

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


def _train(module, tmp_path, capsys, argv: list[str], run: str, step: int):
    """Run ``module``'s ``main`` on the transformers server; its printed output, run folder and step ``step``'s training trajectories."""
    from tracerl.integrations.importers import read_jsonl
    from tracerl.runs.storage import RunDir

    asyncio.run(module.main(module.parse_args([*argv, "--inference", "transformers", "--data", str(tmp_path)])))
    run_dir = RunDir(tmp_path, run, f"{run}-s0")
    return capsys.readouterr().out, run_dir, read_jsonl(run_dir.trajectories_path("train", step))


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
    out, run, games = _train(t, tmp_path, capsys, ["--steps", "1", "--groups", "2", "--rollouts", "4", "--val-games", "1"], "tictactoe", 1)
    assert "step 1: reward" in out
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
    out, _, games = _train(g, tmp_path, capsys, ["--steps", "1", "--groups", "1", "--rollouts", "4", "--val-games", "1"], "game2048", 1)
    assert "step 1: reward" in out
    assert len(games) == 4
    for game in games:
        assert len(game.sampled_turns()) == game.metrics["moves"] <= g.MAX_MOVES
        assert all(c.token_ids and c.logprobs for c in game.sampled_turns())
        assert game.reward == g.reward_of(int(game.metrics["largest"]), bool(game.metrics["invalid"]))


def test_sql_is_scored_by_execution_on_a_read_only_database_with_a_time_limit():
    s = _example("text_to_sql")
    gold = "SELECT name FROM employees WHERE department = 'Sales'"
    assert s.score(gold, gold) == "correct"
    assert s.score("SELECT name FROM employees WHERE department='Sales' ORDER BY age;", gold) == "correct"  # rows as a multiset
    assert s.score("```sql\nSELECT name FROM employees WHERE department = 'Sales'\n```", gold) == "correct"
    assert s.score("SELECT name FROM employees", gold) == "wrong" and s.score("SELEC name", gold) == "error"
    ordered = "SELECT name FROM employees ORDER BY salary DESC LIMIT 3"
    assert s.score("SELECT name FROM employees ORDER BY salary ASC LIMIT 3", ordered) == "wrong"
    assert s.score("DELETE FROM employees", gold) == "error" and s.run_query("SELECT COUNT(*) FROM employees") == [(30,)]
    endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c"
    assert s.score(endless, gold) == "error"  # stopped by the time limit
    assert len(s.HELD_OUT) == 64 and len(s.HELD_OUT_QUESTIONS) == 64
    assert not {s.question(i)[0] for i in s.training_items(0, 500)} & s.HELD_OUT_QUESTIONS
    assert all(s.run_query(s.question(i)[1]) is not None for i in s.HELD_OUT)


def test_clue_puzzles_are_solved_only_by_matching_the_hour():
    c = _example("temporal_clue")
    for item in range(200):
        text, solution, culprit = c.puzzle(item)
        lines = text.split("\n")
        suspects = lines[0].removeprefix("Suspects: ").split(". ")[0].split(", ")
        hour = lines[0].split(" at ")[-1].rstrip(".")
        clues = lines[1:-1]
        assert len(clues) == 6 and all(sum(f", {s} was" in c_ for c_ in clues) == 2 for s in suspects)
        with_alibi = {s for s in suspects for c_ in clues if c_.startswith(f"At {hour}, {s} ")}
        assert set(suspects) - with_alibi == {culprit}
        assert c.verdict(solution, item) == "solved"
    text, _, culprit = c.puzzle(1)
    other = next(s for s in text.split("\n")[0].removeprefix("Suspects: ").split(". ")[0].split(", ") if s != culprit)
    assert c.verdict(f"Not {culprit}: {other}.", 1) == "wrong" and c.verdict("the butler", 1) == "none"


def test_summaries_pass_with_every_fact_within_the_word_bound():
    m = _example("summarizer")
    for item in range(100):
        text, reference, facts = m.document(item)
        assert all(value in text for value in facts.values()) and len(text.split(". ")) == 6
        assert m.check(reference, facts) == (3, True)
    _, reference, facts = m.document(7)
    assert m.check(reference.replace(facts["number"], "many"), facts) == (2, True)
    assert m.check(facts["person"].split()[0] + " did it.", facts) == (0, True)  # the first name alone is not the person
    assert m.check(reference + " It was" + " a very" * 10 + " nice day.", facts) == (3, False)


def test_codenames_boards_and_rounds_follow_the_rules():
    c = _example("codenames")
    for item in range(200):
        words, sides, clue = c.board(item)
        assert len(words) == 9 and sorted(sides.values()).count("team") == 3 and list(sides.values()).count("assassin") == 1
        assert [w for w in words if w in c.CATEGORIES[clue]] == [w for w in words if w in c.CATEGORIES[clue] and sides[w] == "team"]
        assert len([w for w in words if w in c.CATEGORIES[clue]]) == c.CLUE_NUMBER  # the clue fits two team words, nothing else
        turns = c.worked_round(item)
        assert [answer for _, answer in turns] == [w for w in words if w in c.CATEGORIES[clue]]
    words = ["storm", "dog", "fog"]
    assert c.parse_guess("Fog!", words, []) == "fog" and c.parse_guess("fog", words, ["fog"]) is None
    assert c.parse_guess("I pick the weather word storm", words, []) == "storm" and c.parse_guess("rain", words, []) is None


def test_autorl_inputs_are_cleaned_and_replies_checked():
    a = _example("autorl")
    assert a.clean("1. The cat sat on the mat.") == "The cat sat on the mat." and a.clean("- \"Please call me back.\"") == "Please call me back."
    assert a.clean("Hi") is None and a.clean("1234 5678 9012") is None and a.clean(" ".join(["word"] * 20)) is None
    assert a.check(' "THE CAT SAT." ', "The cat sat.") and not a.check("THE CAT SAT", "The cat sat.")
    group = tracerl.TrajectoryGroup([tracerl.Trajectory(messages_and_choices=[], reward=r, metrics={"exact": e})
                                     for r, e in ((0.9, 1.0), (0.2, 0.0), (0.5, 0.0))])  # fmt: skip
    assert [t.metrics["judge_agrees"] for t in a.agreement(group).trajectories] == [1.0] * 3
    tied = a.agreement(tracerl.TrajectoryGroup([tracerl.Trajectory(messages_and_choices=[], reward=0.5, metrics={"exact": e}) for e in (1.0, 0.0)]))
    assert [t.metrics for t in tied.trajectories][0] == {"exact": 1.0, "judge_tied": 1.0, "judge_agrees": 0.5}


def _capitals_judge(request, n_call):
    """A judge that knows the task: each reply scored by its share of capital letters."""
    from ruler_judge_server import answer, trajectories_in

    scores = []
    for tid, text in trajectories_in(request):
        reply = text.rsplit("assistant", 1)[-1]
        letters = [ch for ch in reply if ch.isalpha()]
        scores.append((tid, round(sum(ch.isupper() for ch in letters) / max(1, len(letters)), 3)))
    return answer(scores)


@pytest.mark.real_model
def test_autorl_generates_inputs_judges_with_ruler_and_trains(tmp_path, capsys):
    from ruler_judge_server import JudgeServer

    a = _example("autorl")
    with JudgeServer(_capitals_judge) as judge:
        argv = ["--steps", "1", "--groups", "1", "--rollouts", "4", "--train-inputs", "4", "--val-inputs", "2", "--judge-url", judge.base_url]
        out, run_dir, groups = _train(a, tmp_path, capsys, argv, "autorl", 1)
        assert judge.count >= 1
    assert "6 inputs, e.g." in out and "step 1: reward" in out
    inputs = [json.loads(line)["input"] for line in (run_dir.root / "inputs.jsonl").read_text().splitlines()]
    assert len(inputs) == len(set(inputs)) == 6 and all(a.clean(t) == t for t in inputs)
    assert len(groups) == 4
    for trajectory in groups:
        assert trajectory.sampled_turns()[0].token_ids and trajectory.metadata["item"] >= 2  # training items are not held out
        assert trajectory.metrics["independent_reward"] == trajectory.metrics["exact"]  # the check, kept beside the judge's score
        assert trajectory.reward == trajectory.metrics["ruler_score"] and "judge_tied" in trajectory.metrics
    assert [r["step"] for r in run_dir.read_history() if "val/exact" in r] == [0, 1]


@pytest.mark.real_model
@pytest.mark.parametrize("name,run,outcomes", [("text_to_sql", "texttosql", ("correct", "wrong", "error")),
                                               ("temporal_clue", "temporalclue", ("solved", "wrong", "none")),
                                               ("summarizer", "summarizer", ("passed",)),
                                               ("codenames", "codenames", ("both", "one", "none", "assassin", "invalid"))])  # fmt: skip
def test_sft_then_a_grpo_step_with_a_checked_reward(tmp_path, capsys, name, run, outcomes):
    m = _example(name)
    argv = ["--steps", "2", "--sft-examples", "8", "--groups", "1", "--rollouts", "4", "--val-games", "1"]
    out, run_dir, answers = _train(m, tmp_path, capsys, argv, run, 2)
    assert "step 1: SFT on 8" in out and "step 2: reward" in out
    assert len(answers) == 4
    for answer in answers:
        turns = answer.sampled_turns()
        assert len(turns) == (answer.metrics["found"] + (answer.reward != 1.0) if name == "codenames" else 1)  # a guess per turn
        assert all(turn.token_ids and turn.logprobs for turn in turns)
        if name == "summarizer":
            assert answer.reward == (answer.metrics["facts"] if not answer.metrics["too_long"] else -0.5)
            assert answer.metrics["passed"] == float(answer.reward == 1.0)
        else:
            [outcome] = [o for o in outcomes if answer.metrics[o] == 1.0]
            assert answer.reward == m.OUTCOME_REWARD[outcome]
    rows = run_dir.read_history()
    assert [r["step"] for r in rows if "val/reward" in r] == [0, 1, 2]  # base, after SFT, after GRPO
