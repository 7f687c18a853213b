"""What Langfuse shows for tracerl's traces: one generation per model request, trace-level
fields on every observation, the RULER judge, scores and training steps.

Every check goes through the loopback collector that decodes OTLP protobuf and maps each
span the way Langfuse's v4 ingestion does (``langfuse_mapping.py``); the agents are real
(a LangGraph ReAct agent with ``ChatOpenAI`` and one ``@tool``, LiteLLM, the OpenAI SDK)
against an OpenAI-compatible stand-in that reports usage like a hosted model.
"""

from __future__ import annotations

import json
import os

import pytest
from capture_fake_server import FakeOpenAIServer
from capture_helpers import openai_tool_agent
from otlp_collector import OTLPCollector
from ruler_judge_server import JudgeServer, by_content

import tracerl
import tracerl.integrations as ti
from tracerl.integrations import export
from tracerl.ruler import JudgeEndpoint, RulerJudge

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
pytest.importorskip("langgraph")
pytestmark = pytest.mark.asyncio(loop_scope="session")  # langchain-openai caches one async client per process
PK, SK = "pk-lf-test", "sk-lf-test"


@pytest.fixture(scope="module")
def hosted():
    """A stand-in for a hosted model (not a tracerl endpoint): usage in every response."""
    ti.instrument("openai", "langchain", "litellm")
    with FakeOpenAIServer() as server:
        yield server


@pytest.fixture(scope="module")
def collector():
    with OTLPCollector(PK, SK) as c:
        yield c


@pytest.fixture(scope="module")
def served():
    """A stand-in for a model served by tracerl (registered: token ids asked, cost zero)."""
    with FakeOpenAIServer() as server:
        ti.register_endpoint(server.base_url)
        yield server
        ti.unregister_endpoint(server.base_url)


@pytest.fixture()
def langfuse(collector, monkeypatch):
    for name in ("LANGFUSE_TRACING_ENVIRONMENT", "LANGFUSE_RELEASE"):
        monkeypatch.delenv(name, raising=False)
    ti.reset_error_counts()
    processor = ti.export_to_langfuse(collector.url, PK, SK, environment="rl-test")
    yield processor
    for active in export.otlp.active():
        active.shutdown()


def trainable(server, tmp_path, step: int = 3) -> tracerl.TrainableModel:
    model = tracerl.TrainableModel("agent", "obs", "smollm2-135m", inference_base_url=server.base_url, base_path=tmp_path)
    model._step_cache = step
    return model


