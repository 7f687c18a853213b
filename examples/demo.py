"""`make demo`: teach SmolLM2-135M to use a calculator tool, with GRPO, on a laptop CPU.

The agent is asked "What is A + B?" (three-digit numbers) with an ``add`` tool and two worked
examples in the conversation: it should call the tool, read the tool result, and answer.  The reward is
verifiable (no judge): up to 0.3 for writing the pieces of a tool call, +0.3 for a call the
server parses as ``add``, +0.2 for the right arguments, +0.2 for a final answer that contains
the right sum (see :func:`score_call`).

The loop is the ART-style one: register the model with a ``LocalBackend`` (vLLM when it is
installed, serving the merged policy that it reloads after each step; else the transformers
server with the LoRA), gather groups of rollouts, ``backend.train``, ``model.log``.  Held-out tasks are evaluated greedily every two steps; at the end a reward
curve (train and held-out) is saved as a PNG.  The run stops at the held-out evaluation that
reaches ``--target`` (1.0: every held-out task solved) unless ``--go-on``.  Killing the run and
starting it again resumes from the newest complete checkpoint and ends with the same number of steps.

    python examples/demo.py --steps 20 --inference auto --seed 0
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import tracerl
from tracerl.train.allocator import describe as describe_allocator
from tracerl.train.allocator import relaunch_with_jemalloc

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers and return the sum.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
SYSTEM = "You are a calculator agent. You never compute in your head: you call the add tool, then you state the result."


WORKED_PAIRS = [(12, 30), (205, 118)]
"""The additions solved in the worked examples (see :func:`worked_examples`)."""


def worked_examples(pairs: list[tuple[int, int]] = WORKED_PAIRS) -> list[dict]:
    """Solved tasks (call, result, answer) shown before the real one; two by default.

    Measured on the base model at T=1 (32 samples each): with no or one worked example it
    never writes a tool call, with two ~12% of replies are a correct call (greedy: none), with
    three ~50% (greedy: all).  Two leaves the task unsolved at the start but gives GRPO some
    successes in most groups to learn from; ``examples/sft_then_rl.py`` passes three.
    """
    messages: list[dict] = []
    for i, (a, b) in enumerate(pairs):
        call = {"id": f"call_{i}", "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}
        messages += [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": str(a + b)},
            {"role": "assistant", "content": f"The answer is {a + b}."},
        ]
    return messages


def first_turn_messages(task: dict[str, int]) -> list[dict]:
    """What the agent sees before its first reply: instructions, worked examples, the task."""
    return [
        {"role": "system", "content": SYSTEM},
        *worked_examples(),
        {"role": "user", "content": f"What is {task['a']} + {task['b']}?"},
    ]


def make_tasks(seed: int, n: int) -> list[dict[str, int]]:
    rng = random.Random(seed)
    return [{"a": rng.randint(100, 999), "b": rng.randint(100, 999)} for _ in range(n)]


def format_pieces(task: dict[str, int]) -> list[str]:
    return ["<tool_call>", '{"name": "add"', '"arguments": {', f'"a": {task["a"]}', f'"b": {task["b"]}', "</tool_call>"]


def score_call(choice: tracerl.Choice, task: dict[str, int]) -> tuple[float, bool]:
    """Reward for the first turn (max 0.8), and whether the call was right (so the tool can answer).

    0.3 × the share of the call's pieces present in the reply (the tag, the tool name, the
    arguments object, each argument with its value, the closing tag) — shaping that gives almost every group some
    reward variance to learn from — +0.3 for a call the server parses as ``add``, +0.2 for the
    right arguments.
    """
    text = choice.message.get("content") or ""
    calls = choice.message.get("tool_calls") or []
    if calls:  # the server parsed the call out of the text: rebuild what was written
        text += "".join(
            f'<tool_call>\n{{"name": "{c["function"]["name"]}", "arguments": {c["function"]["arguments"]}}}\n</tool_call>'
            for c in calls
        )
    pieces = format_pieces(task)
    reward = 0.3 * sum(piece in text for piece in pieces) / len(pieces)
    if not calls or calls[0]["function"]["name"] != "add":
        return reward, False
    reward += 0.3
    try:
        args = json.loads(calls[0]["function"]["arguments"])
    except json.JSONDecodeError:
        return reward, False
    if isinstance(args, dict) and args.get("a") == task["a"] and args.get("b") == task["b"]:
        return reward + 0.2, True
    return reward, False


async def rollout(
    model: tracerl.TrainableModel,
    task: dict[str, int],
    *,
    temperature: float,
    seed: int | None,
    add_tool: Callable[[int, int], Awaitable[str]] | None = None,
) -> tracerl.Trajectory:
    """One multi-turn attempt: tool call, tool result, final answer.

    ``add_tool(a, b)`` runs the tool (``bench/pipeline.py``: an MCP server that takes its
    time); by default the sum is computed here."""
    client = model.openai_client()
    messages = first_turn_messages(task)
    trajectory = tracerl.Trajectory(messages_and_choices=list(messages), tools=[ADD_TOOL], metadata=dict(task))

    async def turn(max_tokens: int) -> tracerl.Choice:
        completion = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=trajectory.messages(),
            tools=[ADD_TOOL],
            max_tokens=max_tokens,
            temperature=temperature,
            logprobs=True,
            seed=seed,
            extra_body={"return_token_ids": True},
        )
        choice = tracerl.Choice.from_openai(completion.choices[0], completion)
        trajectory.messages_and_choices.append(choice)
        return choice

    first = await turn(40)
    reward, call_ok = score_call(first, task)
    trajectory.metrics["tool_call_ok"] = float(call_ok)
    if call_ok:
        call = first.message["tool_calls"][0]
        result = str(task["a"] + task["b"]) if add_tool is None else await add_tool(task["a"], task["b"])
        trajectory.messages_and_choices.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        answer = await turn(12)
        answered = re.search(rf"\b{result}\b", answer.message.get("content") or "") is not None
        reward += 0.2 if answered else 0.0
        trajectory.metrics["answer_ok"] = float(answered)
    else:
        trajectory.metrics["answer_ok"] = 0.0
    trajectory.reward = reward
    return trajectory


async def evaluate(model: tracerl.TrainableModel, tasks: list[dict[str, int]]) -> list[tracerl.TrajectoryGroup]:
    """Greedy held-out evaluation (one rollout per task)."""
    trajectories = await tracerl.gather_trajectories(
        (rollout(model, t, temperature=0.0, seed=0) for t in tasks), pbar_desc="held-out", max_exceptions=len(tasks)
    )
    return [tracerl.TrajectoryGroup([t]) for t in trajectories]


def step_split(metrics: dict[str, float]) -> str:
    """``rollouts 12s, train 9s, save 0s, hot-load 2s``: where the step's wall time went."""
    parts = [("rollouts", "rollout_seconds"), ("train", "train_seconds"), ("save", "save_seconds"), ("hot-load", "hot_load_seconds")]
    return ", ".join(f"{label} {metrics[key]:.0f}s" for label, key in parts if key in metrics)


