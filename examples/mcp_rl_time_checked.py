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

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import tracerl
from tracerl.mcp_rl import ExpectedAnswerJudge, McpServerSpec, Reward, Scenario, final_answer, train_mcp_agent
from tracerl.mcp_rl.judges import mentions

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


def first_reply_text(trajectory: tracerl.Trajectory, task: Scenario) -> tuple[str, list[dict[str, Any]]]:
    """The agent's first reply as written (tool calls rebuilt in the chat template's form) and its calls."""
    messages = trajectory.messages()
    asked = max(i for i, m in enumerate(messages) if m.get("role") == "user" and m.get("content") == task.task)
    first = next((m for m in messages[asked:] if m.get("role") == "assistant"), {})
    calls = first.get("tool_calls") or []
    text = str(first.get("content") or "") + "".join(
        f'<tool_call>\n{{"name": "{c["function"]["name"]}", "arguments": {c["function"]["arguments"]}}}\n</tool_call>' for c in calls
    )
    return text, calls


def time_reward(task: Scenario, trajectory: tracerl.Trajectory) -> Reward:
    """0.3 × share of the right call's pieces written, +0.3 convert_time called, +0.2 right arguments, +0.2 right time stated."""
    m = task.metadata
    text, calls = first_reply_text(trajectory, task)
    keys = ("source_timezone", "time", "target_timezone")
    pieces = ["<tool_call>", '"name": "convert_time"', '"arguments": {', *(f'"{k}": "{m[k]}"' for k in keys), "</tool_call>"]
    score = 0.3 * sum(piece in text for piece in pieces) / len(pieces)
    tool_ok = bool(calls) and calls[0]["function"]["name"] == "convert_time"
    try:
        args = json.loads(calls[0]["function"]["arguments"]) if tool_ok else None
    except ValueError:
        args = None
    args_ok = isinstance(args, dict) and all(str(args.get(k, "")).strip() == m[k] for k in keys)
    answer_ok = mentions(final_answer(trajectory), m["answer"])
    score += 0.3 * tool_ok + 0.2 * args_ok + 0.2 * answer_ok
    metrics = {"tool_ok": float(tool_ok), "args_ok": float(args_ok), "answer_ok": float(answer_ok)}
    return Reward(round(score, 4), f"tool {tool_ok}, args {args_ok}, answer {answer_ok}", metrics)


async def main(args: argparse.Namespace) -> tracerl.TrainableModel:
    model = tracerl.TrainableModel(f"time-checked-s{args.seed}", "mcp-rl", args.base_model, base_path=args.data, lora_config={"r": 16, "alpha": 32})
    backend = tracerl.LocalBackend(inference=args.inference)
    started = time.monotonic()
    try:
        await model.register(backend)
        print(f"serving {model.get_inference_name()} at {model.inference_base_url} ({time.monotonic() - started:.0f}s)", flush=True)
        await train_mcp_agent(
            model, backend, time_server(),
            judge=ExpectedAnswerJudge(time_reward, name="time"),
            scenarios=make_scenarios(args.seed, 200, args.val_tasks),
            steps=args.steps, groups_per_step=args.groups_per_step, rollouts_per_group=args.rollouts,
            val_every=args.eval_every, val_at_start=True, val_rollouts=1, val_temperature=0.0,
            max_turns=2, max_tokens=args.max_tokens, temperature=1.0, learning_rate=args.lr,
            system_prompt=SYSTEM, few_shot=worked_examples(), share_session=True, seed=args.seed,
        )  # fmt: skip
    finally:
        await backend.close()
    summarize(model, args, time.monotonic() - started)
    return model


def summarize(model: tracerl.TrainableModel, args: argparse.Namespace, seconds: float) -> None:
    from tracerl.plots import plot_history

    rows = model.history()
    val = [(r["step"], r["val/reward"]) for r in rows if "val/reward" in r]
    plot = Path(args.plot or f"docs/mcp_rl_time_checked_seed{args.seed}.png")
    out = plot_history(rows, ["train/reward", "val/reward"], plot, title=f"mcp-server-time agent, seed {args.seed}")
    if val:
        print(f"held-out reward: start {val[0][1]:.3f} (step {val[0][0]}) -> end {val[-1][1]:.3f} (step {val[-1][0]})")
    print(f"wall time this run: {seconds / 60:.1f} min   reward curve: {out}   history: {model.run_dir.history_path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inference", choices=["auto", "vllm", "transformers"], default="auto")
    p.add_argument("--base-model", default="smollm2-135m")
    p.add_argument("--groups-per-step", type=int, default=2)
    p.add_argument("--rollouts", type=int, default=8, help="attempts per task")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per model call (a convert_time call is ~50)")
    p.add_argument("--val-tasks", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--data", default=".tracerl")
    p.add_argument("--plot", default=None, help="reward curve PNG (default: docs/mcp_rl_time_checked_seed{seed}.png)")
    return p.parse_args(argv)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    asyncio.run(main(parse_args()))