def react_agent(base_url: str):
    """A LangGraph ReAct agent built the LangGraph way: ``ChatOpenAI`` + one ``@tool``."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def lookup(query: str) -> str:
        """Look something up."""
        return f"found {query}"

    llm = ChatOpenAI(model="gpt-4o-mini", base_url=base_url, api_key="x", max_retries=0)
    from langchain.agents import create_agent
    return create_agent(llm, [lookup])


def _served(server, first: int) -> tuple[int, int, int]:
    responses = server.responses[first:]
    return (
        len(responses),
        sum(r["usage"]["prompt_tokens"] for r in responses),
        sum(r["usage"]["completion_tokens"] for r in responses),
    )


async def test_react_agent_exports_one_generation_per_model_request(hosted, collector, langfuse):
    """Reported: 2 rollouts, 4 model requests -> 8 generations and twice the input tokens."""
    agent = react_agent(hosted.base_url)
    first = len(hosted.responses)
    trace_ids = []
    for question in ("one generation a", "one generation b"):
        async with ti.rollout(task=question, group="g-react") as r:
            await agent.ainvoke({"messages": [("user", question)]})
        trace_ids.append(r.trajectory.trace_id)
    assert langfuse.force_flush()
    requests, prompt_tokens, completion_tokens = _served(hosted, first)
    assert requests == 4
    generations = collector.generations(trace_ids)
    assert len(generations) == requests, [(g.name, g.parent_id) for g in generations]
    usage = collector.summed_usage(trace_ids)
    assert usage["input"] == prompt_tokens and usage["output"] == completion_tokens
    assert not [o.name for o in collector.observations(trace_ids) if o.would_tokenize]
    assert all(g.model == "gpt-4o-mini" and g.usage["input"] > 0 and not g.cost for g in generations)  # priced by Langfuse
    outer = [o for o in collector.observations(trace_ids) if o.name == "chat gpt-4o-mini" and o.type == "span"]
    assert len(outer) == requests and not any(o.usage or o.model for o in outer)  # LangChain's layer: a plain span
    for trace_id, question in zip(trace_ids, ("one generation a", "one generation b")):
        observations = collector.observations(trace_id)
        assert {(o.trace_name, o.session_id, o.environment) for o in observations} == {("rollout", "g-react", "rl-test")}
        (root,) = [o for o in observations if o.parent_id is None]
        assert root.type == "agent" and root.trace_input == root.input == question
        assert root.trace_output == root.output == f"answer: found {question}"  # the final answer
        assert {o.name for o in observations if o.type == "tool"} == {"lookup"}


async def test_trace_level_fields_on_every_observation(served, collector, langfuse, tmp_path):
    """Trace name from the model, session = group, tags = split + model, version/release = name@step,
    user, metadata and environment: on every observation, as Langfuse v4 reads them."""
    model = trainable(served, tmp_path)

    async def attempt(i: int) -> tracerl.Trajectory:  # an ART-style rollout function
        async with ti.rollout(model, task=f"fields {i}", split="train", user_id="user-7", tags=["exp-1"]) as r:
            await openai_tool_agent(model.openai_client(), f"fields {i}", model=model.get_inference_name())
            r.reward = float(i)
        return r.trajectory

    group = await tracerl.TrajectoryGroup(attempt(i) for i in range(2))
    ti.export_scores(group)
    assert langfuse.force_flush()
    trace_ids = [t.trace_id for t in group.trajectories]
    sessions = {t.metadata["group"] for t in group.trajectories}
    assert len(sessions) == 1  # one group id for the attempts, given by the group itself
    (session,) = sessions
    for trace_id in trace_ids:
        assert collector.trace_fields(trace_id) == {
            ("agent", session, "user-7", ("train", "agent", "exp-1"), "agent@3", "agent@3", "rl-test")
        }
        metadata = {k: v for o in collector.observations(trace_id) for k, v in o.trace_metadata.items()}
        assert metadata["model"] == "agent@3" and metadata["group"] == session and metadata["task"].startswith("fields")
    generations = collector.generations(trace_ids)
    assert len(generations) == 4 and all(g.cost == {"input": 0.0, "output": 0.0, "total": 0.0} for g in generations)
    collector.wait_for(lambda: {"group_reward", "group_reward_std_dev"} <= {s["name"] for s in collector.scores if s.get("sessionId") == session})
    by_name = {s["name"]: s for s in collector.scores if s.get("sessionId") == session}
    assert by_name["group_reward"]["value"] == 0.5 and by_name["group_reward_std_dev"]["value"] == 0.5
    assert {s["environment"] for s in collector.scores if s.get("traceId") in trace_ids or s.get("sessionId") == session} == {"rl-test"}


async def test_litellm_over_the_openai_sdk_is_one_generation(hosted, collector, langfuse):
    """LiteLLM drives the OpenAI SDK below ``create`` (our OpenAI hook does not see it); with
    OpenInference's OpenAI instrumentor it does, see test_export_openinference.py."""
    import litellm

    first = len(hosted.responses)
    async with ti.rollout(task="litellm", group="g-litellm") as r:
        for q in ("litellm one", "litellm two"):
            await litellm.acompletion(
                model="openai/gpt-4o-mini", api_base=hosted.base_url, api_key="x", messages=[{"role": "user", "content": q}]
            )
    assert langfuse.force_flush()
    requests, prompt_tokens, _ = _served(hosted, first)
    trace_id = r.trajectory.trace_id
    assert len(collector.generations(trace_id)) == requests == 2
    assert collector.summed_usage(trace_id)["input"] == prompt_tokens
    assert not [o.name for o in collector.observations(trace_id) if o.would_tokenize]


