"""Capture's whole cost per call in CPU instructions, side by side: deterministic where timings are not.

    python bench/capture_instructions.py [--turns] [--rollouts 5,25] [--rollout-calls 10] [--json PATH]

Why: on this shared 2-core machine the same ``capture_overhead.py`` run gives total ratios from
0.16 to 0.5 within an hour (the uninstrumented call itself moves between 1.0 and 2.6 ms), so a
change of 10% in capture's cost cannot be seen in timings.  Instructions executed do not depend
on the neighbours.  Each mode (the plain ``openai`` client, tracerl's capture in rollouts,
OpenInference's OpenAI instrumentation with an SDK tracer provider and no exporter) runs the
same calls as ``capture_overhead.py`` against the same local server, in a child process under
valgrind (``--tool=cachegrind``, whole process, every thread); the server runs in its own,
uncounted process.  Each mode runs twice, with two numbers of rollouts: the difference divided
by the difference in calls is the cost of one call in steady state, with start-up, imports and
warm-up cancelled.  It includes everything capture does for a call wherever it happens (the call
path, the rollout's enter and exit: spans, trajectory, redaction).

Instructions are not time (a cache miss costs more than an add), so ``capture_overhead.py``'s
timings are reported beside these counts; the counts are what a change can be checked against
(``bench/RESULTS.md`` leads with them because at this machine's noise timings cannot rank two
versions).  Needs
``valgrind`` (``make install-valgrind``); about 95 s per run on 2 cores (two children at a time).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BENCH = Path(__file__).resolve().parent
MODES = ("uninstrumented", "tracerl", "openinference")


def run_worker(mode: str, rollouts: int, rollout_calls: int, turns: bool) -> None:
    """The measured program: ``rollouts`` rollouts of ``rollout_calls`` calls in ``mode``."""
    sys.path.insert(0, str(BENCH))
    from capture_overhead import TOOLS, Workload, start_server
    from openai import OpenAI
    from opentelemetry.sdk.trace import TracerProvider

    import tracerl.integrations as ti

    process, base_url = start_server()
    try:
        client = OpenAI(base_url=base_url, api_key="x", max_retries=0)
        ti.configure_tracing(TracerProvider())  # as in capture_overhead.py: configured in every mode
        if mode == "tracerl":
            ti.instrument("openai")
        elif mode == "openinference":
            from openinference.instrumentation.openai import OpenAIInstrumentor

            OpenAIInstrumentor().instrument(tracer_provider=TracerProvider())
        workload = Workload(turns=turns, rollout_calls=rollout_calls)
        for _ in range(rollouts):
            workload.restart()
            scope = ti.rollout() if mode == "tracerl" else contextlib.nullcontext()
            with scope:
                for _ in range(rollout_calls):
                    result = client.chat.completions.create(model="m", messages=workload.next_messages(), tools=TOOLS)
                    if turns:
                        workload.answered(result.choices[0].message.model_dump(exclude_none=True))
            if mode == "tracerl":
                trajectory = scope.trajectory
                if trajectory.metrics["capture_model_calls"] != rollout_calls:
                    raise SystemExit(f"tracerl captured {trajectory.metrics['capture_model_calls']} calls, not {rollout_calls}")
                if turns and trajectory.additional_histories:  # the calls resend each answer: one conversation
                    raise SystemExit(f"a rollout of turns became {1 + len(trajectory.additional_histories)} histories, not 1")
    finally:
        process.terminate()
        process.wait(timeout=10)


def count_instructions(mode: str, rollouts: int, rollout_calls: int, turns: bool, valgrind: str) -> int:
    """Instructions the whole worker process executed (valgrind cachegrind's ``summary`` line)."""
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "cachegrind.out"
        command = [
            valgrind, "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out}",
            sys.executable, __file__, "--worker", mode, "--rollouts", str(rollouts), "--rollout-calls", str(rollout_calls),
        ] + (["--turns"] if turns else [])  # fmt: skip
        env = {**os.environ, "PYTHONHASHSEED": "0"}  # same dict layouts in every run
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{mode} x{rollouts} failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
        return summary_instructions(out.read_text(), f"{mode} x{rollouts}")


def summary_instructions(cachegrind_out: str, what: str) -> int:
    """The instruction total of a cachegrind output file (its ``summary:`` line, events ``Ir``)."""
    match = re.search(r"^summary:\s+(\d+)", cachegrind_out, re.MULTILINE)
    if match is None:
        raise SystemExit(f"no summary line in cachegrind's output for {what}")
    return int(match.group(1))


def main() -> None:
    sys.path.insert(0, str(BENCH))
    from capture_overhead import write_raw

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", action="store_true", help="each rollout's calls form one growing conversation")
    parser.add_argument("--rollouts", default="5,25", help="the two numbers of rollouts whose difference is measured")
    parser.add_argument("--rollout-calls", type=int, default=10, help="model calls per rollout")
    parser.add_argument("--json", type=Path, default=None, help="write the raw counts and the summary here")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args.worker, int(args.rollouts), args.rollout_calls, args.turns)
        return
    small, large = (int(n) for n in args.rollouts.split(","))
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("valgrind is not installed: apt-get install valgrind")
    if large <= small:
        raise SystemExit("--rollouts: the second number must be larger than the first")

    started = time.monotonic()
    jobs = [(mode, n) for mode in MODES for n in (small, large)]
    with ThreadPoolExecutor(max_workers=2) as pool:  # the two cores; counts do not depend on contention
        counts = dict(zip(jobs, pool.map(lambda job: count_instructions(*job, args.rollout_calls, args.turns, valgrind), jobs)))
    calls = (large - small) * args.rollout_calls
    per_call = {mode: (counts[(mode, large)] - counts[(mode, small)]) / calls for mode in MODES}
    added = {mode: per_call[mode] - per_call["uninstrumented"] for mode in MODES}
    ratio = added["tracerl"] / added["openinference"] if added["openinference"] > 0 else None

    shape = f"rollouts of {args.rollout_calls}-turn conversations" if args.turns else "the same two messages per call"
    print(f"instructions per call, whole client process (valgrind), {shape}, {args.rollout_calls} calls per rollout;")
    print(f"difference of {large} and {small} rollouts ({calls} calls) per mode; {time.monotonic() - started:.0f} s")
    print(f"{'mode':<16}{'per call':>14}{'added':>14}{'added %':>10}")
    for mode in MODES:
        share = 100 * added[mode] / per_call["uninstrumented"]
        print(f"{mode:<16}{per_call[mode]:>14,.0f}{added[mode]:>14,.0f}{share:>9.1f}%")
    if ratio is not None:
        print(f"tracerl added (call path + rollout end) / OpenInference added = {ratio:.2f}")
    if args.json is not None:
        write_raw(
            args.json,
            shape,
            indent=2,
            rollout_calls=args.rollout_calls,
            rollouts=[small, large],
            instructions={f"{mode} x{n}": count for (mode, n), count in counts.items()},
            per_call=per_call,
            added_per_call=added,
            ratio_tracerl_to_openinference=ratio,
        )


if __name__ == "__main__":
    main()
