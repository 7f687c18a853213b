"""MCP•RL: discovery, scenario generation, the MCP agent loop and the training recipe.

The MCP servers are real (``mcp-server-time`` over stdio, ``tests/mcp_http_server.py`` over
streamable HTTP).  The scenario generator and the RULER judge stand for hosted LLMs: a
scripted OpenAI-compatible server on loopback (``ruler_judge_server.JudgeServer``) speaks
the real wire protocol; the policy is ``capture_fake_server.FakeOpenAIServer`` (token ids
included) here and the real SmolLM2-135M in the ``real_model`` test at the end.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from capture_fake_server import FakeOpenAIServer, Reply
from capture_helpers import assert_tokens_match_server, roles
from mcp_http_server import McpHttpServer
from mcp_rl_tiny_run import run_one_step
from ruler_judge_server import JudgeServer, trajectories_in

import tracerl
import tracerl.integrations as ti
from tracerl.errors import ConfigError
from tracerl.mcp_rl import (
    McpServerError,
    McpServerSpec,
    McpTool,
    Scenario,
    ScenarioError,
    discover,
    generate_scenarios,
    load_scenarios,
    open_session,
    parse_scenarios,
    run_mcp_agent,
    save_scenarios,
    train_mcp_agent,
)
from tracerl.ruler import JudgeEndpoint

pytest.importorskip("mcp")
if importlib.util.find_spec("mcp_server_time") is None:
    pytest.skip("mcp-server-time is not installed", allow_module_level=True)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TIME_SERVER = McpServerSpec(command=sys.executable, args=("-m", "mcp_server_time", "--local-timezone", "UTC"))


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Judge and generator answers are cached under tmp (the base model's cache stays where it is)."""
    import tracerl.mcp_rl.scenarios
    import tracerl.ruler.cache

    monkeypatch.setattr(tracerl.ruler.cache, "default_cache_dir", lambda: tmp_path / "cache" / "ruler")
    monkeypatch.setattr(tracerl.mcp_rl.scenarios, "default_cache_dir", lambda: tmp_path / "cache" / "mcp_rl")
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")


@pytest.fixture(scope="module")
def http_server():
    with McpHttpServer() as server:
        yield server


# -- scripted hosted LLMs ------------------------------------------------------------------------
def scenario_answer(tasks: list[str], difficulty: Any = 2) -> str:
    return json.dumps({"scenarios": [{"task": t, "difficulty": difficulty} for t in tasks]})


def requested_n(request: dict[str, Any]) -> int:
    return request["response_format"]["json_schema"]["schema"]["properties"]["scenarios"]["minItems"]


def generator(tasks: list[str]):
    """A generator that answers with the first ``n`` of ``tasks``."""
    return lambda request, n_call: scenario_answer(tasks[: requested_n(request)])


TIME_TASKS = [f"What time is it now in {city}? Answer with the local time." for city in ("Tokyo", "Paris", "Lima", "Cairo", "Oslo", "Perth")]


def judge_prefers_successful_tool_use(request: dict[str, Any], n_call: int) -> str:
    """A judge: a trajectory whose tool result has a datetime scores 1, an error 0.2, else 0.5 (ties broken by position)."""
    scores = []
    for index, (tid, text) in enumerate(trajectories_in(request)):
        score = 1.0 if '"datetime"' in text else 0.2 if "Error" in text else 0.5
        scores.append({"trajectory_id": tid, "explanation": f"scripted {tid}", "score": max(0.0, score - 0.1 * index)})
    return json.dumps({"scores": scores})


# -- server.py -------------------------------------------------------------------------------------
def test_server_spec_forms_and_validation():
    spec = McpServerSpec.stdio("python -m mcp_server_time --local-timezone 'America/New_York'")
    assert (spec.command, spec.args, spec.transport) == ("python", ("-m", "mcp_server_time", "--local-timezone", "America/New_York"), "stdio")
    assert spec.label == "python -m mcp_server_time --local-timezone America/New_York"
    http = McpServerSpec.http("http://127.0.0.1:9/mcp", headers={"authorization": "Bearer secret"})
    assert http.transport == "streamable-http" and "secret" not in repr(http)
    with pytest.raises(ConfigError):
        McpServerSpec()
    with pytest.raises(ConfigError):
        McpServerSpec(command="x", url="http://y")
    with pytest.raises(ConfigError):
        McpServerSpec.stdio("   ")


