"""The examples use current LangGraph 1.x / LangChain 1.x APIs: run under
``tests/deprecation_runner.py``, a deprecation warning from our own files, or any of LangChain's
or LangGraph's deprecation classes, fails them.  The agents run against the loopback fake
OpenAI server (real HTTP); the training examples are imported (``--help``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from capture_fake_server import FakeOpenAIServer
from test_capture_examples import arithmetic_script

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RUNNER = Path(__file__).with_name("deprecation_runner.py")
DEPRECATED = [
    r"langgraph\.prebuilt import[^\n]*create_react_agent",
    r"\bcreate_react_agent\(",
    r"warnings\.simplefilter\(\s*[\"']ignore",  # an example must not hide what it triggers
]


def run(example: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    done = subprocess.run(
        [sys.executable, str(RUNNER), str(EXAMPLES / example), *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done


@pytest.fixture(scope="module")
def server():
    with FakeOpenAIServer(arithmetic_script) as srv:
        yield srv


@pytest.mark.parametrize("example", ["langgraph_agent.py", "litellm_agent.py"])
def test_agent_examples_raise_no_deprecation_warning(example, server):
    done = run(example, "--base-url", server.base_url)
    assert done.stdout.count("reward=") == 4


@pytest.mark.parametrize("example", ["demo.py", "mcp_rl_calculator.py", "mcp_rl_time.py"])
def test_training_examples_import_without_deprecation_warnings(example):
    assert "usage:" in run(example, "--help").stdout


def test_the_runner_fails_on_a_deprecated_langgraph_call(tmp_path):
    """The check is real: the API our examples used before fails it."""
    script = tmp_path / "old_api.py"
    script.write_text(
        "from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel\n"
        "from langgraph.prebuilt import create_react_agent\n"
        "create_react_agent(FakeMessagesListChatModel(responses=[]), [])\n"
    )
    done = subprocess.run([sys.executable, str(RUNNER), str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "LangGraphDeprecatedSinceV10" in done.stderr


def test_examples_and_readme_name_no_deprecated_api():
    for path in [*EXAMPLES.glob("*.py"), ROOT / "README.md"]:
        text = path.read_text()
        for pattern in DEPRECATED:
            assert not re.search(pattern, text), f"{path.name}: {pattern}"
