"""The demo (`make demo`) end to end on the real model, tiny settings: runs, logs, plots, resumes.

The first step runs in this process (the demo's own ``parse_args`` and ``main``); the rerun that
resumes it is a new process started as a user starts it (``python examples/demo.py``, which also
relaunches itself under jemalloc when one is installed)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.real_model
DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"


def demo_args(tmp_path: Path, steps: int) -> list[str]:
    return [
        "--steps", str(steps), "--inference", "transformers", "--groups-per-step", "1", "--rollouts", "2",
        "--val-tasks", "1", "--eval-every", "100", "--data", str(tmp_path / "data"), "--plot", str(tmp_path / "curve.png"),
        "--seed", "3",
    ]  # fmt: skip


def run_demo_here(tmp_path: Path, steps: int) -> None:
    sys.path.insert(0, str(DEMO.parent))  # it imports the examples' shared helpers
    try:
        spec = importlib.util.spec_from_file_location("demo", DEMO)
        demo = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(demo)  # type: ignore[union-attr]
    finally:
        sys.path.remove(str(DEMO.parent))
    asyncio.run(demo.main(demo.parse_args(demo_args(tmp_path, steps))))


def run_demo(tmp_path: Path, steps: int) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, str(DEMO), *demo_args(tmp_path, steps)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_demo_runs_logs_plots_and_resumes(tmp_path):
    run_demo_here(tmp_path, steps=1)
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