async def test_discover_stdio_time_server():
    found = await discover(TIME_SERVER)
    assert found.server_name == "mcp-time"
    tools = {t.name: t for t in found.tools}
    assert set(tools) == {"get_current_time", "convert_time"}
    assert "timezone" in tools["get_current_time"].input_schema["properties"]
    assert tools["convert_time"].description
    assert found.resources == ()
    openai = found.openai_tools()
    assert openai[0]["type"] == "function" and openai[0]["function"]["parameters"]["type"] == "object"


async def test_discover_http_server_with_resources(http_server):
    found = await discover(McpServerSpec.http(http_server.url))
    assert {t.name for t in found.tools} == {"add", "reverse", "fail"}
    assert [(r.uri, r.name) for r in found.resources] == [("notes://readme", "readme")]
    with_headers = McpServerSpec.http(http_server.url, headers={"x-tracerl-test": "1"})
    async with open_session(with_headers) as session:  # a session works too
        assert {t.name for t in (await discover(session)).tools} == {"add", "reverse", "fail"}


async def test_unreachable_servers_raise_a_clear_error():
    with pytest.raises(McpServerError, match="could not connect to the MCP server /no/such/server"):
        await discover(McpServerSpec.stdio("/no/such/server --flag"))
    with pytest.raises(McpServerError, match=r"http://127\.0\.0\.1:1/mcp \(streamable-http\)"):
        await discover(McpServerSpec.http("http://127.0.0.1:1/mcp"))


# -- scenarios.py ------------------------------------------------------------------------------------
TOOLS = [McpTool("get_current_time", "Get the current time in a timezone", {"type": "object", "properties": {"timezone": {"type": "string"}}})]


def test_parse_scenarios_is_tolerant_and_dedupes():
    text = 'Sure! Here they are:\n```json\n{"scenarios": [{"task": "A", "difficulty": "2"}, {"task": " a ", "difficulty": 4.6}, {"task": "B", "difficulty": 9}, {"difficulty": 1}, 7, "C"]}\n```'
    found, problems = parse_scenarios(text)
    assert [(s.task, s.difficulty) for s in found] == [("A", 2), ("B", 5), ("C", 3)]
    assert any("no \"task\"" in p for p in problems) and any("not an object" in p for p in problems)
    assert any("1 tasks were duplicates" in p for p in problems)
    bare, _ = parse_scenarios('[{"task": "x", "difficulty": 1}]')
    assert [s.task for s in bare] == ["x"]
    with pytest.raises(ScenarioError, match="not JSON"):
        parse_scenarios("I cannot help with that.")
    with pytest.raises(ScenarioError, match='no "scenarios" list'):
        parse_scenarios('{"items": 3}')


async def test_generate_scenarios_asks_for_a_schema_and_caches(tmp_path):
    with JudgeServer(generator(TIME_TASKS)) as llm:
        endpoint = JudgeEndpoint(base_url=llm.base_url, model="scripted-generator")
        scenarios = await generate_scenarios(TOOLS, 4, endpoint, custom_instructions="Only big cities.")
        assert [s.task for s in scenarios] == TIME_TASKS[:4] and all(s.difficulty == 2 for s in scenarios)
        request = llm.requests[0]
        assert request["response_format"]["type"] == "json_schema" and requested_n(request) == 4
        prompt = request["messages"][-1]["content"]
        assert "get_current_time" in prompt and "Only big cities." in prompt and "exactly 4" in prompt
        again = await generate_scenarios(TOOLS, 4, endpoint, custom_instructions="Only big cities.")
        assert again == scenarios and llm.count == 1  # served from the on-disk cache
        await generate_scenarios(TOOLS, 4, endpoint, custom_instructions="Only big cities.", cache=False)
        await generate_scenarios(TOOLS, 3, endpoint, custom_instructions="Only big cities.")  # another n: another key
        assert llm.count == 3


async def test_generate_scenarios_retries_once_with_the_problem_named():
    def script(request: dict[str, Any], n_call: int) -> str:
        if n_call == 1:  # two distinct tasks (plus a duplicate) instead of four
            return "```json\n" + scenario_answer([TIME_TASKS[0], TIME_TASKS[0].upper(), TIME_TASKS[1]]) + "\n```"
        return scenario_answer(TIME_TASKS[1:5])

    with JudgeServer(script) as llm:
        scenarios = await generate_scenarios(TOOLS, 4, JudgeEndpoint(llm.base_url, "g"), cache=False)
        assert llm.count == 2
        corrective = llm.requests[1]["messages"]
        assert [m["role"] for m in corrective] == ["system", "user", "assistant", "user"]
        assert "got 2 valid distinct tasks, need 4" in corrective[-1]["content"] and "duplicates" in corrective[-1]["content"]
    assert [s.task for s in scenarios] == TIME_TASKS[:4]  # the first answer's tasks are kept, the retry fills up