def already_logged(model: tracerl.Model, split: str, step: int) -> bool:
    return any(row.get("step") == step and f"{split}/reward" in row for row in model.history())


def serves_merged(inference: str, serving: str, dtype: str = "auto") -> bool:
    """Whether the policy is served merged (``serving="auto"``: whenever vLLM serves it in fp32;
    a merged bf16 policy would round the update away, so bf16 serves the LoRA).

    On this CPU a LoRA served by vLLM decodes at 0.26-0.41x the base model (vLLM turns
    torch.compile off for LoRA and gathers adapter weights per token); the merged policy,
    reloaded in place after each step, decodes at base speed (``bench/serving_speed.py``) and
    is the same policy, so the rollouts and the learning curve are the same, only faster.
    """
    if serving == "lora" or inference == "transformers" or (serving == "auto" and dtype == "bfloat16"):
        return False
    if serving == "merged":
        return True
    from tracerl.inference.vllm_server import vllm_python

    return vllm_python() is not None


def make_model(args: argparse.Namespace, name: str | None = None) -> tracerl.TrainableModel:
    return tracerl.TrainableModel(
        name or f"calculator-s{args.seed}",
        "demo",
        args.base_model,
        base_path=args.data,
        lora_config={"r": 16, "alpha": 32},
    )


def make_tinker_backend(args: argparse.Namespace, stack: contextlib.ExitStack) -> tracerl.TinkerBackend:
    """``--backend tinker``: train through a Tinker-API service with the official ``tinker`` SDK.

    With ``--tinker-url`` that service (your key in ``$TINKER_API_KEY``); without, a
    ``tracerl serve --tinker`` started here on loopback for this run (and stopped after it)."""
    if args.tinker_url:
        return tracerl.TinkerBackend(args.tinker_url)
    import secrets
    import socket
    import subprocess
    import sys

    import httpx

    key = f"tml-demo-{secrets.token_hex(12)}"
    keys = Path(args.data) / "tinker-keys.json"
    keys.parent.mkdir(parents=True, exist_ok=True)
    keys.write_text(json.dumps({key: "demo"}))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "tracerl", "serve", "--tinker", "--inference", "none", "--tinker-keys", str(keys),
               "--port", str(port), "--path", str(Path(args.data) / "tinker-serve")]  # fmt: skip
    log = stack.enter_context(open(Path(args.data) / "tinker-serve.log", "a"))
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    stack.callback(server.wait, 60)
    stack.callback(server.terminate)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if server.poll() is not None:
            raise SystemExit(f"tracerl serve --tinker exited; see {log.name}")
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    return tracerl.TinkerBackend(url, key)


