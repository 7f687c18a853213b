"""``tracerl.runs.plots.seed_summary`` / ``plot_seeds`` and ``examples/plot_seeds.py``: several seeds' held-out curves, combined."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tracerl.runs.plots import plot_seeds, seed_summary

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def history(vals: dict[int, float], train_steps: int = 3) -> list[dict]:
    rows = [{"step": s, "train/reward": 0.1 * s} for s in range(1, train_steps + 1)]
    return rows + [{"step": s, "val/reward": v} for s, v in vals.items()]


def test_summary_is_per_step_over_seeds_and_skips_steps_a_seed_did_not_reach():
    runs = {"s0": history({0: 0.0, 2: 0.5, 4: 1.0}), "s1": history({0: 0.2, 2: 0.7}), "s2": history({0: 0.4, 2: 0.6, 4: 0.8})}
    summary = seed_summary(runs, "val/reward")
    assert [s["step"] for s in summary] == [0, 2]  # step 4: s1 stopped early
    assert summary[0] == pytest.approx({"step": 0, "mean": 0.2, "std": 0.2, "min": 0.0, "max": 0.4, "n": 3})
    assert summary[1]["mean"] == pytest.approx(0.6) and summary[1]["std"] == pytest.approx(0.1)
    assert seed_summary({"one": history({0: 0.3})}, "val/reward") == [{"step": 0, "mean": 0.3, "std": 0.0, "min": 0.3, "max": 0.3, "n": 1}]
    assert seed_summary({}, "val/reward") == []


def test_plot_and_script_write_a_png_and_print_the_table(tmp_path):
    runs = {"s0": history({0: 0.0, 5: 0.5}), "s1": history({0: 0.2, 5: 0.9})}
    assert [s["step"] for s in plot_seeds(runs, "val/reward", tmp_path / "a.png")] == [0, 5]
    assert (tmp_path / "a.png").stat().st_size > 1000
    dirs = []
    for name, rows in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        dirs.append(str(tmp_path / name))
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "plot_seeds.py"), "--out", str(tmp_path / "b.png"), *dirs], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[-2:] == ["s0", "s1"]
    assert lines[1].split() == ["0", "0.100", "0.141", "0.000", "0.200", "0.000", "0.200"]
    assert lines[2].split() == ["5", "0.700", "0.283", "0.500", "0.900", "0.500", "0.900"]
    assert (tmp_path / "b.png").stat().st_size > 1000
