"""bench/demo_step.py regenerates its RESULTS.md table from the committed raw JSON, and counts tokens right."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import demo_step  # noqa: E402

import tracerl  # noqa: E402


def test_the_committed_table_is_regenerated_from_the_raw_json() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH / "demo_step.py"), "--table-only", str(BENCH / "demo_step.json")],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    results = (BENCH / "RESULTS.md").read_text()
    rows = [line for line in out.splitlines() if line.startswith("| old:") or line.startswith("| new:")]
    assert len(rows) == 2 and all(row in results for row in rows), out
    assert "new / old median s/step" in out


def test_sampled_and_prompt_tokens_are_counted_per_sampled_turn() -> None:
    sampled = tracerl.Choice(message={"role": "assistant", "content": "x"}, token_ids=[1, 2, 3], prompt_token_ids=[7] * 10)
    context = {"role": "user", "content": "hi"}
    group = tracerl.TrajectoryGroup([tracerl.Trajectory(messages_and_choices=[context, sampled, context, sampled], reward=0.0)])
    assert demo_step.token_counts([group]) == (6, 20)


def test_a_step_summary_is_its_median_split_and_its_share_of_the_ceiling() -> None:
    step = {"wall_seconds": 10.0, "sampled_tokens": 100, "forward_tokens": 1000, "sampler_trainer_prob_corr": 0.99, "train_reward": 0.5}
    step.update({key: 1.0 for key in demo_step.SPLIT})
    summary = demo_step.summarize({"steps": [step, {**step, "wall_seconds": 20.0}]}, {"matmul_gflops": 100.0})
    assert summary["median_wall"] == 15.0 and summary["rollout_seconds"] == 1.0
    flops = 2 * demo_step.PARAMETERS * 100 + 6 * demo_step.PARAMETERS * 1000
    assert abs(summary["gflops"] - (flops / 10 / 1e9 + flops / 20 / 1e9) / 2) < 1e-9
    assert abs(summary["percent_of_ceiling"] - summary["gflops"]) < 1e-9  # ceiling of 100 GFLOP/s
