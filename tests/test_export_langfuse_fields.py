"""What Langfuse shows beyond the trace-level fields: the tools a generation was offered,
training steps grouped per run, scores attached to the observations they judge.

As in ``test_export_langfuse.py``: real agents against an OpenAI-compatible stand-in, spans
and scores into the loopback endpoint that decodes OTLP protobuf and maps each span as
Langfuse's ingestion does (``langfuse_mapping``; tools: ``langfuse_tools``, the port of its
``normalizeToolsForObservation``), scores validated as Langfuse's ``POST /api/public/scores``
validates them.
"""

from __future__ import annotations

import json

import pytest
from capture_helpers import LOOKUP_TOOL, openai_tool_agent
from test_export_langfuse import collector, hosted, langfuse, react_agent, served, trainable  # noqa: F401 - fixtures

import tracerl
import tracerl.integrations as ti

pytest.importorskip("langgraph")
pytestmark = pytest.mark.asyncio(loop_scope="session")


def _offered(observation) -> list[str]:
    """The names of the tools in a generation's input, as the generation view lists them."""
    assert isinstance(observation.input, dict), observation.input
    return [t.get("name") or t.get("function", {}).get("name") for t in observation.input["tools"]]


async def test_a_generation_shows_the_tools_it_was_offered(hosted, collector, langfuse):
    """LangGraph ReAct agent (``ChatOpenAI`` + one ``@tool``) and a plain OpenAI-SDK agent: each
    generation's input is ``{"messages": [...], "tools": [...]}`` and its tool index names the tool."""
    from openai import AsyncOpenAI

    agent = react_agent(hosted.base_url)
    async with ti.rollout(task="tools in langfuse", group="g-tools") as graph:
        await agent.ainvoke({"messages": [("user", "tools in langfuse")]})
    client = AsyncOpenAI(base_url=hosted.base_url, api_key="x", max_retries=0)
    async with ti.rollout(task="tools via sdk", group="g-tools") as sdk:
        await openai_tool_agent(client, "tools via sdk")
    assert langfuse.force_flush()
    for r, tool in ((graph, "lookup"), (sdk, LOOKUP_TOOL["function"]["name"])):
        generations = collector.generations(r.trajectory.trace_id)
        assert len(generations) == 2
        for generation in generations:
            assert _offered(generation) == [tool]
            assert [m["role"] for m in generation.input["messages"]][:1] in (["user"], ["system"])
            described = json.loads(generation.tool_definitions[tool])
            assert described["description"] and "properties" in json.loads(described["parameters"])
            assert "gen_ai.tool.definitions" not in generation.metadata["attributes"]  # moved into the input
    first_graph_call = min(collector.generations(graph.trajectory.trace_id), key=lambda o: len(o.input["messages"]))
    assert first_graph_call.input["messages"][-1]["parts"][0]["content"] == "tools in langfuse"
    assert json.loads(collector.generations(graph.trajectory.trace_id)[0].tool_definitions["lookup"])["description"] == (
        "Look something up."
    )


async def test_a_runs_training_steps_share_a_session_environment_and_their_release(served, collector, langfuse, tmp_path):
    """Two ``model.log`` steps of one run: one session ``{project}/{name}`` for both (Langfuse's
    session view lists the run's steps), the destination's environment, and each step the
    release of its rollouts (``name@step``), so rollouts and steps filter together."""
    model = trainable(served, tmp_path, step=5)
    step_ids = []
    releases = {}
    for step in (5, 6):
        model._step_cache = step
        group = await ti.trajectory_group(
            [openai_tool_agent(model.openai_client(), f"run step {step} {i}", model=model.get_inference_name()) for i in range(2)],
            model=model,
        )
        await model.log([group], split="train", step=step, metrics={"loss": 1.0 / step})
        assert langfuse.force_flush()
        releases[step] = {o.release for t in group.trajectories for o in collector.observations(t.trace_id)}
        (step_trace,) = {o.trace_id for o in collector.observations() if o.trace_name == "training step" and o.version == f"agent@{step}"}
        step_ids.append(step_trace)
    fields = [collector.trace_fields(t) for t in step_ids]
    assert fields == [
        {("training step", "obs/agent", None, ("train", "agent"), "agent@5", "agent@5", "rl-test")},
        {("training step", "obs/agent", None, ("train", "agent"), "agent@6", "agent@6", "rl-test")},
    ]
    assert releases == {5: {"agent@5"}, 6: {"agent@6"}}  # the step's release is its rollouts' release


def _observation_of(collector, score) -> object:
    """The observation a score names (its ``observationId``, inside its ``traceId``)."""
    (found,) = [o for o in collector.observations(score["traceId"]) if o.id == score["observationId"]]
    return found


