"""Torn JSONL on disk: appends never glue onto a torn line; the reader skips and reports bad lines."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tracerl
from tracerl.runs.storage import RunDir, append_jsonl, read_jsonl, read_jsonl_report


def _log(model, step, reward, split="train"):
    group = tracerl.TrajectoryGroup([tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}], reward=reward)])
    return asyncio.run(model.log([group], split=split, step=step))


def test_a_row_logged_after_a_torn_line_is_kept(tmp_path):
    """Fault 1 of issue 9: a kill mid-append leaves a torn line; the next row must not glue onto it."""
    model = tracerl.Model("torn", "p", base_path=tmp_path)
    _log(model, 1, 0.25)
    with open(model.run_dir.history_path, "a") as f:
        f.write('{"step": 2, "train/rew')  # what a writer killed mid-line leaves on disk
    _log(model, 3, 0.75)
    rows = model.history()
    assert [(r["step"], r["train/reward"]) for r in rows] == [(1, 0.25), (3, 0.75)]
    report = model.run_dir.history_report()
    assert [(s.line, s.reason.split(":")[0]) for s in report.skipped] == [(2, "not valid JSON")]


def test_the_reader_reports_each_bad_line_with_its_number(tmp_path, caplog):
    path = tmp_path / "h.jsonl"
    path.write_text('{"step": 1}\n[1, 2]\n\n{"step": 2, "x": nan\n{"step": 3}\n{"step": 4, "tr')
    with caplog.at_level(logging.WARNING, logger="tracerl"):
        rows = read_jsonl(path)
    assert rows == [{"step": 1}, {"step": 3}]
    report = read_jsonl_report(path)
    assert [s.line for s in report.skipped] == [2, 4, 6]
    assert report.skipped[0].reason == "not a JSON object" and report.skipped[2].reason.startswith("torn")
    assert "h.jsonl" in caplog.text and "line 6" in caplog.text and "line 2" in caplog.text


def test_a_row_glued_to_a_torn_line_by_an_older_version_is_salvaged(tmp_path):
    path = tmp_path / "h.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "train/rew{"step": 3, "train/reward": 1.0}\n')
    report = read_jsonl_report(path)
    assert report.rows == [{"step": 1}, {"step": 3, "train/reward": 1.0}]
    assert report.skipped[0].line == 2 and "salvaged" in report.skipped[0].reason


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=8), max_size=3), min_size=1, max_size=5),
    cut=st.integers(min_value=0, max_value=400),
)
def test_any_torn_tail_loses_at_most_the_torn_row(tmp_path_factory, rows, cut):
    """Cut the file at any byte (a torn last write), then append: every whole row and the new one survive."""
    path = tmp_path_factory.mktemp("h") / "history.jsonl"
    append_jsonl(path, rows)
    data = path.read_bytes()
    cut = min(cut, len(data))
    path.write_bytes(data[:cut])
    whole = data[:cut].count(b"\n")
    append_jsonl(path, [{"step": "new"}])
    back = read_jsonl(path)
    assert back[:whole] == rows[:whole] and back[-1] == {"step": "new"}
    assert len(back) in (whole + 1, whole + 2)  # the torn row may happen to be valid JSON (cut just before "\n")


def test_cli_history_prints_the_skipped_lines(tmp_path):
    from typer.testing import CliRunner

    from tracerl.cli import app

    run = RunDir(tmp_path, "p", "m")
    run.append_history({"step": 1, "train/reward": 0.5})
    with open(run.history_path, "a") as f:
        f.write('{"step": 2, "tr')
    out = CliRunner().invoke(app, ["history", "m", "--project", "p", "--base-path", str(tmp_path)])
    assert out.exit_code == 0, out.output
    assert "0.5" in out.output and "line 2" in out.output and "torn" in out.output


@pytest.mark.parametrize("bad", ["ok\n", "ok\r\n", "ok\n\n"])
def test_names_with_a_trailing_newline_are_rejected(bad, tmp_path):
    with pytest.raises(tracerl.ConfigError, match="invalid"):
        tracerl.TrainableModel(bad, "p", "smollm2-135m", base_path=tmp_path)
    with pytest.raises(tracerl.ConfigError):
        RunDir(tmp_path, "p", "m").trajectories_path(bad, 1)


def test_log_writes_a_step_and_split_once(tmp_path):
    """A rerun that logs the same (step, split) again never writes a second row."""
    model = tracerl.Model("twice", "p", base_path=tmp_path)
    first = _log(model, 1, 0.5)
    again = _log(model, 1, 0.9)
    _log(model, 1, 0.1, split="val")
    assert again == first
    assert [(r["step"], sorted(k for k in r if "/" in k)[0]) for r in model.history()] == [(1, "train/exception_rate"), (1, "val/exception_rate")]
    assert json.loads(model.run_dir.trajectories_path("train", 1).read_text().splitlines()[0])["reward"] == 0.5
