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

import json
import random
import sys
from pathlib import Path

import tracerl
from tracerl.mcp_rl import ExpectedAnswerJudge, McpServerSpec, Reward, Scenario
from tracerl.mcp_rl.checked import CheckedExample, cli, shaped_call_reward

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


def calculator_reward(task: Scenario, trajectory: tracerl.Trajectory) -> Reward:
    """0.3 × share of the right call's pieces written, +0.3 right tool called, +0.2 right arguments, +0.2 right answer."""
    m = task.metadata
    pieces = ["<tool_call>", f'"name": "{m["tool"]}"', '"arguments": {', f'"a": {m["a"]}', f'"b": {m["b"]}', "</tool_call>"]
    return shaped_call_reward(task, trajectory, tool=m["tool"], pieces=pieces, arguments_ok=lambda a: a.get("a") == m["a"] and a.get("b") == m["b"])


EXAMPLE = CheckedExample(
    name="calculator", title="MCP calculator agent", server=calculator_server(),
    judge=ExpectedAnswerJudge(calculator_reward, name="calculator"), scenarios=make_scenarios,
    system_prompt=SYSTEM, few_shot=worked_examples(), max_tokens=40,
)  # fmt: skip


if __name__ == "__main__":
    cli(EXAMPLE, __doc__ or "")