async def test_scores_attach_to_the_observations_they_judge(served, collector, langfuse, tmp_path):
    """``reward`` on the rollout's root, ``ruler`` / ``independent_reward`` on the trace's
    ``evaluation`` observation, a step's metrics on the step's span; group scores on the
    session alone (Langfuse refuses an ``observationId`` there); every field one of
    ``CreateScoreRequest``'s, every score accepted."""
    from ruler_judge_server import JudgeServer, by_content

    from tracerl.ruler import JudgeEndpoint, RulerJudge

    model = trainable(served, tmp_path, step=7)

    async def attempt(question: str):
        async with ti.rollout(model, task="judge me", split="train") as r:
            await openai_tool_agent(model.openai_client(), question, model=model.get_inference_name())
            r.reward = 1.0 if "good" in question else 0.25
        return r.trajectory

    with JudgeServer(by_content({"good": 1.0, "bad": 0.0})) as judge_server:
        group = await tracerl.TrajectoryGroup(attempt(q) for q in ("good answer", "bad answer"))
        scored = await RulerJudge(JudgeEndpoint(judge_server.base_url, "scripted-judge"), cache=False)(group)
    await model.log([scored], split="train", step=7)
    assert langfuse.force_flush()
    session = scored.trajectories[0].metadata["group"]
    names = {"reward", "ruler", "independent_reward"}
    for t in scored.trajectories:
        collector.wait_for(lambda: names <= {s["name"] for s in collector.scores if s.get("traceId") == t.trace_id})
        collector.wait_for(lambda: sum(o.name.startswith("evaluation ") for o in collector.observations(t.trace_id)) >= 2)
        by_name = {s["name"]: s for s in collector.scores if s.get("traceId") == t.trace_id}
        root = _observation_of(collector, by_name["reward"])
        assert root.parent_id is None and root.type == "agent"
        for name in ("ruler", "independent_reward"):
            evaluation = _observation_of(collector, by_name[name])
            assert (evaluation.name, evaluation.type, evaluation.parent_id) == (f"evaluation {name}", "evaluator", root.id)
        assert by_name["ruler"]["value"] == t.reward == (1.0 if "good" in t.messages()[1]["content"] else 0.0)
        assert by_name["independent_reward"]["value"] == (1.0 if t.reward == 1.0 else 0.25)
        assert by_name["ruler"]["comment"].startswith("scripted")
    collector.wait_for(lambda: {"group_reward", "group_reward_std_dev"} <= {s["name"] for s in collector.scores if s.get("sessionId") == session})
    group_scores = [s for s in collector.scores if s.get("sessionId") == session]
    assert all("traceId" not in s and "observationId" not in s for s in group_scores)
    assert {s["name"]: s["value"] for s in group_scores}["group_reward"] == 0.5  # RULER's 1.0 and 0.0
    (step_trace,) = {o.trace_id for o in collector.observations() if o.trace_name == "training step" and o.version == "agent@7"}
    collector.wait_for(lambda: any(s.get("traceId") == step_trace for s in collector.scores))
    step_scores = [s for s in collector.scores if s.get("traceId") == step_trace]
    assert {_observation_of(collector, s).name for s in step_scores} == {"step 7"}
    mine = [s for s in collector.scores if s.get("traceId") in {t.trace_id for t in scored.trajectories} | {step_trace}]
    assert all(s["observationId"] for s in mine) and {s["environment"] for s in mine + group_scores} == {"rl-test"}
    assert collector.score_problems == []


async def test_acceptance_react_agent_in_langfuse(hosted, collector, langfuse):
    """Issue 10's first acceptance line at once: a LangGraph ReAct agent with one tool against a
    model stand-in: generations = model requests, summed usage = what the server reported, the
    graph's nodes nested (rollout > graph > node > ... > generation; tool under the tools node),
    and every observation carrying the trace name and the session."""
    agent = react_agent(hosted.base_url)
    first = len(hosted.responses)
    async with ti.rollout(task="acceptance", group="g-acceptance", name="react-acceptance") as r:
        await agent.ainvoke({"messages": [("user", "acceptance")]})
    assert langfuse.force_flush()
    responses = hosted.responses[first:]
    trace_id = r.trajectory.trace_id
    observations = {o.id: o for o in collector.observations(trace_id)}

    def path(o) -> list[tuple[str, str]]:
        out = []
        while o.parent_id in observations:
            o = observations[o.parent_id]
            out.append((o.name, o.type))
        return out[::-1]

    generations = [o for o in observations.values() if o.type == "generation"]
    assert len(generations) == len(responses) == 2
    usage = collector.summed_usage(trace_id)
    assert usage["input"] == sum(x["usage"]["prompt_tokens"] for x in responses)
    assert usage["output"] == sum(x["usage"]["completion_tokens"] for x in responses)
    for generation in generations:  # LangChain's own chat run is a plain span above the call closest to the wire
        # LangChain 1.x create_agent: the graph's "model" node calls the chat model directly
        assert path(generation) == [("react-acceptance", "agent"), ("LangGraph", "chain"), ("model", "chain"),
                                    ("chat gpt-4o-mini", "span")]  # fmt: skip
    [tool] = [o for o in observations.values() if o.type == "tool"]
    assert tool.name == "lookup" and path(tool) == [("react-acceptance", "agent"), ("LangGraph", "chain"), ("tools", "chain")]
    assert {(o.trace_name, o.session_id) for o in observations.values()} == {("react-acceptance", "g-acceptance")}
