"""MCP•RL on ``mcp-server-time``: tracerl discovers the server's tools, an LLM writes practice
tasks, SmolLM2-135M attempts them through MCP, RULER judges each group, GRPO trains a LoRA.

    python examples/mcp_rl_time.py --generator openai/gpt-4.1-mini --judge openai/gpt-4.1-mini
    python examples/mcp_rl_time.py --generator Qwen/Qwen3-32B --generator-base-url http://host:8000/v1 \\
        --judge Qwen/Qwen3-32B --judge-base-url http://host:8000/v1 --steps 20

Needs ``pip install mcp mcp-server-time litellm`` and a generator/judge model you can reach
(a LiteLLM model string with its API key in the environment, or any OpenAI-compatible
endpoint).  Rerunning continues from the newest checkpoint with the same scenarios
(``.tracerl/examples/models/mcp-time-agent/mcp_rl/scenarios.jsonl``).  The same run from
the command line: ``tracerl mcp-rl --server-command "python -m mcp_server_time" ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from tracerl.mcp_rl import McpServerSpec
from tracerl.mcp_rl.train import McpRLResult, llm_target, train_mcp_agent_locally

INSTRUCTIONS = (
    "Keep every task short and concrete: ask for the current time in a named city or IANA timezone, "
    "or to convert a given HH:MM time between two timezones."
)


def time_server() -> McpServerSpec:
    """``mcp-server-time`` over stdio, run by this interpreter (so it is the same environment)."""
    return McpServerSpec(command=sys.executable, args=("-m", "mcp_server_time", "--local-timezone", "UTC"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generator", required=True, help="scenario generator: LiteLLM model string or model name at --generator-base-url")
    parser.add_argument("--generator-base-url")
    parser.add_argument("--judge", required=True, help="RULER judge: LiteLLM model string or model name at --judge-base-url")
    parser.add_argument("--judge-base-url")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--rollouts-per-group", type=int, default=4)
    parser.add_argument("--num-scenarios", type=int, default=12)
    parser.add_argument("--num-val", type=int, default=4)
    parser.add_argument("--val-every", type=int, default=0)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--inference", default="auto", choices=["auto", "vllm", "transformers"])
    parser.add_argument("--base-path", default=".tracerl")
    return parser.parse_args(argv)


async def main(args: argparse.Namespace) -> McpRLResult:
    result = await train_mcp_agent_locally(
        time_server(),
        name="mcp-time-agent",
        project="examples",
        base_model="smollm2-135m",
        base_path=args.base_path,
        inference=args.inference,
        judge_model=llm_target(args.judge, args.judge_base_url),
        generator_model=llm_target(args.generator, args.generator_base_url),
        steps=args.steps,
        groups_per_step=args.groups_per_step,
        rollouts_per_group=args.rollouts_per_group,
        num_train_scenarios=args.num_scenarios,
        num_val_scenarios=args.num_val,
        val_every=args.val_every,
        max_turns=args.max_turns,
        max_tokens=args.max_tokens,
        learning_rate=args.learning_rate,
        custom_instructions=INSTRUCTIONS,
    )
    print(f"tools: {', '.join(t.name for t in result.discovery.tools)}")
    print(f"scenarios: {len(result.train_scenarios)} train, {len(result.val_scenarios)} val ({result.scenarios_path})")
    for row in result.rows:
        split = "val" if any(k.startswith("val/") for k in row) else "train"
        print(f"step={row['step']} {split}/reward={row.get(f'{split}/reward', float('nan')):.3f}")
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    asyncio.run(main(parse_args()))
