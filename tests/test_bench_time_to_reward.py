"""bench/time_to_reward.py: time to target from the stored curves, bootstrap intervals, per-run storage.

The table in bench/RESULTS.md is regenerated from the committed raw JSON (``--table-only``).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import time_to_reward as ttr  # noqa: E402


def run(side: str, seed: int, curve: list[float], config: dict | None = None) -> dict:
    evals = [{"step": i, "train_seconds": 10.0 * i, "heldout_first_turn": r, "eval_seconds": 1.0} for i, r in enumerate(curve)]
    steps = [{"step": i, "seconds": 10.0, "sampled_tokens": 100.0, "forward_tokens": 1000.0} for i in range(1, len(curve))]
    return {"side": side, "seed": seed, "config": config or {"target": 0.6}, "evals": evals, "steps": steps,
            "train_seconds": 10.0 * (len(curve) - 1), "steps_run": len(curve) - 1}  # fmt: skip


def test_time_to_target_is_the_first_eval_at_or_above_it_and_inf_when_never() -> None:
    r = run("trl", 0, [0.0, 0.2, 0.65, 0.5, 0.8])
    assert ttr.time_to(r, 0.6) == (20.0, 2)
    assert ttr.time_to(r, 0.8) == (40.0, 4)
    assert ttr.time_to(r, 0.81) == (float("inf"), None)


def test_the_bootstrap_interval_brackets_the_median_and_is_reproducible() -> None:
    values = [30.0, 35.0, 41.0, 29.0, 60.0]
    lo, hi = ttr.bootstrap(values, statistics.median)
    assert lo <= statistics.median(values) <= hi
    assert min(values) <= lo and hi <= max(values)
    assert (lo, hi) == ttr.bootstrap(values, statistics.median)


def test_a_run_replaces_only_its_own_side_seed_and_config(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    ttr.store(path, run("trl", 0, [0.0, 0.1]))
    ttr.store(path, run("tracerl", 0, [0.0, 0.7]))
    ttr.store(path, run("trl", 0, [0.0, 0.1], config={"target": 0.5}))
    ttr.store(path, run("trl", 0, [0.0, 0.8]))
    runs = json.loads(path.read_text())["runs"]
    assert len(runs) == 3
    assert [r["evals"][-1]["heldout_first_turn"] for r in runs if r["side"] == "trl" and r["config"] == {"target": 0.6}] == [0.8]


def test_flops_count_sampled_tokens_twice_and_trained_tokens_four_times_over_the_clock() -> None:
    r = run("tracerl", 0, [0.0, 0.7])
    assert ttr.gflops(r) == (2 * ttr.PARAMETERS * 100 + 4 * ttr.PARAMETERS * 1000) / 10.0 / 1e9


def test_the_committed_table_is_regenerated_from_the_raw_json() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH / "time_to_reward.py"), "--table-only"], capture_output=True, text=True, check=True
    ).stdout
    results = (BENCH / "RESULTS.md").read_text()
    main = out.split("#### target")[1]  # the first configuration (lr 1e-4, 5 seeds); the others are in bench/history/
    rows = [line for line in main.splitlines() if line.startswith("| tracerl") or line.startswith("| TRL")]
    assert len(rows) == 2 and all(row in results for row in rows), out
    ratios = [line for line in main.splitlines() if line.startswith("TRL / tracerl ratio")]
    assert len(ratios) == 1 and ratios[0] in results
