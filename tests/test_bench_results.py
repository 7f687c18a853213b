"""bench/RESULTS.md stays short and names only raw files that are in the repository."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"
sys.path.insert(0, str(ROOT / "bench"))

import run_all  # noqa: E402


def test_results_fit_in_15_kb() -> None:
    assert len(RESULTS.read_bytes()) <= 15_000


def test_every_raw_file_named_exists() -> None:
    named = set(re.findall(r"bench/[\w./-]+\.(?:json|jsonl|txt|md)\b", RESULTS.read_text()))
    assert named, "RESULTS.md names no raw file"
    assert sorted(p for p in named if not (ROOT / p).is_file()) == []


def test_every_benchmark_of_make_bench_has_a_section() -> None:
    text = RESULTS.read_text()
    scripts = {run_all.SCRIPTS.get(name, name) for name in run_all.BENCHMARKS}
    assert sorted(s for s in scripts if f"(`bench/{s}.py`)" not in text) == []
