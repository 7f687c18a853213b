"""Child process for tests/test_capture_auto.py: a user's first try, in a fresh interpreter.

A ``ChatOpenAI``-based agent (``langchain.agents.create_agent``, a LangGraph graph) runs inside
``tracerl.rollout(...)`` and nothing calls ``tracerl.integrations.instrument()``.  Usage::

    python auto_capture_child.py BASE_URL eager   # LangChain imported before the rollout
    python auto_capture_child.py BASE_URL lazy    # imported inside it, on first use

Prints one JSON line: which hooks were on before the rollout, and what was captured.
``TRACERL_ENDPOINTS=BASE_URL`` in the environment marks the fake server as tracerl-served.
"""

from __future__ import annotations

import asyncio
import json
import sys

import tracerl


def build_agent(base_url: str):
    from langchain.agents import create_agent
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def lookup(query: str) -> str:
        """Look a query up."""
        return f"found {query}"

    llm = ChatOpenAI(model="policy", base_url=base_url, api_key="x", max_retries=0)
    return create_agent(llm, [lookup], system_prompt="Use the tools.")


def hooks_on() -> list[str]:
    from tracerl.integrations import langchain_hook, openai_hook

    return [name for name, hook in (("openai", openai_hook), ("langchain", langchain_hook)) if hook.is_instrumented()]


async def main(base_url: str, mode: str) -> None:
    agent = build_agent(base_url) if mode == "eager" else None
    before = hooks_on()
    async with tracerl.rollout(task="What is tracerl?") as r:
        agent = agent or build_agent(base_url)
        await agent.ainvoke({"messages": [("user", "What is tracerl?")]})
    t = r.trajectory
    print(json.dumps({
        "hooks_before": before,
        "hooks_after": hooks_on(),
        "roles": [m["role"] for m in t.messages()],
        "sampled_with_token_ids": sum(1 for c in t.sampled_turns() if c.token_ids),
        "tool_results": [m["content"] for m in t.messages() if m["role"] == "tool"],
        "logs": t.logs,
    }))  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
