"""MCP•RL on a laptop CPU, no hosted LLM: SmolLM2-135M learns to use a calculator MCP server.

The MCP server is real (``examples/mcp_calculator_server.py``, stdio, tools ``add`` and
``multiply``).  The tasks are written here, with their answers ("What is 372 + 845? Use the
tools.", answer 1217), split into train and held-out with a fixed seed, and passed to
``train_mcp_agent(scenarios=...)`` — no generator model.  The judge is verifiable —
``ExpectedAnswerJudge(calculator_reward)``, no LLM judge: shaped like ``examples/demo.py``,
up to 0.3 for writing the pieces of the right tool call, +0.3 for a call of the right tool,
+0.2 for the right arguments, +0.2 for a final answer that contains the right result.

The policy is served by a ``LocalBackend`` (vLLM when installed, else the transformers
server) and trained with GRPO on a LoRA (r16, lr 1e-4, 2 tasks × 8 attempts per step, like
the demo).  Held-out tasks are answered greedily before training and every ``--eval-every``
steps; at the end a reward curve is saved.  Rerunning continues from the newest checkpoint.

    python examples/mcp_rl_calculator.py --steps 15 --inference auto
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from pathlib import Path

import tracerl
from tracerl.mcp_rl import ExpectedAnswerJudge, McpServerSpec, Reward, Scenario, final_answer, train_mcp_agent
from tracerl.mcp_rl.judges import mentions

HERE = Path(__file__).resolve().parent
OPS = {"+": ("add", lambda a, b: a + b), "*": ("multiply", lambda a, b: a * b)}
SYSTEM = (
    "You are a calculator agent. You never compute in your head: you call the add or the multiply tool, "
    "then you state the result."
)


def calculator_server() -> McpServerSpec:
    """The example's MCP server over stdio, run by this interpreter."""
    return McpServerSpec(command=sys.executable, args=(str(HERE / "mcp_calculator_server.py"),))


def make_task(rng: random.Random, split: str) -> Scenario:
    op = rng.choice(sorted(OPS))
    a, b = (rng.randint(100, 999), rng.randint(100, 999)) if op == "+" else (rng.randint(11, 99), rng.randint(11, 99))
    tool, fn = OPS[op]
    return Scenario(f"What is {a} {op} {b}? Use the tools.", split=split, metadata={"tool": tool, "a": a, "b": b, "answer": str(fn(a, b))})


def make_scenarios(seed: int, num_train: int, num_val: int) -> list[Scenario]:
    """Train and held-out tasks from two separate seeded streams (the same on every rerun)."""
    train = [make_task(random.Random(seed * 1_000 + i), "train") for i in range(num_train)]
    val = [make_task(random.Random(10_000_000 + seed * 1_000 + i), "val") for i in range(num_val)]
    return train + val


def worked_examples() -> list[dict]:
    """Two solved tasks shown before each real one (one per tool): a 135M model needs them to
    write a tool call at all (see ``examples/demo.py``)."""
    messages: list[dict] = []
    for i, (a, op, b) in enumerate([(12, "+", 30), (7, "*", 23)]):
        tool, fn = OPS[op]
        call = {"id": f"call_{i}", "type": "function", "function": {"name": tool, "arguments": json.dumps({"a": a, "b": b})}}
        messages += [
            {"role": "user", "content": f"What is {a} {op} {b}? Use the tools."},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": str(fn(a, b))},
            {"role": "assistant", "content": f"The answer is {fn(a, b)}."},
        ]
    return messages


def first_reply_text(trajectory: tracerl.Trajectory, task: Scenario) -> tuple[str, list[dict]]:
    """The agent's first reply as written (tool calls rebuilt in the chat template's form) and its calls."""
    messages = trajectory.messages()
    asked = max(i for i, m in enumerate(messages) if m.get("role") == "user" and m.get("content") == task.task)
    first = next((m for m in messages[asked:] if m.get("role") == "assistant"), {})
    calls = first.get("tool_calls") or []
    text = str(first.get("content") or "") + "".join(
        f'<tool_call>\n{{"name": "{c["function"]["name"]}", "arguments": {c["function"]["arguments"]}}}\n</tool_call>' for c in calls
    )
    return text, calls


def calculator_reward(task: Scenario, trajectory: tracerl.Trajectory) -> Reward:
    """0.3 × share of the right call's pieces written, +0.3 right tool called, +0.2 right arguments, +0.2 right answer."""
    m = task.metadata
    text, calls = first_reply_text(trajectory, task)
    pieces = ["<tool_call>", f'"name": "{m["tool"]}"', '"arguments": {', f'"a": {m["a"]}', f'"b": {m["b"]}', "</tool_call>"]
    score = 0.3 * sum(piece in text for piece in pieces) / len(pieces)
    tool_ok = bool(calls) and calls[0]["function"]["name"] == m["tool"]
    try:
        args = json.loads(calls[0]["function"]["arguments"]) if tool_ok else None
    except ValueError:
        args = None
    args_ok = isinstance(args, dict) and args.get("a") == m["a"] and args.get("b") == m["b"]
    answer_ok = mentions(final_answer(trajectory), m["answer"])
    score += 0.3 * tool_ok + 0.2 * args_ok + 0.2 * answer_ok
    metrics = {"tool_ok": float(tool_ok), "args_ok": float(args_ok), "answer_ok": float(answer_ok)}
    return Reward(round(score, 4), f"tool {tool_ok}, args {args_ok}, answer {answer_ok}", metrics)


async def main(args: argparse.Namespace) -> tracerl.TrainableModel:
    model = tracerl.TrainableModel(f"calculator-s{args.seed}", "mcp-rl", args.base_model, base_path=args.data, lora_config={"r": 16, "alpha": 32})
    backend = tracerl.LocalBackend(inference=args.inference)
    started = time.monotonic()
    try:
        await model.register(backend)
        print(f"serving {model.get_inference_name()} at {model.inference_base_url} ({time.monotonic() - started:.0f}s)", flush=True)
        await train_mcp_agent(
            model, backend, calculator_server(),
            judge=ExpectedAnswerJudge(calculator_reward, name="calculator"),
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
    out = plot_history(rows, ["train/reward", "val/reward"], Path(args.plot), title=f"MCP calculator agent, seed {args.seed}")
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
    p.add_argument("--max-tokens", type=int, default=40, help="tokens per model call")
    p.add_argument("--val-tasks", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--data", default=".tracerl")
    p.add_argument("--plot", default="docs/mcp_rl_calculator_curve.png")
    return p.parse_args(argv)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    asyncio.run(main(parse_args()))