def make_backend(args: argparse.Namespace) -> tracerl.LocalBackend:
    """The demo's backend, sized for a laptop: the whole process tree stays under 6 GB (``bench/demo_step.py``).

    vLLM's KV cache is allocated up front; the demo's 16 concurrent rollouts share their
    prompt's blocks (prefix caching) and need ~0.1 GB of it, so ``--kv-cache-mib`` 256 is
    ample (a batch larger than the cache holds is preempted and recomputed, not lost).
    Gradient checkpointing of every second decoder layer keeps the trainer's step to ~1.4 GB
    of activations instead of ~2.3 GB, for ~15% more train time than none (every layer: ~0.5 GB,
    +27%); jemalloc (:mod:`tracerl.train.allocator`) keeps the
    step's freed memory from piling up (~0.9 GB less peak than glibc's malloc)."""
    from tracerl.inference.vllm_server import vllm_python

    vllm = args.inference == "vllm" or (args.inference == "auto" and vllm_python() is not None)
    dtype = getattr(args, "dtype", "auto")  # the gallery and the Agents SDK example pass their own options
    return tracerl.LocalBackend(
        inference=args.inference,
        serve_merged=serves_merged(args.inference, args.serving, dtype),
        dtype=dtype,
        gradient_checkpointing=args.checkpoint_every_n_layers if args.gradient_checkpointing else False,
        server_options={"kv_cache_memory_bytes": args.kv_cache_mib << 20} if vllm else None,
    )


async def train_step(
    model: tracerl.TrainableModel, backend: tracerl.LocalBackend, batch: tracerl.DatasetBatch, args: argparse.Namespace
) -> tuple[list[tracerl.TrajectoryGroup], tracerl.TrainResult]:
    """One step: 2 tasks x 8 rollouts at T=1 (seeded per rollout), one GRPO step, the train row logged."""
    groups = await tracerl.gather_trajectory_groups(
        (
            tracerl.TrajectoryGroup(
                rollout(model, task, temperature=1.0, seed=args.seed * 1_000_003 + batch.step * 997 + g * 31 + i)
                for i in range(args.rollouts)
            )
            for g, task in enumerate(batch.items)
        ),
        pbar_desc=f"step {batch.step + 1}/{args.steps}",
        max_exceptions=0.25,
    )
    result = await backend.train(model, groups, learning_rate=args.lr)
    await model.log(groups, split="train", metrics=result.metrics, step=result.step)
    return groups, result


async def main(args: argparse.Namespace) -> None:
    launched = time.monotonic()
    train_tasks = make_tasks(args.seed, 400)
    val_tasks = make_tasks(10_000 + args.seed, args.val_tasks)
    model = make_model(args)
    stack = contextlib.ExitStack()
    backend = make_tinker_backend(args, stack) if args.backend == "tinker" else make_backend(args)
    started = time.monotonic()
    await model.register(backend)
    how = "a Tinker service" if args.backend == "tinker" else "the merged policy" if backend.serve_merged else "the LoRA"
    print(f"serving {model.get_inference_name()} ({how}) at {model.inference_base_url} ({time.monotonic() - started:.0f}s)")
    try:
        step = await model.get_step()
        if not already_logged(model, "val", step):
            await model.log(await evaluate(model, val_tasks), split="val", step=step)
        history = [row["val/reward"] for row in model.history() if "val/reward" in row]
        start_reward = history[0]
        if history[-1] >= args.target and not args.go_on:
            print(f"held-out reward {history[-1]:.3f} already reached the target {args.target:.3f} (--go-on trains on)")
        for batch in tracerl.iterate_dataset(train_tasks, groups_per_step=args.groups_per_step, num_epochs=100, initial_step=step, use_tqdm=False):
            if batch.step >= args.steps or (history[-1] >= args.target and not args.go_on):
                break
            if time.monotonic() - started > args.max_minutes * 60:
                print(f"time budget of {args.max_minutes} min reached at step {batch.step}")
                break
            groups, result = await train_step(model, backend, batch, args)
            elapsed = time.monotonic() - started
            print(
                f"step {result.step}/{args.steps}  train reward {sum(t.reward for g in groups for t in g) / sum(len(g) for g in groups):.3f}"
                f"  trainable groups {result.metrics['num_groups_trainable']:.0f}/{len(groups)}"
                f"  mismatch KL {result.metrics.get('mismatch_kl', float('nan')):.1e}"
                f"  {step_split(result.metrics)}  {elapsed / 60:.1f} min elapsed",
                flush=True,
            )
            if result.step % args.eval_every == 0 or result.step == args.steps:
                val = await evaluate(model, val_tasks)
                row = await model.log(val, split="val", step=result.step)
                rose = history[-1] <= start_reward < row["val/reward"]
                history.append(row["val/reward"])
                print(f"held-out reward at step {result.step}: {row['val/reward']:.3f}"
                      + (f"  (up from {start_reward:.3f}, {(time.monotonic() - launched) / 60:.1f} min after the run began)" if rose else ""),
                      flush=True)  # fmt: skip
                if row["val/reward"] >= args.target and not args.go_on:
                    print(f"the held-out target {args.target:.3f} is reached: stopping at step {result.step} of {args.steps} (--go-on trains on)")
        final = await model.get_step()
        if not already_logged(model, "val", final):
            await model.log(await evaluate(model, val_tasks), split="val", step=final)
    finally:
        await backend.close()
        stack.close()
    summarize(model, args)