async def test_generate_scenarios_errors_name_the_problem():
    with JudgeServer(lambda request, n_call: "no JSON here") as llm:
        with pytest.raises(ScenarioError, match=r"did not deliver 3 scenarios after one corrective re-ask: got 0 .*not JSON"):
            await generate_scenarios(TOOLS, 3, JudgeEndpoint(llm.base_url, "g"), cache=False)
        assert llm.count == 2
    with JudgeServer(lambda request, n_call: {"status": 500, "body": {"error": {"message": "overloaded"}}}) as llm:
        with pytest.raises(ScenarioError, match="the scenario generator g@.* failed"):
            await generate_scenarios(TOOLS, 3, JudgeEndpoint(llm.base_url, "g"), cache=False, extra_litellm_params={"num_retries": 0})
    with pytest.raises(ScenarioError, match="no tools"):
        await generate_scenarios([], 3, "openai/gpt-4.1-mini")


def test_scenarios_jsonl_roundtrip(tmp_path):
    rows = [Scenario("first task", 1), Scenario("second task", 5, split="val")]
    path = save_scenarios(tmp_path / "s" / "scenarios.jsonl", rows)
    assert load_scenarios(path) == rows
    assert json.loads(path.read_text().splitlines()[0])["id"] == rows[0].id
    path.write_text('{"task": "ok"}\nnot json\n')
    with pytest.raises(ScenarioError, match="scenarios.jsonl:2"):
        load_scenarios(path)


# -- agent.py ---------------------------------------------------------------------------------------------
def time_policy(body: dict[str, Any]) -> Reply:
    """Calls get_current_time for the city in the task (and once with a bad zone), then answers."""
    results = [m for m in body["messages"] if m["role"] == "tool"]
    if not results:
        return Reply(tool_calls=[("get_current_time", {"timezone": "Asia/Tokyo"}), ("get_current_time", {"timezone": "Mars/Base"})])
    return Reply(content="It is " + json.loads(results[0]["content"])["datetime"])


@pytest.fixture
def policy_server():
    servers: list[FakeOpenAIServer] = []

    def start(script) -> tuple[FakeOpenAIServer, tracerl.Model]:
        server = FakeOpenAIServer(script).start()
        servers.append(server)
        ti.register_endpoint(server.base_url)
        model = tracerl.Model("policy", "tests", inference_base_url=server.base_url, inference_model_name="m")
        return server, model

    yield start
    for server in servers:
        ti.unregister_endpoint(server.base_url)
        server.stop()


async def test_agent_loop_on_the_stdio_time_server(policy_server):
    server, model = policy_server(time_policy)
    t = await run_mcp_agent(model, TIME_SERVER, Scenario("What time is it in Tokyo?", 1), max_tokens=32)
    assert roles(t.messages_and_choices) == ["system", "user", "assistant", "tool", "tool", "assistant"]
    tokyo, bad = t.messages_and_choices[3], t.messages_and_choices[4]
    assert json.loads(tokyo["content"])["timezone"] == "Asia/Tokyo"
    assert bad["content"].startswith("Error:") and "Invalid timezone" in bad["content"]
    assert t.messages_and_choices[-1].message["content"].startswith("It is ")
    assert {tool["function"]["name"] for tool in t.tools} == {"get_current_time", "convert_time"}
    assert_tokens_match_server(t, server.responses)
    assert t.metrics["capture_turns_with_token_ids"] == 2
    assert (t.metrics["turns"], t.metrics["tool_calls"], t.metrics["tool_errors"], t.metrics["finished"]) == (2, 2, 1, 1)
    assert t.metadata["task"] == "What time is it in Tokyo?" and t.metadata["difficulty"] == 1
    assert t.metadata["output"].startswith("It is ")
    request = server.requests[0]
    assert request["max_tokens"] == 32 and request["return_token_ids"] is True
    assert request["messages"][0]["role"] == "system" and len(request["tools"]) == 2


def misbehaving_policy(body: dict[str, Any]) -> Reply:
    """Never stops calling tools, some of them wrong."""
    return Reply(tool_calls=[("add", {"a": 2, "b": 2}), ("fail", {"reason": "r"}), ("no_such_tool", {}), ("add", {"a": "x"})])


