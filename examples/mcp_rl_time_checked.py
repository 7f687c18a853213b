"""An agent on an MCP server nobody here wrote learns: SmolLM2-135M on ``mcp-server-time``, answers checked in code.

The server is the MCP project's reference time server (``pip install mcp-server-time``, run
over stdio as ``python -m mcp_server_time --local-timezone UTC``; tools ``get_current_time``
and ``convert_time``).  The tasks are written here — "Convert 14:30 from Asia/Tokyo to
Asia/Kolkata. Use the tools." — with the answer ("11:00") computed with ``zoneinfo``, split
into train and held-out with a fixed seed, and passed to ``train_mcp_agent(scenarios=...)``:
no generator model, no LLM judge.  The judge is ``ExpectedAnswerJudge(time_reward)``, shaped
like the calculator's: up to 0.3 for writing the pieces of the right ``convert_time`` call,
+0.3 for calling ``convert_time``, +0.2 for the right arguments, +0.2 for a final answer that
states the right time.

Why only timezones without daylight saving time: ``convert_time`` converts on *today's* date
in the source zone (the server takes no date), so an answer is fixed only where the offset
never changes; :data:`ZONES` holds such zones and :func:`expected_time` checks, for every task,
that a winter and a summer date give the same answer.

Policy, backend and loop are the calculator example's (LoRA r16, lr 1e-4, 2 tasks × 8 attempts
at T=1 per step, two worked examples before each task, greedy held-out tasks at step 0 and every
``--eval-every`` steps, a reward curve at the end; rerunning continues from the newest checkpoint).

    python examples/mcp_rl_time_checked.py --steps 15 --seed 0
"""

from __future__ import annotations

import json
import random
import sys
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

import tracerl
from tracerl.mcp_rl import ExpectedAnswerJudge, McpServerSpec, Reward, Scenario
from tracerl.mcp_rl.checked import CheckedExample, cli, shaped_call_reward

ZONES = [
    "UTC", "Asia/Tokyo", "Asia/Kolkata", "Asia/Shanghai", "Asia/Dubai", "Africa/Nairobi", "America/Bogota",
    "Australia/Brisbane", "Africa/Lagos", "America/Sao_Paulo", "Asia/Jakarta", "Asia/Karachi", "Pacific/Honolulu",
    "Europe/Moscow", "Africa/Johannesburg", "Asia/Dhaka",
]  # fmt: skip
"""IANA zones whose UTC offset does not change over the year (no daylight saving time)."""
EXAMPLE_ZONES = [("America/Phoenix", "Asia/Kathmandu"), ("Asia/Kathmandu", "America/Phoenix")]
"""Zones only the worked examples use (also DST-free), so held-out tasks are not copies of them."""
CHECK_DATES = (datetime(2026, 1, 15), datetime(2026, 7, 15))
SYSTEM = (
    "You are a time zone assistant. You never convert times in your head: you call the convert_time tool "
    "with the two IANA timezone names and the time in HH:MM, then you state the converted time."
)


def time_server() -> McpServerSpec:
    """``mcp-server-time`` over stdio, run by this interpreter (so it is the same environment)."""
    return McpServerSpec(command=sys.executable, args=("-m", "mcp_server_time", "--local-timezone", "UTC"))


def expected_time(source: str, hhmm: str, target: str) -> str:
    """``hhmm`` in ``source`` as HH:MM in ``target``; raises if the answer would depend on the date."""
    hour, minute = (int(part) for part in hhmm.split(":"))
    answers = {
        day.replace(hour=hour, minute=minute, tzinfo=ZoneInfo(source)).astimezone(ZoneInfo(target)).strftime("%H:%M") for day in CHECK_DATES
    }
    if len(answers) != 1:
        raise ValueError(f"{source} -> {target} at {hhmm} depends on the date ({sorted(answers)}): use zones without DST")
    return answers.pop()


