"""``examples/langgraph_learns.py``: a multi-node LangGraph graph over SQLite, trained unchanged.

Light tests run the graph against the loopback fake OpenAI server (real HTTP, scripted to
answer as a solved policy would) under the deprecation runner; the real-model test trains on
SmolLM2-135M: in ``make test`` one step of ``--tiny``'s batch (1 task x 2 attempts, 1 held-out
task: held-out at step 0, a step, then the held-out graph rebuilt on the new checkpoint), under
``TRACERL_FULL=1`` (``make test-long``) the ``--tiny`` configuration itself, two steps.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from capture_fake_server import FakeOpenAIServer, Reply
from suite_size import FULL

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RUNNER = Path(__file__).with_name("deprecation_runner.py")
sys.path.insert(0, str(EXAMPLES))
from langgraph_learns_graph import build_database, score  # noqa: E402


def company_script(body: dict[str, Any]) -> Reply:
    """A policy that has learnt the task: find the employee, then ask for the team's manager or city, then answer."""
    messages = body["messages"]
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    question = messages[last_user]["content"]
    results = [m["content"] for m in messages[last_user:] if m["role"] == "tool"]
    name = re.search(r"(?:of|does) (.+)'s team", question).group(1)
    if not results:
        return Reply(tool_calls=[("find_employee", {"name": name})])
    if len(results) == 1:
        team = int(re.search(r"team (\d+)", results[0]).group(1))
        return Reply(tool_calls=[("team_manager" if "manager" in question else "team_city", {"team_id": team})])
    return Reply(content=f"The answer: {results[-1]}")


def test_the_graph_module_imports_nothing_from_tracerl():
    tree = ast.parse((EXAMPLES / "langgraph_learns_graph.py").read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert imported and not any(name.split(".")[0] == "tracerl" for name in imported)
    code = f"import sys; sys.path.insert(0, {str(EXAMPLES)!r}); import langgraph_learns_graph; print('tracerl' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_the_captured_graph_solves_the_task_with_a_solved_policy(tmp_path):
    """Router -> worker <-> tools -> answer, captured: 3 sampled turns with token ids, reward 1, no deprecation."""
    with FakeOpenAIServer(company_script) as server:
        done = subprocess.run(
            [sys.executable, str(RUNNER), str(EXAMPLES / "langgraph_learns.py"), "--base-url", server.base_url, "--data", str(tmp_path)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
        requests = list(server.requests)
    lines = [line for line in done.stdout.splitlines() if line.startswith("reward=")]
    assert len(lines) == 4 and all(line.startswith("reward=1.00 sampled=3 token_ids=3") for line in lines)
    assert len(requests) == 12 and all({t["function"]["name"] for t in r["tools"]} == {"find_employee", "team_manager", "team_city"} for r in requests)


def test_the_reward_is_verifiable_and_gives_partial_credit(tmp_path):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    task = next(t for t in build_database(tmp_path / "db.sqlite") if t["kind"] == "manager")
    wrong = task["team_id"] + 1

    def state(first: dict[str, Any] | None, second: dict[str, Any] | None, answer: str) -> dict[str, Any]:
        messages: list[Any] = [HumanMessage(task["question"])]
        for i, call in enumerate(c for c in (first, second) if c):
            messages += [AIMessage("", tool_calls=[{**call, "id": f"c{i}"}]), ToolMessage("...", tool_call_id=f"c{i}")]
        return {"messages": messages, "answer": answer}

    find = {"name": "find_employee", "args": {"name": task["employee"]}}
    manager = {"name": "team_manager", "args": {"team_id": task["team_id"]}}
    assert score(state(find, manager, f"It is {task['expected']}."), task)[0] == pytest.approx(1.0)
    assert score(state(find, {**manager, "args": {"team_id": wrong}}, "no idea"), task)[0] == pytest.approx(0.4)
    assert score(state(find, {"name": "team_city", "args": {"team_id": task["team_id"]}}, ""), task)[0] == pytest.approx(0.3)
    assert score(state(None, None, task["expected"]), task)[0] == pytest.approx(0.4)  # a lucky guess earns only the answer
    assert score(state(None, None, ""), task)[0] == 0.0


@pytest.mark.real_model
def test_the_tiny_configuration_trains_and_serves_the_new_checkpoint(tmp_path):
    steps = 2 if FULL else 1
    # --tiny is 2 steps of 1 task x 2 attempts and 1 held-out task, the held-out run at the start and the end
    size = ["--tiny"] if FULL else ["--steps", "1", "--groups-per-step", "1", "--rollouts", "2", "--val-tasks", "1", "--eval-every", "100"]
    args = [
        sys.executable, str(EXAMPLES / "langgraph_learns.py"), *size, "--inference", "transformers",
        "--data", str(tmp_path / "data"), "--plot", str(tmp_path / "curve.png"), "--seed", "3",
    ]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / "data" / "langgraph_learns" / "models" / "langgraph-company-s3"
    rows = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/reward" in r] == list(range(1, steps + 1))
    assert sorted(r["step"] for r in rows if "val/reward" in r) == [0, steps]
    # the last held-out run went through a graph on the new checkpoint: every captured call names it
    last_val = [json.loads(line) for line in (run_dir / "trajectories" / "val" / f"{steps:04d}.jsonl").read_text().splitlines()]
    served = {m["model"] for t in last_val for m in t["messages_and_choices"] if "token_ids" in m}
    assert served == {f"langgraph-company-s3@{steps}"}, served
    assert (tmp_path / "curve.png").stat().st_size > 1000
    trajectory = json.loads((run_dir / "trajectories" / "train" / f"{steps:04d}.jsonl").read_text().splitlines()[0])
    sampled = [m for m in trajectory["messages_and_choices"] if "token_ids" in m]
    assert sampled and all(m["token_ids"] and len(m["logprobs"]) == len(m["token_ids"]) for m in sampled)
    assert trajectory["messages_and_choices"][0]["role"] == "system" and "find_employee" in json.dumps(trajectory["tools"])