async def test_tool_errors_are_messages_not_crashes_and_max_turns_ends_the_loop(policy_server, http_server):
    server, model = policy_server(misbehaving_policy)
    async with open_session(McpServerSpec.http(http_server.url)) as session:  # one session shared by attempts
        t = await run_mcp_agent(model, session, "Add two and two.", max_turns=2)
    tool_messages = [m for m in t.messages_and_choices if isinstance(m, dict) and m["role"] == "tool"]
    contents = [m["content"] for m in tool_messages]
    assert contents[0] == "4"
    assert contents[1].startswith("Error:") and "failed on purpose: r" in contents[1]
    assert contents[2].startswith("Error: there is no tool named 'no_such_tool'")
    assert contents[3].startswith("Error:") and "validation" in contents[3].lower()
    assert (t.metrics["turns"], t.metrics["finished"], t.metrics["tool_calls"], t.metrics["tool_errors"]) == (2, 0, 8, 6)
    assert len(server.requests) == 2 and len(t.sampled_turns()) == 2


async def test_bad_tool_arguments_json_is_reported_to_the_model(policy_server, http_server):
    from tracerl.mcp_rl.agent import call_tool

    async with open_session(McpServerSpec.http(http_server.url)) as session:
        content, failed = await call_tool(session, {"add"}, "add", '{"a": 1,')
        assert failed and content.startswith("Error: the arguments are not valid JSON")
        assert await call_tool(session, {"add"}, "add", "[1, 2]") == ("Error: the arguments must be a JSON object", True)
        assert await call_tool(session, {"add"}, "add", '{"a": 1, "b": 2}') == ("3", False)


async def test_a_failing_model_call_surfaces_as_an_inference_server_error_in_the_group():
    """Errors raised inside the MCP session are not hidden in anyio's exception groups; an
    unreachable inference server is an infrastructure failure, chained to the SDK's error."""
    from openai import APIConnectionError

    model = tracerl.Model("p", "tests", inference_base_url="http://127.0.0.1:1/v1", inference_model_name="m")
    with pytest.raises(tracerl.InferenceServerError, match=r"http://127\.0\.0\.1:1/v1") as caught:
        await run_mcp_agent(model, TIME_SERVER, "What time is it?")
    assert isinstance(caught.value.__cause__, APIConnectionError)
    [group] = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(run_mcp_agent(model, TIME_SERVER, "What time is it?") for _ in range(2))],
        pbar_desc=None, max_exceptions=2,
    )  # fmt: skip
    assert [e.type for e in group.exceptions] == ["InferenceServerError", "InferenceServerError"]


# -- train.py (recipe, with a recording backend) -----------------------------------------------------------
class RecordingBackend:
    """A Backend that records what it is asked to train (no model): the recipe's wiring only."""

    def __init__(self, step: int = 0) -> None:
        self.step = step
        self.calls: list[tuple[list[tracerl.TrajectoryGroup], dict[str, Any]]] = []

    async def register(self, model: Any) -> None:
        pass

    async def get_step(self, model: Any) -> int:
        return self.step

    async def train(self, model: Any, groups: Any, **kwargs: Any) -> tracerl.TrainResult:
        self.calls.append((list(groups), kwargs))
        self.step += 1
        return tracerl.TrainResult(step=self.step, metrics={"loss": 0.5}, checkpoint_path=None)


