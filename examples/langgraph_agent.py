"""A LangChain 1.x agent (a LangGraph graph) with two tools, captured by tracerl and trained for a step.

    python examples/langgraph_agent.py                    # SmolLM2-135M on this CPU: collect + 1 GRPO step
    python examples/langgraph_agent.py --base-url URL     # capture only, against a tracerl-served endpoint

The agent is ordinary LangChain 1.x code (``langchain.agents.create_agent`` + ``ChatOpenAI`` +
``@tool``; the graph it builds is a LangGraph ``StateGraph``): ``build_agent`` knows nothing
about tracerl.  Running each attempt in a rollout is all the capture needs (entering one
turns the hooks on); ``ChatOpenAI`` pointed at the tracerl endpoint gets exact token ids.
"""

from __future__ import annotations

import argparse
import asyncio
import re
from typing import Any

import tracerl
import tracerl.integrations as ti

SYSTEM = (
    "You never answer arithmetic in words: you call a tool. Example:\n"
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
)
QUESTIONS = [("What is 17 + 25?", 42), ("What is 6 times 7?", 42)]


def few_shot() -> list[Any]:
    """Worked examples in the conversation: small models copy the tool-call format from them."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    messages: list[Any] = []
    for index, (name, a, b, result, question) in enumerate(
        [("add", 1, 2, 3, "What is 1 + 2?"), ("multiply", 4, 5, 20, "What is 4 times 5?"), ("add", 10, 3, 13, "What is 10 + 3?")]
    ):
        call_id = f"call_example_{index}"
        messages += [
            HumanMessage(question),
            AIMessage("", tool_calls=[{"name": name, "args": {"a": a, "b": b}, "id": call_id}]),
            ToolMessage(str(result), tool_call_id=call_id),
            AIMessage(f"The answer is {result}."),
        ]
    return messages


# -- the agent: plain LangChain / LangGraph -----------------------------------------------------
def build_agent(llm: Any) -> Any:
    from langchain.agents import create_agent
    from langchain_core.tools import tool

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return int(a) + int(b)

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return int(a) * int(b)

    return create_agent(llm, [add, multiply], system_prompt=SYSTEM)


def chat_model(base_url: str, model_name: str, *, max_tokens: int = 48) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=model_name, base_url=base_url, api_key="tracerl", temperature=1.0, max_tokens=max_tokens, max_retries=0)


# -- capture + reward --------------------------------------------------------------------------
def reward(trajectory: tracerl.Trajectory, expected: int) -> float:
    """0.5 for using a tool without an error, +0.5 when the final answer holds the number."""
    messages = trajectory.messages()[1 + len(few_shot()) :]  # after the system prompt and the worked examples
    used_tool = any(m.get("role") == "tool" and not str(m.get("content", "")).startswith("Error") for m in messages)
    final = str(messages[-1].get("content") or "") if messages else ""
    return 0.5 * used_tool + 0.5 * bool(re.search(rf"\b{expected}\b", final))


async def collect(agent: Any, model: tracerl.Model, *, rollouts_per_question: int = 2, recursion_limit: int = 6) -> list[tracerl.TrajectoryGroup]:
    """One group per question, each attempt a captured rollout of the unchanged graph."""
    groups = []
    for question, expected in QUESTIONS:

        async def attempt(q: str = question) -> None:
            try:
                await agent.ainvoke({"messages": [*few_shot(), ("user", q)]}, {"recursion_limit": recursion_limit})
            except Exception as error:  # the graph hit its step limit: keep what was captured
                if type(error).__name__ != "GraphRecursionError":
                    raise

        group = await ti.trajectory_group(attempt, n=rollouts_per_question, model=model, task=question)
        for trajectory in group:
            trajectory.reward = reward(trajectory, expected)
        groups.append(group)
    return groups


async def main(base_url: str | None = None) -> list[tracerl.TrajectoryGroup]:
    if base_url:  # capture only
        ti.register_endpoint(base_url)
        model = tracerl.Model("react-agent", "examples", inference_base_url=base_url, inference_model_name="base")
        groups = await collect(build_agent(chat_model(base_url, "base")), model)
        summarize(groups)
        return groups
    model = tracerl.TrainableModel("react-agent", "examples", "smollm2-135m")
    async with tracerl.LocalBackend(inference="transformers") as backend:
        await model.register(backend)
        agent = build_agent(ti.langgraph.init_chat_model(model, max_tokens=48, max_retries=0))
        groups = await collect(agent, model)
        summarize(groups)
        result = await backend.train(model, groups, learning_rate=1e-5)
        print(f"trained step {result.step}: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(result.metrics.items())[:8]))
    return groups


def summarize(groups: list[tracerl.TrajectoryGroup]) -> None:
    for group in groups:
        for t in group:
            roles = [m["role"] for m in t.messages()]
            print(f"reward={t.reward:.2f} roles={roles} token_ids={t.metrics['capture_turns_with_token_ids']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="capture only, against this tracerl-served endpoint")
    asyncio.run(main(parser.parse_args().base_url))
