"""bench/demo_step.py: steps read from a real history, the filing-day tree importable, the table from the raw JSON."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import demo_step  # noqa: E402


def test_the_committed_table_is_regenerated_from_the_raw_json() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH / "demo_step.py"), "--table-only", str(BENCH / "results" / "demo_step.json")],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    results = (BENCH / "RESULTS.md").read_text()
    rows = [line for line in out.splitlines() if line.startswith("| filed:") or line.startswith("| new:")]
    assert len(rows) == 2, out
    # RESULTS.md states each side's median and range in prose (the full table is the raw JSON's):
    # every figure it states must be the one the JSON regenerates.
    section = results.split("## The demo's step", 1)[1].split("\n## ", 1)[0]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        median, span, ceiling_share = cells[1], cells[2], cells[10]
        assert f"{median} s/step ({span})" in section and ceiling_share in section, (row, section)
    ratio = next(line for line in out.splitlines() if line.startswith("new / filed median s/step"))
    assert ratio in section, (ratio, section)


def test_steps_come_from_the_history_rows_times_and_split() -> None:
    rows = [
        {"step": 0, "time": 100.0, "val/reward": 0.0},
        {"step": 1, "time": 130.0, "train/reward": 0.25, "train/rollout_seconds": 20.0, "train/forward_tokens": 1000.0, "train/trained_tokens": 100.0},
        {"step": 2, "time": 150.0, "train/reward": 0.5},  # an older demo: no split
        {"step": 3, "time": 175.0, "train/reward": 0.75},
    ]  # fmt: skip
    got = demo_step.steps_from_history(rows, started=40.0, steps=2)
    assert got["setup_and_eval_seconds"] == 60.0 and got["val_reward_step0"] == 0.0
    assert [s["wall_seconds"] for s in got["steps"]] == [30.0, 20.0]
    assert got["steps"][0]["rollout_seconds"] == 20.0 and got["steps"][1]["rollout_seconds"] is None
    summary = demo_step.summarize({"steps": got["steps"], "ceiling_before": {"matmul_gflops": 100.0}})
    assert summary["median_wall"] == 25.0 and summary["rollout_seconds"] == 20.0 and summary["train_seconds"] is None
    flops = 2 * demo_step.PARAMETERS * 100 + 4 * demo_step.PARAMETERS * 1000
    assert abs(summary["gflops"] - (flops / 30 / 1e9 + 0.0) / 2) < 1e-9


def test_the_filed_commit_exports_as_an_importable_tracerl(tmp_path: Path) -> None:
    try:
        pkg = demo_step.export_commit(demo_step.FILED_COMMIT, tmp_path)
    except subprocess.CalledProcessError as error:  # a shallow clone without that commit
        pytest.skip(f"commit {demo_step.FILED_COMMIT} not in this clone: {error.stderr[:200]!r}")
    out = subprocess.run(
        [sys.executable, "-c", "import tracerl, tracerl.integrations, tracerl.ruler; print(tracerl.__file__)"],
        env={"PYTHONPATH": str(pkg), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert Path(out.strip()).resolve().is_relative_to((tmp_path / "src" / "core").resolve()), out
    assert not (tmp_path / "src" / "core" / "train").exists()  # that day's code, not today's


def test_stop_tree_interrupts_then_kills_what_is_left(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(
        "import signal, subprocess, sys, time\n"
        "grandchild = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(tmp_path / 'pid')!r}, 'w').write(str(grandchild.pid))\n"
        "signal.signal(signal.SIGINT, lambda *a: sys.exit(0))  # exits, leaving its child running\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], text=True)
    while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text():
        time.sleep(0.05)
    grandchild = int((tmp_path / "pid").read_text())
    demo_step.stop_tree(proc, grace_s=10.0)
    import psutil

    assert proc.returncode == 0
    deadline = time.monotonic() + 10
    while psutil.pid_exists(grandchild) and psutil.Process(grandchild).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