async def test_recipe_discovers_generates_judges_trains_logs_and_resumes(policy_server, tmp_path):
    _, model = policy_server(time_policy)
    model = tracerl.Model("time-agent", "tests", inference_base_url=model.inference_base_url, inference_model_name="m", base_path=tmp_path)
    backend = RecordingBackend()
    await model.register(backend)
    with JudgeServer(generator(TIME_TASKS)) as gen, JudgeServer(judge_prefers_successful_tool_use) as judge:
        kwargs = dict(
            judge_model=JudgeEndpoint(judge.base_url, "judge"), generator_model=JudgeEndpoint(gen.base_url, "gen"),
            groups_per_step=2, rollouts_per_group=2, num_train_scenarios=4, num_val_scenarios=2, val_every=2,
            max_turns=2, max_tokens=16, learning_rate=3e-5,
        )  # fmt: skip
        result = await train_mcp_agent(model, backend, TIME_SERVER, steps=2, **kwargs)
        assert gen.count == 1
        assert result.final_step == 2 and len(backend.calls) == 2
        assert len(result.train_scenarios) == 4 and len(result.val_scenarios) == 2
        assert {s.task for s in result.train_scenarios + result.val_scenarios} == set(TIME_TASKS)
        saved = load_scenarios(result.scenarios_path)
        assert result.scenarios_path == model.run_dir.root / "mcp_rl" / "scenarios.jsonl" and len(saved) == 6
        groups, train_kwargs = backend.calls[0]
        assert train_kwargs == {"learning_rate": 3e-5}
        assert len(groups) == 2 and all(len(g.trajectories) == 2 for g in groups)
        for group in groups:
            assert [t.reward for t in group.trajectories] in ([1.0, 0.9], [0.9, 1.0])  # the judge's scores
            assert all(t.metrics["ruler_score"] == t.reward and t.metadata["ruler"]["judge"].startswith("judge@") for t in group.trajectories)
        history = model.history()
        assert [(row["step"], next(k.split("/")[0] for k in row if "/" in k)) for row in history] == [(1, "train"), (2, "train"), (2, "val")]
        assert history[0]["train/reward"] == pytest.approx(0.95) and history[0]["train/loss"] == 0.5
        assert history[0]["train/gather_groups_dropped"] == 0
        assert (model.run_dir.root / "trajectories" / "train" / "0001.jsonl").exists()
        # resume: the same call with more steps reuses the scenario file and continues at step 3
        again = await train_mcp_agent(model, backend, TIME_SERVER, steps=3, share_session=True, **kwargs)
        assert gen.count == 1 and again.final_step == 3 and len(backend.calls) == 3
        assert [row["step"] for row in model.history()] == [1, 2, 2, 3]
        done = await train_mcp_agent(model, backend, TIME_SERVER, steps=3, **kwargs)
        assert done.rows == [] and len(backend.calls) == 3


async def test_recipe_drops_groups_the_judge_cannot_score(policy_server, tmp_path):
    _, model = policy_server(time_policy)
    model = tracerl.Model("time-agent", "tests", inference_base_url=model.inference_base_url, inference_model_name="m", base_path=tmp_path)
    backend = RecordingBackend()
    await model.register(backend)
    with JudgeServer(generator(TIME_TASKS)) as gen, JudgeServer(lambda request, n_call: "no idea") as judge:
        result = await train_mcp_agent(
            model, backend, TIME_SERVER, steps=1, judge_model=JudgeEndpoint(judge.base_url, "judge"),
            generator_model=JudgeEndpoint(gen.base_url, "gen"), groups_per_step=1, rollouts_per_group=2,
            num_train_scenarios=2, num_val_scenarios=0, max_turns=1,
        )  # fmt: skip
    assert backend.calls == [] and result.final_step == 0 and judge.count == 2  # asked, re-asked, dropped


def test_rollouts_per_group_must_allow_comparison():
    import asyncio

    with pytest.raises(ConfigError, match="rollouts_per_group"):
        asyncio.run(train_mcp_agent(None, None, TIME_SERVER, judge_model="j", generator_model="g", rollouts_per_group=1))  # type: ignore[arg-type]


