"""The demo (`make demo`) end to end on the real model, tiny settings: runs, logs, plots, resumes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.real_model
DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"


def run_demo(tmp_path: Path, steps: int) -> subprocess.CompletedProcess:
    args = [
        sys.executable, str(DEMO), "--steps", str(steps), "--inference", "transformers", "--groups-per-step", "1",
        "--rollouts", "2", "--val-tasks", "2", "--eval-every", "100", "--data", str(tmp_path / "data"),
        "--plot", str(tmp_path / "curve.png"), "--seed", "3",
    ]
    out = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_demo_runs_logs_plots_and_resumes(tmp_path):
    run_demo(tmp_path, steps=1)
    run_dir = tmp_path / "data" / "demo" / "models" / "calculator-s3"
    assert (run_dir / "checkpoints" / "0001").is_dir()
    out = run_demo(tmp_path, steps=2)  # a rerun continues from step 1 instead of starting over
    assert "step 2/2" in out.stdout and "step 1/2" not in out.stdout
    rows = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in rows if "train/reward" in r]
    assert train_steps == [1, 2]
    val_steps = sorted(r["step"] for r in rows if "val/reward" in r)
    assert val_steps == [0, 1, 2]
    assert (tmp_path / "curve.png").stat().st_size > 1000
    trajectory = json.loads((run_dir / "trajectories" / "train" / "0002.jsonl").read_text().splitlines()[0])
    sampled = [m for m in trajectory["messages_and_choices"] if "token_ids" in m]
    assert sampled and all(m["token_ids"] and len(m["logprobs"]) == len(m["token_ids"]) for m in sampled)