async def test_ruler_judge_call_is_an_evaluator_trace_in_the_group_session(served, collector, langfuse, tmp_path):
    model = trainable(served, tmp_path)
    with JudgeServer(by_content({"good": 1.0, "bad": 0.0})) as judge_server:
        group = await ti.trajectory_group(
            [openai_tool_agent(model.openai_client(), q, model=model.get_inference_name()) for q in ("good one", "bad one")],
            model=model, task="judged task",
        )
        judge = RulerJudge(JudgeEndpoint(judge_server.base_url, "scripted-judge"), cache=False)
        scored = await judge(group)
    assert langfuse.force_flush()
    session = scored.trajectories[0].metadata["group"]
    judge_trace = scored.trajectories[0].metadata["ruler"]["judge_trace_id"]
    observations = collector.observations(judge_trace)
    (root,) = [o for o in observations if o.parent_id is None]
    assert root.type == "evaluator" and root.trace_name == "ruler" and root.session_id == session
    assert {o.session_id for o in observations} == {session} and {o.environment for o in observations} == {"rl-test"}
    assert json.loads(root.output) == {t.id: t.reward for t in scored.trajectories}
    usage = collector.summed_usage(judge_trace)  # the judge's tokens, once: its model call carries them
    assert usage["input"] == 100 * judge_server.count and usage["output"] == 20 * judge_server.count
    assert len(collector.generations(judge_trace)) == judge_server.count
    roots = {t.trace_id: _root_id(collector, t.trace_id) for t in scored.trajectories}
    (judge_span,) = [s for s in collector.trace(judge_trace) if s.parent_span_id is None]
    assert sorted(judge_span.links) == sorted(roots.items())  # linked to the root of each trace it scored
    for t in scored.trajectories:
        collector.wait_for(lambda: any(o.name == "evaluation ruler" for o in collector.observations(t.trace_id)))
        (evaluation,) = [o for o in collector.observations(t.trace_id) if o.name == "evaluation ruler"]
        assert evaluation.type == "evaluator" and evaluation.session_id == session and evaluation.trace_name
        collector.wait_for(lambda: any(s.get("traceId") == t.trace_id and s["name"] == "ruler" for s in collector.scores))
        (score,) = [s for s in collector.scores if s.get("traceId") == t.trace_id and s["name"] == "ruler"]
        assert score["metadata"]["judge_trace_id"] == judge_trace and score["environment"] == "rl-test"
    collector.wait_for(lambda: any(s.get("sessionId") == session for s in collector.scores))
    by_name = {s["name"]: s["value"] for s in collector.scores if s.get("sessionId") == session}
    assert by_name["group_reward"] == 0.5 and by_name["group_reward_std_dev"] == 0.5


def _root_id(collector, trace_id):
    (root,) = [s for s in collector.trace(trace_id) if s.parent_span_id is None]
    return root.span_id


async def test_each_logged_step_is_a_training_step_trace_with_its_metrics_as_scores(served, collector, langfuse, tmp_path):
    model = trainable(served, tmp_path, step=5)
    group = await ti.trajectory_group(
        [openai_tool_agent(model.openai_client(), f"step {i}", model=model.get_inference_name()) for i in range(2)],
        model=model,
    )
    row = await model.log([group], split="train", step=5, metrics={"loss": 0.25})  # what the ART loop already calls
    assert langfuse.force_flush()
    steps = [o for o in collector.observations() if o.trace_name == "training step" and o.version == "agent@5"]
    (step,) = steps
    assert step.tags == ["train", "agent"] and step.environment == "rl-test" and json.loads(step.output) == json.loads(json.dumps(row))
    collector.wait_for(lambda: {"train/loss", "train/reward"} <= {s["name"] for s in collector.scores if s.get("traceId") == step.trace_id})
    scores = {s["name"]: s["value"] for s in collector.scores if s.get("traceId") == step.trace_id}
    assert scores["train/loss"] == 0.25 and scores["train/reward"] == row["train/reward"] and "step" not in scores
    session = group.trajectories[0].metadata["group"]
    assert any(s.get("sessionId") == session and s["name"] == "group_reward" for s in collector.scores)


