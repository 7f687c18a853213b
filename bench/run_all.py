"""``make bench``: run every benchmark script and keep its raw output in ``bench/raw/``.

Each script runs in its own process with the command written in ``BENCHMARKS`` (the one its
``RESULTS.md`` section quotes); the machine's ceiling (:mod:`ceiling`) is measured in the same
invocation right before it, so every figure can be read as a share of what the machine could
do at that moment.  For each script ``bench/raw/<name>.json`` records the command, the
ceiling, the return code, the wall time and the full stdout/stderr; scripts that write their
own JSON are pointed into ``bench/raw/`` too.  ``bench/raw/`` is git-ignored scratch: a run
becomes the current result when its JSON is copied over the file in ``bench/results/`` that
``RESULTS.md`` names.  Run it under ``flock /tmp/tracerl-heavy.lock``
(the Makefile does): the whole set takes well over an hour on 2 cores.

    .venv/bin/python bench/run_all.py [--only grpo_step,serving_speed] [--list]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RAW = BENCH / "raw"

# name -> arguments after `python bench/<name>.py` ({raw} is bench/raw); SCRIPTS names the
# script where one runs twice with other arguments
SCRIPTS = {
    "capture_overhead_turns": "capture_overhead",
    "capture_instructions_turns": "capture_instructions",
    "capture_rounds_turns": "capture_rounds",
}
BENCHMARKS: dict[str, list[str]] = {
    "ceiling": ["--json", "{raw}/ceiling_only.json"],
    "serving_speed": ["--json", "{raw}/serving_speed_results.json"],
    "rollout_throughput": ["--repeats", "4", "--json", "{raw}/rollout_throughput_results.json"],
    "grpo_step": ["--sequences", "16", "--prompt-tokens", "300", "--completion-tokens", "40", "--steps", "5",
                  "--warmup", "1", "--json", "{raw}/grpo_step_results.json"],
    "time_to_reward": ["--seeds", "0,1,2,3,4", "--results", "{raw}/time_to_reward_results.json"],
    "demo_step": ["--steps", "4", "--json", "{raw}/demo_step_results.json"],
    "allocator_step": ["--rounds", "2", "--steps", "3", "--json", "{raw}/allocator_step_results.json"],
    "capture_overhead": ["--calls", "1000", "--json", "{raw}/capture_overhead_results.json"],
    "capture_overhead_turns": ["--calls", "1000", "--turns", "--json", "{raw}/capture_overhead_turns_results.json"],
    "capture_instructions": ["--json", "{raw}/capture_instructions_results.json"],
    "capture_instructions_turns": ["--turns", "--json", "{raw}/capture_instructions_turns_results.json"],
    "capture_rounds": ["--rounds", "20", "--json", "{raw}/capture_rounds_results.json"],
    "capture_rounds_turns": ["--rounds", "20", "--turns", "--json", "{raw}/capture_rounds_turns_results.json"],
    "capture_memory": [],
    "langgraph_overhead": [],
    "pipeline": ["--seeds", "0,1,2", "--results", "{raw}/pipeline_results.json"],
    "multitenant": ["--json", "{raw}/multitenant_results.json"],
    "bf16_floor": ["--json", "{raw}/bf16_floor_results.json"],
}  # fmt: skip


def run_one(name: str, arguments: list[str]) -> dict[str, object]:
    sys.path.insert(0, str(BENCH))
    from ceiling import measure_ceiling

    script = SCRIPTS.get(name, name)
    command = [sys.executable, str(BENCH / f"{script}.py"), *(a.format(raw=RAW) for a in arguments)]
    ceiling = measure_ceiling()
    started = time.monotonic()
    print(f"== {name}: {' '.join(command)}", flush=True)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    print(done.stdout[-3000:], flush=True)
    return {
        "benchmark": name,
        "command": command,
        "ceiling": ceiling,
        "returncode": done.returncode,
        "wall_seconds": time.monotonic() - started,
        "stdout": done.stdout,
        "stderr": done.stderr[-20000:],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated subset of the benchmarks")
    parser.add_argument("--list", action="store_true", help="print the commands and exit")
    args = parser.parse_args()
    wanted = [n for n in args.only.split(",") if n] or list(BENCHMARKS)
    unknown = sorted(set(wanted) - set(BENCHMARKS))
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}; known: {sorted(BENCHMARKS)}")
    if args.list:
        for name in wanted:
            print(f"{name}: bench/{SCRIPTS.get(name, name)}.py {' '.join(BENCHMARKS[name])}")
        return
    RAW.mkdir(exist_ok=True)
    failed = []
    for name in wanted:
        record = run_one(name, BENCHMARKS[name])
        (RAW / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
        if record["returncode"] != 0:
            failed.append(name)
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)} (see bench/raw/<name>.json)")


if __name__ == "__main__":
    main()
