"""``examples/sft_then_rl.py`` end to end on the real model: both arms run, results and plot written.

``make test`` runs it tiny (:data:`CONFIG`): 1 held-out task, 1 few-shot attempt (seeded; rejection
sampling must keep it: reward >= 0.5 needs a parsed ``add`` call), SFT on it, 1 GRPO step of 3 rollouts,
then distillation on the same budget (1 step of 3).  ``TRACERL_FULL=1`` (``make test-long``) runs the
full configuration: 2 held-out tasks, 4 attempts, 1 GRPO step of 2, 3 distillation steps.  Either way in this process (the example's own
``parse_args`` and ``main``), as ``tests/test_gallery.py`` runs the gallery.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from suite_size import tiny_or_full

pytestmark = pytest.mark.real_model
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CONFIG = tiny_or_full(
    {"val_tasks": 1, "sft_tasks": 1, "sft_samples": 1, "rollouts": 3, "distill_steps": 1},
    {"val_tasks": 2, "sft_tasks": 2, "sft_samples": 2, "rollouts": 2, "distill_steps": 3},
)
"""Held-out tasks; training tasks attempted with worked examples, and attempts each; rollouts per GRPO (and
distillation) step; the distillation steps that budget buys (``round((attempts + rollouts) / rollouts)``)."""


def _example():
    sys.path.insert(0, str(EXAMPLES))  # it imports the demo's tool, prompt and scoring
    try:
        spec = importlib.util.spec_from_file_location("sft_then_rl", EXAMPLES / "sft_then_rl.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    finally:
        sys.path.remove(str(EXAMPLES))
    return module


def test_sft_then_rl_and_distillation_arms_run(tmp_path, monkeypatch):
    example = _example()
    argv = [
        "sft_then_rl.py", "--inference", "transformers", "--seed", "5", "--val-tasks", str(CONFIG["val_tasks"]),
        "--sft-tasks", str(CONFIG["sft_tasks"]), "--sft-samples", str(CONFIG["sft_samples"]), "--min-reward", "0.5", "--sft-epochs", "1",
        "--rl-steps", "1", "--groups-per-step", "1", "--rollouts", str(CONFIG["rollouts"]), "--eval-every", "100",
        "--data", str(tmp_path / "data"), "--out", str(tmp_path / "out" / "sft_then_rl_s{seed}.json"),
        "--plot", str(tmp_path / "out" / "plot.png"),
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    asyncio.run(example.main(example.parse_args()))
    result = json.loads((tmp_path / "out" / "sft_then_rl_s5.json").read_text())
    attempts, rollouts, steps = CONFIG["sft_tasks"] * CONFIG["sft_samples"], CONFIG["rollouts"], CONFIG["distill_steps"]
    arm = result["sft_then_rl"]
    assert [x for x, _ in arm["points"]] == [0, attempts, attempts + rollouts]  # base, after SFT, after 1 GRPO step
    assert arm["sft_examples"] >= 1
    distilled = result["distill"]
    assert [x for x, _ in distilled["points"]] == [0, steps * rollouts]  # the same budget, in whole steps
    assert len(distilled["reverse_kl"]) == steps
    assert (tmp_path / "out" / "plot.png").stat().st_size > 0
    runs = tmp_path / "data" / "sft_then_rl" / "models"
    assert (runs / "sft-rl-s5" / "checkpoints" / "0002").is_dir()
    assert (runs / "distill-s5" / "checkpoints" / f"{steps:04d}").is_dir()
