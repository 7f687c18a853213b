"""The capture examples run as scripts (against a local OpenAI-compatible server here; the
real-model run of the LangGraph example is in ``test_capture_real_model.py``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from capture_fake_server import FakeOpenAIServer, Reply

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def arithmetic_script(body: dict[str, Any]) -> Reply:
    messages = body["messages"]
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    question = messages[last_user]["content"]
    results = [m for m in messages[last_user:] if m["role"] == "tool"]
    if not results:
        a, b = (int(x) for x in re.findall(r"\d+", question)[:2])
        names = {t["function"]["name"] for t in body.get("tools") or ()}
        name = "multiply" if "times" in question and "multiply" in names else "add"
        return Reply(tool_calls=[(name, {"a": a, "b": b})])
    return Reply(content=f"The answer is {results[-1]['content']}.")


@pytest.fixture(scope="module")
def server():
    with FakeOpenAIServer(arithmetic_script) as srv:
        yield srv


def run_example(name: str, base_url: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--base-url", base_url],
        capture_output=True,
        text=True,
        timeout=180,
        env={**__import__("os").environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if line.startswith("reward=")]


def test_litellm_example(server):
    lines = run_example("litellm_agent.py", server.base_url)
    assert len(lines) == 4 and all(line.startswith("reward=1.0") and "turns=2 token_ids=2" in line for line in lines)


def test_langgraph_example_capture_only(server):
    lines = run_example("langgraph_agent.py", server.base_url)
    assert len(lines) == 4
    for line in lines:
        assert line.startswith("reward=1.00") and "token_ids=2" in line
        assert line.endswith("'user', 'assistant', 'tool', 'assistant', 'user', 'assistant', 'tool', 'assistant'] token_ids=2")