def make_task(rng: random.Random, split: str) -> Scenario:
    """One conversion between two zones with different offsets (else the answer is the question's time)."""
    while True:
        source, target = rng.sample(ZONES, 2)
        hhmm = f"{rng.randint(0, 23):02d}:{rng.randrange(0, 60, 5):02d}"
        answer = expected_time(source, hhmm, target)
        if answer != hhmm:
            break
    return Scenario(
        f"Convert {hhmm} from {source} to {target}. Use the tools.",
        split=split,
        metadata={"source_timezone": source, "time": hhmm, "target_timezone": target, "answer": answer},
    )


def make_scenarios(seed: int, num_train: int, num_val: int) -> list[Scenario]:
    """Train and held-out tasks from two separate seeded streams (the same on every rerun); no
    held-out task is also a training task."""
    train = [make_task(random.Random(seed * 1_000 + i), "train") for i in range(num_train)]
    seen, val, i = {t.task for t in train}, [], 0
    while len(val) < num_val:
        task = make_task(random.Random(10_000_000 + seed * 1_000 + i), "val")
        i += 1
        if task.task not in seen:
            seen.add(task.task)
            val.append(task)
    return train + val


def server_result(source: str, hhmm: str, target: str, day: datetime = CHECK_DATES[0]) -> str:
    """What ``convert_time`` returns (its JSON text block), for the worked examples."""
    hour, minute = (int(part) for part in hhmm.split(":"))
    src = day.replace(hour=hour, minute=minute, tzinfo=ZoneInfo(source))
    dst = src.astimezone(ZoneInfo(target))
    hours = ((dst.utcoffset() or 0) - (src.utcoffset() or 0)).total_seconds() / 3600  # type: ignore[operator]
    diff = f"{hours:+.1f}h" if hours.is_integer() else f"{hours:+.2f}".rstrip("0").rstrip(".") + "h"

    def side(zone: str, moment: datetime) -> dict[str, Any]:
        return {"timezone": zone, "datetime": moment.isoformat(timespec="seconds"), "day_of_week": moment.strftime("%A"), "is_dst": False}

    return json.dumps({"source": side(source, src), "target": side(target, dst), "time_difference": diff}, indent=2)


def worked_examples() -> list[dict[str, Any]]:
    """Two solved tasks shown before each real one: a 135M model needs them to write a tool call at all."""
    messages: list[dict[str, Any]] = []
    for i, ((source, target), hhmm) in enumerate(zip(EXAMPLE_ZONES, ["09:15", "18:40"])):
        args = {"source_timezone": source, "time": hhmm, "target_timezone": target}
        call = {"id": f"call_{i}", "type": "function", "function": {"name": "convert_time", "arguments": json.dumps(args)}}
        messages += [
            {"role": "user", "content": f"Convert {hhmm} from {source} to {target}. Use the tools."},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": server_result(source, hhmm, target)},
            {"role": "assistant", "content": f"{hhmm} in {source} is {expected_time(source, hhmm, target)} in {target}."},
        ]
    return messages


def time_reward(task: Scenario, trajectory: tracerl.Trajectory) -> Reward:
    """0.3 × share of the right call's pieces written, +0.3 convert_time called, +0.2 right arguments, +0.2 right time stated."""
    m = task.metadata
    keys = ("source_timezone", "time", "target_timezone")
    pieces = ["<tool_call>", '"name": "convert_time"', '"arguments": {', *(f'"{k}": "{m[k]}"' for k in keys), "</tool_call>"]
    return shaped_call_reward(
        task, trajectory, tool="convert_time", pieces=pieces, arguments_ok=lambda a: all(str(a.get(k, "")).strip() == m[k] for k in keys)
    )


EXAMPLE = CheckedExample(
    name="time-checked", title="mcp-server-time agent", server=time_server(),
    judge=ExpectedAnswerJudge(time_reward, name="time"), scenarios=make_scenarios,
    system_prompt=SYSTEM, few_shot=worked_examples(), max_tokens=64,  # a convert_time call is ~50 tokens
)  # fmt: skip


if __name__ == "__main__":
    cli(EXAMPLE, __doc__ or "")
