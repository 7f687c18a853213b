"""bench/RESULTS.md stays short and names every raw file of bench/results/, and only those that exist.

``bench/`` holds the scripts; ``bench/results/`` one current raw file per benchmark (or per
configuration), never one named after a commit (git history keeps superseded runs).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"
RAW = ROOT / "bench" / "results"
RAW_SUFFIXES = (".json", ".jsonl", ".txt")
sys.path.insert(0, str(ROOT / "bench"))

import run_all  # noqa: E402


def test_results_fit_in_15_kb() -> None:
    assert len(RESULTS.read_bytes()) <= 15_000


def named_raw_files() -> set[str]:
    """Raw files RESULTS.md names: by path (``bench/results/x.json``) or by name (```x.json``` in its table)."""
    text = RESULTS.read_text()
    paths = re.findall(r"bench/results/([\w./-]+\.(?:json|jsonl|txt))\b", text)
    names = re.findall(r"`([\w.-]+\.(?:json|jsonl|txt))`", text)
    return set(paths) | set(names)


def test_every_raw_file_named_exists() -> None:
    text = RESULTS.read_text()
    named = set(re.findall(r"bench/[\w./-]+\.(?:json|jsonl|txt|md)\b", text))
    assert sorted(p for p in named if not (ROOT / p).is_file()) == []
    assert named_raw_files(), "RESULTS.md names no raw file"
    assert sorted(n for n in named_raw_files() if not (RAW / n).is_file()) == []


def test_every_raw_result_is_in_results_and_named() -> None:
    assert sorted(p.name for p in (ROOT / "bench").iterdir() if p.suffix in RAW_SUFFIXES) == []
    top = {p.name for p in RAW.iterdir() if p.suffix in RAW_SUFFIXES}
    assert sorted(top - named_raw_files()) == []
    assert "`gallery/`" in RESULTS.read_text()


def test_no_raw_file_is_named_after_a_commit() -> None:
    commit_like = re.compile(r"(?:^|[_-])[0-9a-f]{7,40}(?=[_.-])")
    assert sorted(str(p.relative_to(RAW)) for p in RAW.rglob("*") if commit_like.search(p.name)) == []


def test_every_benchmark_of_make_bench_has_a_section() -> None:
    text = RESULTS.read_text()
    scripts = {run_all.SCRIPTS.get(name, name) for name in run_all.BENCHMARKS}
    assert sorted(s for s in scripts if f"(`bench/{s}.py`)" not in text) == []
