"""``tracerl sft FILE.jsonl --model NAME --project P ...``: errors before any model loads; one real run."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from sft_helpers import CAPITALS, capital_example, write_jsonl
from tracerl.cli import app

runner = CliRunner()


def test_a_bad_line_exits_naming_it_before_any_model_loads(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [capital_example("Peru", "Lima"), {"messages": [{"role": "user", "content": "hi"}]}])
    result = runner.invoke(app, ["sft", str(path), "--model", "m", "--project", "p", "--base-path", str(tmp_path)])
    assert result.exit_code == 1
    assert f"{path} line 2" in result.output and "no assistant message to train" in result.output
    assert not (tmp_path / "p").exists(), "nothing was created"


@pytest.mark.parametrize(("option", "value", "named"), [("--lr", "nan", "learning_rate"), ("--schedule", "step", "schedule_type"), ("--epochs", "0", "epochs")])
def test_bad_settings_exit_naming_them(tmp_path, option, value, named):
    path = write_jsonl(tmp_path / "d.jsonl", [capital_example("Peru", "Lima")])
    result = runner.invoke(app, ["sft", str(path), "--model", "m", "--project", "p", "--base-path", str(tmp_path), option, value])
    assert result.exit_code == 1 and named in result.output


def test_a_reward_filter_that_keeps_nothing_exits(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [capital_example("Peru", "Lima")])
    result = runner.invoke(app, ["sft", str(path), "--model", "m", "--project", "p", "--base-path", str(tmp_path), "--min-reward", "0.5"])
    assert result.exit_code == 1 and "no example has reward >= 0.5" in result.output


@pytest.mark.real_model
def test_the_cli_fine_tunes_and_adds_one_step(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [capital_example(*c) for c in CAPITALS[:6]])
    args = ["sft", str(path), "--model", "cli-warm", "--project", "p", "--base-path", str(tmp_path), "--epochs", "1",
            "--lr", "1e-3", "--batch-size", "3", "--schedule", "linear", "--warmup-ratio", "0.5", "--val-fraction", "0.34"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "p/cli-warm: step 1 (4 examples, 2 optimizer steps" in result.output and "val loss" in result.output
    [row] = [json.loads(line) for line in (tmp_path / "p" / "models" / "cli-warm" / "history.jsonl").read_text().splitlines()]
    assert row["step"] == 1 and row["sft/optimizer_steps"] == 2
