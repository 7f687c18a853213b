"""The ceiling probe that every benchmark reports its figures against (bench/ceiling.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import ceiling  # noqa: E402


def test_probes_measure_positive_rates_per_size() -> None:
    by_size = ceiling.matmul_gflops(sizes=(128, 256), repeats=1)
    assert set(by_size) == {"128", "256"}
    assert all(rate > 0 for rate in by_size.values())
    assert ceiling.copy_gbps(mib=4, repeats=1) > 0


def test_percent_of_the_ceiling_and_its_description() -> None:
    measured = {
        "matmul_gflops": 200.0,
        "matmul_gflops_by_size": {"1024": 150.0, "2048": 200.0},
        "copy_gbps": 20.0,
        "torch_threads": 2,
        "load_average_1_5_15": [1.0, 0.5, 0.25],
        "measured_at": "2026-12-01T00:00:00+00:00",
    }
    assert ceiling.percent_of_matmul(50.0, measured) == 25.0
    assert ceiling.percent_of_copy(5.0, measured) == 25.0
    line = ceiling.describe(measured)
    assert "200.0 GFLOP/s" in line and "load average 1.00, 0.50, 0.25" in line


def test_make_bench_runs_only_scripts_that_exist() -> None:
    sys.path.insert(0, str(BENCH))
    import run_all

    for name in run_all.BENCHMARKS:
        assert (BENCH / f"{run_all.SCRIPTS.get(name, name)}.py").exists(), name
    listed = subprocess.run([sys.executable, str(BENCH / "run_all.py"), "--list"], capture_output=True, text=True, check=True)
    assert "grpo_step: bench/grpo_step.py" in listed.stdout
