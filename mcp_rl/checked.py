"""A checked-answer MCP•RL run: tasks and answers written in code, a shaped reward, train, summarise.

``examples/mcp_rl_calculator.py`` (our calculator server) and ``examples/mcp_rl_time_checked.py``
(``mcp-server-time``, a server nobody here wrote) are the same experiment on two servers: the
same flags, recipe settings, reward shape and summary.  They live here once so that the two
curves in README are measured by one loop, and a change to it reaches both.  What differs
between them — the server, the tasks, the reward's target call, the system prompt and the
worked examples — are the arguments.

The recipe: SmolLM2-135M (any base model) with a LoRA (r16, alpha 32), GRPO at T=1 on
``--groups-per-step`` tasks × ``--rollouts`` attempts, two turns, one MCP session shared per
group, greedy held-out tasks at step 0 and every ``--eval-every`` steps; the judge is an
:class:`~tracerl.mcp_rl.ExpectedAnswerJudge` (no LLM).  Rerunning continues from the newest
checkpoint (``train_mcp_agent`` resumes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import tracerl

from .judges import ExpectedAnswerJudge, Reward, final_answer, mentions
from .scenarios import Scenario
from .server import McpServerSpec
from .train import train_mcp_agent


def first_reply_text(trajectory: tracerl.Trajectory, task: Scenario) -> tuple[str, list[dict[str, Any]]]:
    """The agent's first reply to ``task`` as written (tool calls rebuilt in the chat template's
    ``<tool_call>`` form, since the server parses them out of the text) and its parsed calls."""
    messages = trajectory.messages()
    asked = max(i for i, m in enumerate(messages) if m.get("role") == "user" and m.get("content") == task.task)
    first = next((m for m in messages[asked:] if m.get("role") == "assistant"), {})
    calls = first.get("tool_calls") or []
    text = str(first.get("content") or "") + "".join(
        f'<tool_call>\n{{"name": "{c["function"]["name"]}", "arguments": {c["function"]["arguments"]}}}\n</tool_call>' for c in calls
    )
    return text, calls


def shaped_call_reward(
    task: Scenario,
    trajectory: tracerl.Trajectory,
    *,
    tool: str,
    pieces: Sequence[str],
    arguments_ok: Callable[[dict[str, Any]], bool],
) -> Reward:
    """0.3 × the share of ``pieces`` of the right call written in the first reply, +0.3 for calling
    ``tool`` first, +0.2 when ``arguments_ok`` accepts its arguments, +0.2 for a final answer that
    mentions ``task.metadata["answer"]``.

    Why shaped: a 135M model rarely writes a whole correct call at first, and GRPO learns nothing
    from a group whose rewards are all equal; partial credit for the call's pieces gives almost
    every group some spread (the demo's reward, ``examples/demo.py``, has the same shape)."""
    text, calls = first_reply_text(trajectory, task)
    score = 0.3 * sum(piece in text for piece in pieces) / len(pieces)
    tool_ok = bool(calls) and calls[0]["function"]["name"] == tool
    try:
        args = json.loads(calls[0]["function"]["arguments"]) if tool_ok else None
    except ValueError:
        args = None
    args_ok = isinstance(args, dict) and arguments_ok(args)
    answer_ok = mentions(final_answer(trajectory), task.metadata["answer"])
    score += 0.3 * tool_ok + 0.2 * args_ok + 0.2 * answer_ok
    metrics = {"tool_ok": float(tool_ok), "args_ok": float(args_ok), "answer_ok": float(answer_ok)}
    return Reward(round(score, 4), f"tool {tool_ok}, args {args_ok}, answer {answer_ok}", metrics)


def example_parser(description: str, *, max_tokens: int, plot: str | None = None) -> argparse.ArgumentParser:
    """The flags every checked-answer example takes; ``plot`` may contain ``{name}`` and ``{seed}``."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inference", choices=["auto", "vllm", "transformers"], default="auto")
    p.add_argument("--base-model", default="smollm2-135m")
    p.add_argument("--groups-per-step", type=int, default=2)
    p.add_argument("--rollouts", type=int, default=8, help="attempts per task")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens per model call")
    p.add_argument("--val-tasks", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--data", default=".tracerl")
    p.add_argument("--plot", default=plot, help=f"reward curve PNG; {{name}} and {{seed}} are replaced (default: {plot or 'reward_curve.png in the run directory'})")
    return p


@dataclass(frozen=True)
class CheckedExample:
    """What one checked-answer example brings; the loop around it is :func:`run_checked_example`."""

    name: str
    """Model name prefix: the run is ``<name>-s<seed>`` in project ``mcp-rl``."""
    title: str
    """Reward-curve title (", seed N" is appended)."""
    server: McpServerSpec
    judge: ExpectedAnswerJudge
    scenarios: Callable[[int, int, int], list[Scenario]]
    """``(seed, num_train, num_val)`` → train and held-out tasks, the same on every rerun."""
    system_prompt: str
    few_shot: list[dict[str, Any]]
    max_tokens: int = 40
    """Default ``--max-tokens`` per model call: room for the target call, not for rambling."""
    plot: str | None = None
    """Default ``--plot``; ``{name}`` and ``{seed}`` are replaced.  None: ``reward_curve.png`` in the run directory."""


async def run_checked_example(example: CheckedExample, args: argparse.Namespace) -> tracerl.TrainableModel:
    """Serve the policy, train it on ``example`` with :func:`example_parser`'s ``args``, close the
    backend (also on failure), then print held-out start → end and save the reward curve."""
    model = tracerl.TrainableModel(
        f"{example.name}-s{args.seed}", "mcp-rl", args.base_model, base_path=args.data, lora_config={"r": 16, "alpha": 32}
    )
    backend = tracerl.LocalBackend(inference=args.inference)
    started = time.monotonic()
    try:
        await model.register(backend)
        print(f"serving {model.get_inference_name()} at {model.inference_base_url} ({time.monotonic() - started:.0f}s)", flush=True)
        await train_mcp_agent(
            model, backend, example.server,
            judge=example.judge,
            scenarios=example.scenarios(args.seed, 200, args.val_tasks),
            steps=args.steps, groups_per_step=args.groups_per_step, rollouts_per_group=args.rollouts,
            val_every=args.eval_every, val_at_start=True, val_rollouts=1, val_temperature=0.0,
            max_turns=2, max_tokens=args.max_tokens, temperature=1.0, learning_rate=args.lr,
            system_prompt=example.system_prompt, few_shot=example.few_shot, share_session=True, seed=args.seed,
        )  # fmt: skip
    finally:
        await backend.close()
    plot = Path(args.plot.format(name=example.name, seed=args.seed)) if args.plot else model.run_dir.root / "reward_curve.png"
    summarize(model, plot, f"{example.title}, seed {args.seed}", time.monotonic() - started)
    return model


def parse_args(example: CheckedExample, description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """``argv`` parsed with ``example``'s defaults."""
    return example_parser(description, max_tokens=example.max_tokens, plot=example.plot).parse_args(argv)


def cli(example: CheckedExample, description: str, argv: list[str] | None = None) -> tracerl.TrainableModel:
    """An example's ``__main__``: flags, INFO logging (httpx's per-request lines off), the run."""
    args = parse_args(example, description, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return asyncio.run(run_checked_example(example, args))


def summarize(model: tracerl.TrainableModel, plot: Path, title: str, seconds: float) -> None:
    """Held-out reward at the first and last eval, wall time, and the reward curve saved to ``plot``."""
    from tracerl.runs.plots import plot_history

    rows = model.history()
    val = [(r["step"], r["val/reward"]) for r in rows if "val/reward" in r]
    out = plot_history(rows, ["train/reward", "val/reward"], plot, title=title)
    if val:
        print(f"held-out reward: start {val[0][1]:.3f} (step {val[0][0]}) -> end {val[-1][1]:.3f} (step {val[-1][0]})")
    print(f"wall time this run: {seconds / 60:.1f} min   reward curve: {out}   history: {model.run_dir.history_path}")