# -- CLI ---------------------------------------------------------------------------------------------------------
def test_cli_mcp_rl_maps_options_to_the_recipe(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    import tracerl.mcp_rl.train as recipe
    from tracerl.cli import app

    seen: dict[str, Any] = {}

    async def fake(server, **kwargs):
        seen.update(kwargs, server=server)
        return recipe.McpRLResult(None, [], [], tmp_path / "s.jsonl", final_step=kwargs["steps"])  # type: ignore[arg-type]

    monkeypatch.setattr(recipe, "train_mcp_agent_locally", fake)
    args = [
        "mcp-rl", "--server-command", "python -m mcp_server_time --local-timezone UTC", "--env", "A=1",
        "--judge", "judge-model", "--judge-base-url", "http://127.0.0.1:9/v1", "--generator", "openai/gpt-4.1-mini",
        "--steps", "3", "--rollouts-per-group", "2", "--name", "tt", "--base-path", str(tmp_path), "--inference", "transformers",
    ]  # fmt: skip
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    assert seen["server"] == McpServerSpec(command="python", args=("-m", "mcp_server_time", "--local-timezone", "UTC"), env={"A": "1"})
    assert seen["judge_model"] == JudgeEndpoint("http://127.0.0.1:9/v1", "judge-model")
    assert seen["generator_model"] == "openai/gpt-4.1-mini"
    assert (seen["steps"], seen["rollouts_per_group"], seen["name"], seen["inference"]) == (3, 2, "tt", "transformers")
    assert "step 3" in done.output
    bad = CliRunner().invoke(app, ["mcp-rl", "--judge", "j", "--generator", "g"])
    assert bad.exit_code != 0 and "exactly one of --server-command or --server-url" in bad.output


# -- judges.py and the no-hosted-LLM path (scenarios=, judge=) ------------------------------------------------------------
CALCULATOR = McpServerSpec(command=sys.executable, args=(str(EXAMPLES / "mcp_calculator_server.py"),))


def answered(task: str, reply: str, **metadata: Any) -> tracerl.Trajectory:
    return tracerl.Trajectory(
        messages_and_choices=[{"role": "user", "content": task}, {"role": "assistant", "content": reply}],
        metadata={"task": task, "scenario_metadata": metadata},
    )


def test_final_answer_matching_is_whole_token():
    from tracerl.mcp_rl.judges import mentions

    assert mentions("The answer is 82.", "82") and mentions("82", 82) and mentions("it's -82, I think", "82")
    assert not mentions("182", "82") and not mentions("82.5", "82") and not mentions("828", "82") and not mentions("", "82")
    calls = tracerl.Trajectory(messages_and_choices=[{"role": "assistant", "content": "82", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}])
    assert tracerl.mcp_rl.final_answer(calls) == ""  # a tool call is not an answer


async def test_expected_answer_judge_scores_groups_and_works_as_after_each():
    from tracerl.mcp_rl import ExpectedAnswerJudge, Reward
    from tracerl.ruler import Judge

    judge = ExpectedAnswerJudge()
    assert isinstance(judge, Judge)
    group = tracerl.TrajectoryGroup([answered("What is 37 + 45?", "It is 82.", answer="82"), answered("What is 37 + 45?", "It is 81.", answer="82")])
    scores = await judge.score_group(group)
    assert [s.score for s in scores] == [1.0, 0.0] and [s.trajectory_id for s in scores] == [t.id for t in group.trajectories]
    assert "contains '82'" in scores[0].explanation and scores[0].judge == "expected-answer"
    [scored] = await tracerl.gather_trajectory_groups([group], pbar_desc=None, after_each=judge)
    first = scored.trajectories[0]
    assert first.reward == 1.0 and first.metrics["verified_reward"] == 1.0 and first.metrics["independent_reward"] == 0.0
    assert first.metadata["judge"]["judge"] == "expected-answer" and first.logs[-1].startswith("expected-answer 1.000")
    assert group.trajectories[0].reward == 0.0  # the input group is not modified

    seen = []

    async def shaped(task, trajectory):  # async, with an explanation and metrics
        seen.append((task.task, task.metadata))
        return Reward(0.25, "partial", {"tool_ok": 1.0})

    [shaped_group] = await tracerl.gather_trajectory_groups([group], pbar_desc=None, after_each=ExpectedAnswerJudge(shaped, name="shaped"))
    assert [t.reward for t in shaped_group.trajectories] == [0.25, 0.25] and shaped_group.trajectories[0].metrics["tool_ok"] == 1.0
    assert seen[0] == ("What is 37 + 45?", {"answer": "82"})
    tuple_judge = ExpectedAnswerJudge(lambda task, t: (1, "ok"))
    assert [s.score for s in await tuple_judge.score_group(group)] == [1.0, 1.0]


async def test_expected_answer_judge_failures_name_the_group_and_can_be_dropped():
    from tracerl.errors import JudgeError
    from tracerl.mcp_rl import ExpectedAnswerJudge, as_after_each

    group = tracerl.TrajectoryGroup([answered("What is 1 + 1?", "2")], metadata={"scenario_id": "abc"})
    with pytest.raises(JudgeError, match=r"no metadata\['answer'\]"):
        await ExpectedAnswerJudge().score_group(group)
    with pytest.raises(JudgeError, match=r"group 'abc': ValueError: boom"):
        await ExpectedAnswerJudge(lambda task, t: (_ for _ in ()).throw(ValueError("boom"))).score_group(group)
    with pytest.raises(JudgeError, match="finite number"):
        await ExpectedAnswerJudge(lambda task, t: float("nan")).score_group(group)
    assert await ExpectedAnswerJudge(swallow_exceptions=True)(group) is None
    assert await as_after_each(ExpectedAnswerJudge())(group) is None  # dropped by default
    empty = tracerl.TrajectoryGroup([])
    assert await as_after_each(ExpectedAnswerJudge())(empty) is empty


def test_scenario_metadata_roundtrips(tmp_path):
    rows = [Scenario("What is 2 + 3?", metadata={"answer": "5"}), Scenario("x", split="val")]
    path = save_scenarios(tmp_path / "s.jsonl", rows)
    assert load_scenarios(path) == rows and json.loads(path.read_text().splitlines()[0])["metadata"] == {"answer": "5"}
    assert "metadata" not in json.loads(path.read_text().splitlines()[1])
    assert Scenario.coerce("t") == Scenario("t") and Scenario.coerce({"task": "t", "split": "val"}).split == "val"
    assert hash(rows[0]) == hash(Scenario("What is 2 + 3?"))  # metadata does not make it unhashable


def calculator_policy() -> Any:
    """Calls the tool the task names with its numbers, then answers with the tool result: right the
    first time it sees a task, off by one in b afterwards (so a group of two has one of each)."""
    seen: set[str] = set()

    def script(body: dict[str, Any]) -> Reply:
        messages = body["messages"]
        asked = max(i for i, m in enumerate(messages) if m["role"] == "user")
        task = messages[asked]["content"]
        results = [m for m in messages[asked:] if m["role"] == "tool"]
        if results:
            return Reply(content=f"The answer is {results[-1]['content']}.")
        a, op, b = task.removeprefix("What is ").removesuffix("?").split()
        off = int(task in seen)
        seen.add(task)
        return Reply(tool_calls=[("add" if op == "+" else "multiply", {"a": int(a), "b": int(b) + off})])

    return script


async def test_recipe_without_hosted_llms_uses_given_scenarios_and_a_verifiable_judge(policy_server, tmp_path):
    from tracerl.mcp_rl import ExpectedAnswerJudge

    server, model = policy_server(calculator_policy())
    model = tracerl.Model("calc", "tests", inference_base_url=model.inference_base_url, inference_model_name="m", base_path=tmp_path)
    backend = RecordingBackend()
    await model.register(backend)
    tasks = [Scenario(f"What is {a} + {b}?", metadata={"answer": str(a + b)}) for a, b in [(37, 45), (120, 7)]]
    tasks.append(Scenario("What is 6 * 7?", split="val", metadata={"answer": "42"}))
    few_shot = [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "The answer is 2."}]
    kwargs = dict(judge=ExpectedAnswerJudge(), scenarios=tasks, groups_per_step=2, rollouts_per_group=2, max_turns=2,
                  val_every=1, val_at_start=True, val_rollouts=1, val_temperature=0.0, few_shot=few_shot, share_session=True)  # fmt: skip
    result = await train_mcp_agent(model, backend, CALCULATOR, steps=1, **kwargs)
    assert {t.name for t in result.discovery.tools} == {"add", "multiply"}
    assert result.final_step == 1 and len(result.train_scenarios) == 2 and [s.task for s in result.val_scenarios] == ["What is 6 * 7?"]
    assert load_scenarios(result.scenarios_path) == tasks  # saved with their answers
    [(groups, _)] = backend.calls
    for group in groups:
        assert sorted(t.reward for t in group.trajectories) == [0.0, 1.0]
        assert all(t.metadata["judge"]["judge"] == "expected-answer" for t in group.trajectories)
        assert {t.metadata["scenario_metadata"]["answer"] for t in group.trajectories} == {str(eval(group.metadata["task"][8:-1]))}
    history = model.history()
    assert [(row["step"], "val/reward" in row) for row in history] == [(0, True), (1, False), (1, True)]
    assert (history[0]["val/reward"], history[1]["train/reward"], history[2]["val/reward"]) == (1.0, 0.5, 0.0)
    first_request = server.requests[0]
    assert [m["role"] for m in first_request["messages"]] == ["system", "user", "assistant", "user"]  # few-shot before the task
    val_requests = [r for r in server.requests if r["messages"][-1]["content"] == "What is 6 * 7?"]
    assert val_requests and all(r["temperature"] == 0.0 for r in val_requests)
    again = await train_mcp_agent(model, backend, CALCULATOR, steps=1, **kwargs)  # rerun: nothing to do, no second val at 0
    assert again.rows == [] and [row["step"] for row in model.history()] == [0, 1, 1]


