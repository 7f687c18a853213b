"""bench/capture_instructions.py: the program it counts runs, and its counts are read right.

The benchmark itself needs valgrind and minutes; here its worker (the measured program, without
valgrind) runs for real against the local fake server, so a change in capture or in the SDKs
that breaks the benchmark fails here first.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import capture_instructions  # noqa: E402


@pytest.mark.parametrize("mode", ["tracerl", "openinference"])
def test_the_counted_program_runs_each_mode(mode: str) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / "capture_instructions.py"), "--worker", mode, "--rollouts", "2", "--rollout-calls", "3", "--turns"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_turns_resend_the_models_answer_and_reply_to_it() -> None:
    """An agent's loop: the answer it got, then a result for each tool call (else a new user turn)."""
    from capture_overhead import MESSAGES, Workload

    workload = Workload(turns=True, rollout_calls=3)
    assert workload.next_messages() == MESSAGES
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    workload.answered({"role": "assistant", "tool_calls": [call]})
    second = workload.next_messages()
    assert [m["role"] for m in second] == ["system", "user", "assistant", "tool"]
    assert second[2]["tool_calls"] == [call] and second[3]["tool_call_id"] == "c1"
    workload.answered({"role": "assistant", "content": "Paris"})
    assert [m["role"] for m in workload.next_messages()][4:] == ["assistant", "user"]
    assert workload.next_messages() == MESSAGES  # the fourth call starts the next conversation


def test_the_instruction_total_is_the_summary_line() -> None:
    out = "desc: I1 cache: 32768 B\ncmd: python x.py\nevents: Ir\nfl=a.c\n10 5\nsummary: 7015816766\n"
    assert capture_instructions.summary_instructions(out, "x") == 7015816766
    with pytest.raises(SystemExit, match="no summary line"):
        capture_instructions.summary_instructions("events: Ir\n", "tracerl x5")