async def test_langfuse_sdk_client_created_first_keeps_working_and_each_span_arrives_once(served, monkeypatch):
    """The SDK owns the provider (as ``Langfuse()`` does with the global one), told by its public
    ``should_export_span`` to send only its own spans; then export_to_langfuse: the SDK still sends
    its own spans, tracerl sends the rest with Langfuse's mapping, each once."""
    from langfuse import Langfuse
    from opentelemetry.sdk.trace import TracerProvider

    from tracerl.integrations import processor as capture

    monkeypatch.setattr(capture, "_provider", capture._provider)  # restored after the test
    monkeypatch.setattr(capture, "_tracer", capture._tracer)
    provider = TracerProvider()
    pk, sk = "pk-lf-sdk-first", "sk-lf-sdk-first"  # the SDK keeps one client per public key per process
    collector = OTLPCollector(pk, sk).start()
    lf = Langfuse(public_key=pk, secret_key=sk, base_url=collector.url, tracer_provider=provider,
                  should_export_span=export.langfuse_sdk_own_spans)  # fmt: skip
    ti.configure_tracing(provider)
    processor = ti.export_to_langfuse(collector.url, pk, sk, tracer_provider=provider)
    try:
        with lf.start_as_current_observation(name="app-step-2", as_type="span"):
            pass
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=served.base_url, api_key="x", max_retries=0)
        async with ti.rollout(task="sdk first", group="g-sdk") as r:
            await openai_tool_agent(client, "sdk first")
        lf.flush()
        assert processor.force_flush()
        trace_id = r.trajectory.trace_id
        spans = collector.trace(trace_id)
        assert len(spans) == len({s.span_id for s in spans}) == 3  # root + 2 calls, each once
        assert all("x-langfuse-sdk-name" not in s.headers for s in spans)  # sent by tracerl's exporter
        assert {o.session_id for o in collector.observations(trace_id)} == {"g-sdk"}
        assert len(collector.generations(trace_id)) == 2
        (app_step,) = [s for s in collector.spans if s.name == "app-step-2"]
        assert app_step.headers["x-langfuse-sdk-name"] == "python" and app_step.scope == "langfuse-sdk"
    finally:
        processor.shutdown()
        lf.shutdown()
        collector.stop()


async def test_trace_names_and_sessions_without_being_told(served, collector, langfuse):
    """Names: the decorated function, the awaited coroutine, else ``rollout``; sessions: one per
    gathered group, so an ART loop gets both without passing anything."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=served.base_url, api_key="x", max_retries=0)

    @ti.rollout(task="decorated")
    async def solve_task():
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "decorated"}])

    async def answer_question(q: str):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": q}])

    decorated = await solve_task()
    awaited = await ti.trajectory(answer_question("awaited"))
    groups = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(ti.trajectory(answer_question(f"{g}-{i}")) for i in range(2)) for g in ("x", "y")],
        pbar_desc=None,
    )
    assert langfuse.force_flush()
    assert {o.trace_name for o in collector.observations(decorated.trace_id)} == {"solve_task"}
    assert {o.trace_name for o in collector.observations(awaited.trace_id)} == {"answer_question"}
    sessions = [{o.session_id for t in g.trajectories for o in collector.observations(t.trace_id)} for g in groups]
    assert all(len(s) == 1 and None not in s for s in sessions) and sessions[0] != sessions[1]


async def test_configured_prices_give_the_cost_and_bad_knobs_are_clear_errors(hosted, collector, monkeypatch):
    from openai import AsyncOpenAI

    with pytest.raises(tracerl.ConfigError, match="environment 'Prod'"):
        ti.export_to_langfuse(collector.url, PK, SK, environment="Prod")
    monkeypatch.setenv("LANGFUSE_TRACING_ENVIRONMENT", "langfuse-internal")
    with pytest.raises(tracerl.ConfigError, match="not starting with 'langfuse'"):
        ti.export_to_langfuse(collector.url, PK, SK)
    monkeypatch.delenv("LANGFUSE_TRACING_ENVIRONMENT")
    with pytest.raises(tracerl.ConfigError, match=r"prices\['m'\]"):
        ti.export_to_langfuse(collector.url, PK, SK, prices={"m": 3.0})
    processor = ti.export_to_langfuse(collector.url, PK, SK, prices={"priced-model": (2.0, 8.0)}, release="v1.2")
    try:
        client = AsyncOpenAI(base_url=hosted.base_url, api_key="x", max_retries=0)
        async with ti.rollout(task="priced") as r:
            await client.chat.completions.create(model="priced-model", messages=[{"role": "user", "content": "priced"}])
        assert processor.force_flush()
        usage = hosted.responses[-1]["usage"]
        (generation,) = collector.generations(r.trajectory.trace_id)
        assert generation.cost["input"] == pytest.approx(usage["prompt_tokens"] * 2.0 / 1e6)
        assert generation.cost["total"] == pytest.approx((usage["prompt_tokens"] * 2.0 + usage["completion_tokens"] * 8.0) / 1e6)
        assert {o.release for o in collector.observations(r.trajectory.trace_id)} == {"v1.2"}
    finally:
        processor.shutdown()