def test_recipe_errors_when_judge_or_scenarios_are_missing():
    import asyncio

    from tracerl.mcp_rl import ExpectedAnswerJudge

    with pytest.raises(ConfigError, match="no judge: pass judge="):
        asyncio.run(train_mcp_agent(None, None, CALCULATOR, scenarios=["t"]))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="no scenarios: pass scenarios="):
        asyncio.run(train_mcp_agent(None, None, CALCULATOR, judge=ExpectedAnswerJudge()))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not both"):
        asyncio.run(train_mcp_agent(None, None, CALCULATOR, judge=ExpectedAnswerJudge(), judge_model="j", scenarios=["t"]))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="score_group"):
        asyncio.run(train_mcp_agent(None, None, CALCULATOR, judge=lambda g: g, scenarios=["t"]))  # type: ignore[arg-type]


def test_cli_mcp_rl_with_a_scenarios_file_and_checked_answers(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    import tracerl.mcp_rl.train as recipe
    from tracerl.cli import app
    from tracerl.mcp_rl import ExpectedAnswerJudge

    seen: dict[str, Any] = {}

    async def fake(server, **kwargs):
        seen.update(kwargs)
        return recipe.McpRLResult(None, [], [], tmp_path / "s.jsonl", final_step=kwargs["steps"])  # type: ignore[arg-type]

    monkeypatch.setattr(recipe, "train_mcp_agent_locally", fake)
    tasks = [Scenario("What is 2 + 3?", metadata={"answer": "5"}), Scenario("What is 2 * 3?", split="val", metadata={"answer": "6"})]
    path = save_scenarios(tmp_path / "tasks.jsonl", tasks)
    base = ["mcp-rl", "--server-command", "python examples/mcp_calculator_server.py"]
    done = CliRunner().invoke(app, [*base, "--scenarios", str(path), "--check-answers", "--steps", "2"])
    assert done.exit_code == 0, done.output
    assert seen["scenarios"] == tasks and isinstance(seen["judge"], ExpectedAnswerJudge)
    assert seen["judge_model"] is None and seen["generator_model"] is None
    for args, message in [
        ([*base, "--check-answers"], "give --scenarios FILE.jsonl or a --generator"),
        ([*base, "--scenarios", str(path)], "exactly one of --judge MODEL (RULER) or --check-answers"),
        ([*base, "--scenarios", str(tmp_path / "none.jsonl"), "--judge", "j"], "no such file"),
    ]:
        bad = CliRunner().invoke(app, args)
        assert bad.exit_code != 0 and message in " ".join(bad.output.replace("│", " ").split()), bad.output


# -- the real model -------------------------------------------------------------------------------------------------
@pytest.mark.real_model
def test_example_trains_smollm2_one_step_on_the_time_server(tmp_path):
    """examples/mcp_rl_time.py: SmolLM2-135M (transformers server) as the policy on mcp-server-time,
    scripted generator and judge; one GRPO step writes checkpoint 0001 and a history row."""
    pytest.importorskip("torch")
    sys.path.insert(0, str(EXAMPLES))
    import asyncio

    import mcp_rl_time

    def judge(request: dict[str, Any], n_call: int) -> str:  # rank by position: always some variance for GRPO
        ids = [tid for tid, _ in trajectories_in(request)]
        return json.dumps({"scores": [{"trajectory_id": tid, "explanation": "scripted", "score": 1.0 - i / len(ids)} for i, tid in enumerate(ids)]})

    with JudgeServer(generator(TIME_TASKS)) as gen, JudgeServer(judge) as judge_server:
        result = asyncio.run(
            mcp_rl_time.main(
                mcp_rl_time.parse_args([
                    "--generator", "gen", "--generator-base-url", gen.base_url,
                    "--judge", "judge", "--judge-base-url", judge_server.base_url,
                    "--steps", "1", "--groups-per-step", "2", "--rollouts-per-group", "2",
                    "--num-scenarios", "2", "--num-val", "0", "--max-turns", "2", "--max-tokens", "24",
                    "--inference", "transformers", "--base-path", str(tmp_path),
                ])  # fmt: skip
            )
        )
    assert judge_server.count == 2 and gen.count == 1
    run = tmp_path / "examples" / "models" / "mcp-time-agent"
    assert (run / "checkpoints" / "0001" / "adapter_model.safetensors").exists()
    rows = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1] and "train/reward" in rows[0]
    assert rows[0]["train/num_groups_trainable"] >= 1 and rows[0]["train/trained_tokens"] > 0
    trajectories = [json.loads(line) for line in (run / "trajectories" / "train" / "0001.jsonl").read_text().splitlines()]
    assert len(trajectories) == 4 and all(t["metrics"]["capture_turns_with_token_ids"] >= 1 for t in trajectories)
    assert result.final_step == 1


@pytest.mark.real_model
def test_calculator_example_runs_one_step_without_hosted_llms(tmp_path):
    """examples/mcp_rl_calculator.py on the real model, tiny: the calculator MCP server over stdio,
    given tasks, the verifiable judge; held-out eval at step 0, one GRPO step, a curve."""
    pytest.importorskip("torch")
    run_one_step("mcp_rl_calculator.py", tmp_path, run_name="calculator", judge="calculator", extra=["--max-tokens", "32"])
