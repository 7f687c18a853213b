"""``examples/mcp_rl_time_checked.py``: an agent on ``mcp-server-time`` (a server nobody here wrote), answers checked in code.

The MCP server is the real one over stdio.  Light tests drive it with a scripted policy
(``FakeOpenAIServer``, real HTTP) to show that the answers the example computes with
``zoneinfo`` are the ones the server returns today, and that the reward gives partial credit;
the ``real_model`` test runs the example for one GRPO step on SmolLM2-135M.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from capture_fake_server import FakeOpenAIServer, Reply
from mcp_rl_tiny_run import run_one_step

import tracerl
import tracerl.integrations as ti
from tracerl.mcp_rl import run_mcp_agent

pytest.importorskip("mcp")
if importlib.util.find_spec("mcp_server_time") is None:
    pytest.skip("mcp-server-time is not installed", allow_module_level=True)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import mcp_rl_time_checked as example  # noqa: E402

TASK = re.compile(r"Convert (\d\d:\d\d) from (\S+) to (\S+)\. Use the tools\.")


def test_answers_are_computed_in_code_and_do_not_depend_on_the_date():
    assert example.expected_time("Asia/Tokyo", "14:30", "Asia/Kolkata") == "11:00"
    assert example.expected_time("Pacific/Honolulu", "20:00", "Asia/Tokyo") == "15:00"  # the next day there
    with pytest.raises(ValueError, match="depends on the date"):
        example.expected_time("Europe/London", "14:30", "Asia/Tokyo")  # BST in summer: 22:30 vs 23:30
    scenarios = example.make_scenarios(0, 200, 16)
    train, val = [s for s in scenarios if s.split == "train"], [s for s in scenarios if s.split == "val"]
    assert len(train) == 200 and len(val) == 16 and not {s.task for s in val} & {s.task for s in train}
    for s in scenarios:
        hhmm, source, target = TASK.fullmatch(s.task).groups()
        assert s.metadata == {"source_timezone": source, "time": hhmm, "target_timezone": target, "answer": s.metadata["answer"]}
        assert s.metadata["answer"] != hhmm and source != target
    assert example.make_scenarios(0, 200, 16) == scenarios and example.make_scenarios(1, 200, 16) != scenarios
    used = {z for s in scenarios for z in (s.metadata["source_timezone"], s.metadata["target_timezone"])}
    assert not used & {z for pair in example.EXAMPLE_ZONES for z in pair}  # worked examples are not held-out tasks


def solved_policy(wrong_time: bool = False) -> Any:
    """Calls convert_time with the task's arguments (or a time off by an hour), then states the target time the server returned."""

    def script(body: dict[str, Any]) -> Reply:
        messages = body["messages"]
        asked = max(i for i, m in enumerate(messages) if m["role"] == "user")
        results = [m for m in messages[asked:] if m["role"] == "tool"]
        if results:
            target = json.loads(results[-1]["content"])["target"]
            return Reply(content=f"It is {target['datetime'][11:16]} in {target['timezone']}.")
        hhmm, source, target = TASK.fullmatch(messages[asked]["content"]).groups()
        if wrong_time:
            hhmm = f"{(int(hhmm[:2]) + 1) % 24:02d}{hhmm[2:]}"
        return Reply(tool_calls=[("convert_time", {"source_timezone": source, "time": hhmm, "target_timezone": target})])

    return script


@pytest.fixture
def policy():
    servers: list[FakeOpenAIServer] = []

    def start(script: Any) -> tuple[FakeOpenAIServer, tracerl.Model]:
        server = FakeOpenAIServer(script).start()
        servers.append(server)
        ti.register_endpoint(server.base_url)
        return server, tracerl.Model("policy", "tests", inference_base_url=server.base_url, inference_model_name="m")

    yield start
    for server in servers:
        ti.unregister_endpoint(server.base_url)
        server.stop()


async def test_the_real_server_agrees_with_the_computed_answers_and_the_reward_is_shaped(policy):
    """Against the real server, today: a solved policy scores 1.0 on every held-out task; one that
    converts the wrong time keeps the tool's credit and 6 of the call's 7 pieces, but loses arguments and answer."""
    val = [s for s in example.make_scenarios(0, 4, 6) if s.split == "val"]
    for wrong, expected in [(False, 1.0), (True, round(0.3 * 6 / 7 + 0.3, 4))]:
        server, model = policy(solved_policy(wrong_time=wrong))
        for task in val:
            t = await run_mcp_agent(
                model, example.time_server(), task, max_turns=2, max_tokens=64,
                system_prompt=example.SYSTEM, few_shot=example.worked_examples(),
            )  # fmt: skip
            reward = example.time_reward(task, t)
            assert reward.score == pytest.approx(expected), (task.task, reward.explanation, t.messages()[-1])
            assert reward.metrics == {"tool_ok": 1.0, "args_ok": float(not wrong), "answer_ok": float(not wrong)}
        request = server.requests[0]
        assert {tool["function"]["name"] for tool in request["tools"]} == {"get_current_time", "convert_time"}
        assert [m["role"] for m in request["messages"]] == ["system"] + ["user", "assistant", "tool", "assistant"] * 2 + ["user"]


async def test_worked_examples_show_the_server_s_own_result_format(policy):
    """The worked examples' tool results have the keys and layout the real convert_time returns."""
    source, target = example.EXAMPLE_ZONES[0]
    task = tracerl.mcp_rl.Scenario(f"Convert 09:15 from {source} to {target}. Use the tools.")
    _, model = policy(solved_policy())
    t = await run_mcp_agent(model, example.time_server(), task, max_turns=2, max_tokens=64)
    real = next(m["content"] for m in t.messages() if m.get("role") == "tool")
    shown = example.worked_examples()[2]["content"]
    strip_date = re.compile(r"\d{4}-\d\d-\d\dT|\"day_of_week\": \"\w+\"")
    assert strip_date.sub("", real) == strip_date.sub("", shown)


def test_a_reply_without_a_call_earns_only_the_pieces_it_wrote():
    task = example.make_scenarios(0, 1, 0)[0]
    m = task.metadata
    text = f'<tool_call>\n{{"name": "convert_time", "arguments": {{"time": "{m["time"]}"}}'  # truncated: 4 of 7 pieces
    t = tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": task.task}, {"role": "assistant", "content": text}])
    reward = example.time_reward(task, t)
    assert reward.score == pytest.approx(round(0.3 * 4 / 7, 4)) and reward.metrics == {"tool_ok": 0.0, "args_ok": 0.0, "answer_ok": 0.0}


def test_the_example_imports_without_deprecation_warnings():
    runner = Path(__file__).with_name("deprecation_runner.py")
    done = subprocess.run([sys.executable, str(runner), str(EXAMPLES / "mcp_rl_time_checked.py"), "--help"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-3000:]


@pytest.mark.real_model
def test_the_example_runs_one_step_on_the_real_model(tmp_path):
    """SmolLM2-135M (transformers server) on the real time server, tiny: held-out eval at step 0, one GRPO step, a curve."""
    pytest.importorskip("torch")
    for t in run_one_step("mcp_rl_time_checked.py", tmp_path, run_name="time-checked", judge="time"):
        assert {tool["function"]["name"] for tool in t["tools"]} == {"get_current_time", "convert_time"}
