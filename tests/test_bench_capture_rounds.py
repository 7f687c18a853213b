"""bench/capture_rounds.py: one real round of the measured script, and the statistics over rounds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import capture_rounds  # noqa: E402


def _round(call_path: float, end: float, openinference: float) -> dict:
    return {
        "added_us": {"tracerl": {"cpu": call_path}, "openinference": {"cpu": openinference}},
        "rollout_end_us_per_call": end,
        "rollout_end_us_per_call_token_ids": 2 * end,
        "total_ratio_cpu": (call_path + end) / openinference,
        "uninstrumented_cpu_us": 2000.0,
    }


def test_a_round_runs_the_working_tree_and_captures_every_call() -> None:
    result = capture_rounds.run_round(20, False, None, capture_rounds.ROOT)
    assert result["every_call_captured"] and result["uninstrumented_cpu_us"] > 0
    assert "samples_us" not in result  # the per-call samples stay out of the rounds' JSON


def test_a_round_refuses_a_package_from_elsewhere(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="would import"):
        capture_rounds.run_round(20, False, None, tmp_path)


def test_pooled_and_median_ratios_over_rounds() -> None:
    rounds = [_round(10, 90, 500), _round(190, 90, 700), _round(100, 90, 600)]
    summary = capture_rounds.summarize(rounds)
    assert summary["pooled_ratio"] == pytest.approx((100 + 90) / 600)
    assert summary["total_ratio_median"] == pytest.approx(190 / 600)
    low, high = summary["pooled_ratio_ci95"]
    assert low <= summary["pooled_ratio"] <= high
    assert summary["share_at_or_under_goal"] == pytest.approx(1 / 3)  # ratios 0.20, 0.40, 0.32
    assert summary["parts_median_us"]["call path (cpu added)"] == 100
