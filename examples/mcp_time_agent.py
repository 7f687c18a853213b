"""An MCP agent captured by tracerl: the model gets the tools of ``mcp-server-time`` (stdio)
and a plain OpenAI-client loop calls them through ``mcp.ClientSession``.

    python examples/mcp_time_agent.py                      # serve SmolLM2-135M here (CPU)
    python examples/mcp_time_agent.py --base-url URL       # any tracerl-served endpoint

Needs ``pip install mcp mcp-server-time``.  Each rollout becomes a trajectory whose tool
messages are the MCP results; ``list_tools`` / ``call_tool`` are recorded as spans.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

import tracerl
import tracerl.integrations as ti

SYSTEM = (
    "You answer questions about time by calling a tool. Example:\n"
    '<tool_call>\n{"name": "get_current_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>'
)
QUESTIONS = ["What time is it in Tokyo?", "Which day of the week is it in New York?"]


def time_server_params() -> Any:
    from mcp import StdioServerParameters

    return StdioServerParameters(command=sys.executable, args=["-m", "mcp_server_time", "--local-timezone", "UTC"])


def mcp_result_text(result: Any) -> str:
    return "\n".join(getattr(block, "text", "") for block in result.content or ())


async def run_agent(client: Any, model_name: str, question: str, *, max_turns: int = 3, max_tokens: int = 64) -> str:
    """One rollout: MCP tools offered to the model, tool calls executed over MCP."""
    from mcp import ClientSession, stdio_client

    from tracerl.mcp_rl.server import tools_from_listing

    async with stdio_client(time_server_params()) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        tools = [tool.to_openai() for tool in tools_from_listing(await session.list_tools())]
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        for _ in range(max_turns):
            response = await client.chat.completions.create(
                model=model_name, messages=messages, tools=tools, max_tokens=max_tokens, temperature=1.0
            )
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return message.content or ""
            for call in message.tool_calls:
                try:
                    arguments = json.loads(call.function.arguments or "{}")
                except ValueError:
                    arguments = {}
                result = await session.call_tool(call.function.name, arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": mcp_result_text(result)})
        return ""


def reward(trajectory: tracerl.Trajectory) -> float:
    """1 when the agent fetched the time over MCP without an error, else 0."""
    tool_messages = [m for m in trajectory.messages() if m.get("role") == "tool"]
    return float(any(m.get("content", "").startswith("{") for m in tool_messages))


async def collect(model: tracerl.Model, *, rollouts_per_question: int = 2) -> list[tracerl.TrajectoryGroup]:
    ti.instrument("openai", "mcp")
    groups = []
    for question in QUESTIONS:
        group = await ti.trajectory_group(
            lambda q=question: run_agent(model.openai_client(), model.get_inference_name(), q),
            n=rollouts_per_question,
            model=model,
            task=question,
        )
        for trajectory in group:
            trajectory.reward = reward(trajectory)
        groups.append(group)
    return groups


async def main(base_url: str | None = None) -> list[tracerl.TrajectoryGroup]:
    backend = None
    if base_url:
        ti.register_endpoint(base_url)
        model: tracerl.Model = tracerl.Model("time-agent", "examples", inference_base_url=base_url, inference_model_name="base")
    else:
        model = tracerl.TrainableModel("time-agent", "examples", "smollm2-135m")
        backend = tracerl.LocalBackend(inference="transformers")
        await model.register(backend)
    try:
        groups = await collect(model)
    finally:
        if backend is not None:
            await backend.close()
    for group in groups:
        for t in group:
            tools = [m for m in t.messages() if m.get("role") == "tool"]
            print(f"reward={t.reward} turns={len(t.sampled_turns())} tool_results={len(tools)} token_ids={t.metrics['capture_turns_with_token_ids']}")
    return groups


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="a tracerl-served OpenAI-compatible endpoint (default: serve SmolLM2 here)")
    asyncio.run(main(parser.parse_args().base_url))
