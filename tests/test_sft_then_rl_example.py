"""``examples/sft_then_rl.py`` end to end on the real model with tiny settings: both arms run, results and plot written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.real_model
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sft_then_rl.py"


def test_sft_then_rl_and_distillation_arms_run(tmp_path):
    args = [
        sys.executable, str(EXAMPLE), "--inference", "transformers", "--seed", "5", "--val-tasks", "2", "--sft-tasks", "2",
        "--sft-samples", "2", "--min-reward", "0.5", "--sft-epochs", "1", "--rl-steps", "1", "--groups-per-step", "1",
        "--rollouts", "2", "--eval-every", "100", "--data", str(tmp_path / "data"),
        "--out", str(tmp_path / "out" / "sft_then_rl_s{seed}.json"), "--plot", str(tmp_path / "out" / "plot.png"),
    ]
    done = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "sft_then_rl_s5.json").read_text())
    arm = result["sft_then_rl"]
    assert [x for x, _ in arm["points"]] == [0, 4, 6]  # base, after SFT (4 few-shot attempts), after 1 GRPO step (2)
    assert arm["sft_examples"] >= 1
    distilled = result["distill"]
    assert [x for x, _ in distilled["points"]] == [0, 6]  # the same budget: 3 steps of 2 rollouts
    assert len(distilled["reverse_kl"]) == 3
    assert (tmp_path / "out" / "plot.png").stat().st_size > 0
    runs = tmp_path / "data" / "sft_then_rl" / "models"
    assert (runs / "sft-rl-s5" / "checkpoints" / "0002").is_dir() and (runs / "distill-s5" / "checkpoints" / "0003").is_dir()