def summarize(model: tracerl.TrainableModel, args: argparse.Namespace) -> None:
    from tracerl.runs.plots import plot_history

    rows = model.history()
    val = [(r["step"], r["val/reward"]) for r in rows if "val/reward" in r]
    out = plot_history(rows, ["train/reward", "val/reward"], Path(args.plot) if args.plot else model.run_dir.root / "reward_curve.png", title=f"calculator agent, seed {args.seed}")
    print(f"held-out reward: start {val[0][1]:.3f} (step {val[0][0]}) -> end {val[-1][1]:.3f} (step {val[-1][0]})")
    print(f"reward curve: {out}   history: {model.run_dir.history_path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The demo's settings from ``argv`` (default: the command line); benchmarks pass their own."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inference", choices=["auto", "vllm", "transformers"], default="auto")
    p.add_argument(
        "--serving", choices=["auto", "merged", "lora"], default="auto",
        help="vLLM serves the merged policy (reloaded after each step; auto: whenever vLLM serves) or the LoRA",
    )  # fmt: skip
    p.add_argument(
        "--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True,
        help="recompute activations in backward: ~1 GB less trainer memory",
    )  # fmt: skip
    p.add_argument(
        "--checkpoint-every-n-layers", type=int, default=2,
        help="checkpoint every n-th decoder layer (1: all, least memory; 2: -9%% train time for +0.85 GB)",
    )  # fmt: skip
    p.add_argument("--kv-cache-mib", type=int, default=256, help="vLLM's KV cache (allocated up front)")
    p.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
        help="base weights in the trainer and the server (auto: fp32 on a CPU); bf16 serves the LoRA, not a merged policy",
    )  # fmt: skip
    p.add_argument(
        "--jemalloc", action=argparse.BooleanOptionalAction, default=True,
        help="restart under jemalloc when one is installed (tracerl.train.allocator): ~0.9 GB less peak per step",
    )  # fmt: skip
    p.add_argument("--base-model", default="smollm2-135m")
    p.add_argument("--backend", choices=["local", "tinker"], default="local", help="tinker: train through a Tinker-API service (tracerl.TinkerBackend)")
    p.add_argument("--tinker-url", default=None, help="--backend tinker: the service (default: start tracerl serve --tinker here)")
    p.add_argument("--groups-per-step", type=int, default=2)
    p.add_argument("--rollouts", type=int, default=8, help="rollouts per group")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--val-tasks", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=2, help="held-out evaluation every n steps (greedy, --val-tasks tasks)")
    p.add_argument("--target", type=float, default=1.0, help="stop at the held-out evaluation that reaches this reward")
    p.add_argument("--go-on", action="store_true", help="train all --steps even after the held-out target is reached")
    p.add_argument("--max-minutes", type=float, default=18.0)
    p.add_argument("--data", default=".tracerl")
    p.add_argument("--plot", default=None, help="reward curve PNG (default: reward_curve.png in the run directory)")
    return p.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.jemalloc:
        relaunch_with_jemalloc()  # replaces this process when it is not on jemalloc yet; returns otherwise
    print(describe_allocator(), flush=True)
    asyncio.run(main(arguments))
