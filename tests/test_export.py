"""Exporting spans and scores to Langfuse / any OTLP backend, against a real local collector."""

from __future__ import annotations

import pytest
from loopback_app import free_port as _free_port
from capture_helpers import openai_tool_agent, sampled
from otlp_collector import OTLPCollector

import tracerl
import tracerl.integrations as ti
from tracerl.integrations import export, semconv
from tracerl.integrations.processor import get_tracer
from tracerl.ruler import TrajectoryScore, apply_scores

PK, SK = "pk-lf-test", "sk-lf-test"


@pytest.fixture(scope="module")
def server(served_fake):
    return served_fake


@pytest.fixture()
def client(served_client):
    return served_client


@pytest.fixture(scope="module")
def collector():
    with OTLPCollector(PK, SK) as c:
        yield c


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    for name in ("LANGFUSE_HOST", "LANGFUSE_BASE_URL", "LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY"):
        monkeypatch.delenv(name, raising=False)
    ti.reset_error_counts()
    yield
    for processor in export.otlp.active():
        processor.shutdown()


@pytest.fixture()
def langfuse(collector):
    processor = ti.export_to_langfuse(collector.url, PK, SK)
    yield processor
    processor.shutdown()


def _root(spans):
    roots = [s for s in spans if s.parent_span_id is None]
    assert len(roots) == 1, [(s.name, s.parent_span_id) for s in spans]
    return roots[0]


async def test_rollout_reaches_langfuse_as_one_trace_with_langfuse_attributes(collector, client, langfuse):
    async with ti.rollout(task="q-export", group="g-export") as r:
        answer = await openai_tool_agent(client, "marker-E")
        get_tracer().start_span(  # what the LangChain / MCP hooks write for a tool call
            "execute_tool lookup", attributes={semconv.OPERATION_NAME: semconv.OP_EXECUTE_TOOL, semconv.TOOL_NAME: "lookup"}
        ).end()
        r.reward = 0.75
    assert answer == "answer: looked up: marker-E" and len(sampled(r.trajectory)) == 2  # capture unaffected
    assert langfuse.force_flush()
    trace_id = r.trajectory.trace_id
    collector.wait_for(lambda: len(collector.trace(trace_id)) == 4)
    spans = collector.trace(trace_id)
    root = _root(spans)
    assert root.name == "rollout" and root.scope == semconv.SCOPE
    assert root.attributes[semconv.OPERATION_NAME] == "invoke_agent"
    assert root.attributes["langfuse.observation.type"] == "agent"
    assert root.attributes["langfuse.trace.name"] == "rollout"
    assert root.attributes["session.id"] == "g-export"
    assert root.attributes["langfuse.trace.metadata.task"] == "q-export"
    assert ("gen_ai.evaluation.result", {"gen_ai.evaluation.name": "reward", "gen_ai.evaluation.score.value": 0.75}) in root.events
    chats = [s for s in spans if s.name == "chat m"]
    assert len(chats) == 2
    response_ids = {c.response_id for c in sampled(r.trajectory)}
    for chat in chats:
        assert chat.parent_span_id == root.span_id
        assert chat.attributes["langfuse.observation.type"] == "generation"
        assert chat.attributes["gen_ai.request.model"] == "m" and chat.attributes["gen_ai.operation.name"] == "chat"
        assert chat.attributes["gen_ai.response.id"] in response_ids
        assert "marker-E" in chat.attributes["gen_ai.input.messages"]
    (tool,) = [s for s in spans if s.name == "execute_tool lookup"]
    assert tool.parent_span_id == root.span_id and tool.attributes["langfuse.observation.type"] == "tool"
    headers = root.headers
    assert root.path == "/api/public/otel/v1/traces" and headers["content-encoding"] == "gzip"
    assert headers["x-langfuse-ingestion-version"] == "4" and headers["authorization"] == collector.expected_auth
    collector.wait_for(lambda: any(s.get("traceId") == trace_id for s in collector.scores))
    (score,) = [s for s in collector.scores if s.get("traceId") == trace_id]
    assert score == {
        "id": f"{trace_id}-reward", "traceId": trace_id, "observationId": root.span_id, "name": "reward", "value": 0.75,
        "dataType": "NUMERIC", "environment": "default",
    }  # fmt: skip
    assert ti.capture_error_counts() == {}


async def test_ruler_scores_arrive_as_scores_and_evaluation_spans(collector, client, langfuse):
    group = await ti.trajectory_group(
        [ti.trajectory(client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"r{i}"}])) for i in range(2)],
        task="ruler-task",
    )
    scores = [
        TrajectoryScore(t.id, score, f"explanation {i}", judge="judge-model")
        for i, (t, score) in enumerate(zip(group.trajectories, (0.2, 0.9)))
    ]
    scored = apply_scores(group, scores)  # the RULER hook exports without being asked
    assert langfuse.force_flush()
    for trajectory, expected in zip(scored.trajectories, (0.2, 0.9)):
        trace_id = trajectory.trace_id
        collector.wait_for(lambda: {"reward", "ruler"} <= {s["name"] for s in collector.scores if s.get("traceId") == trace_id})
        by_name = {s["name"]: s for s in collector.scores if s.get("traceId") == trace_id}
        assert by_name["ruler"]["value"] == expected and by_name["ruler"]["comment"] == trajectory.metadata["ruler"]["explanation"]
        assert by_name["ruler"]["metadata"]["judge"] == "judge-model" and by_name["ruler"]["id"] == f"{trace_id}-ruler"
        assert by_name["reward"]["value"] == expected and by_name["independent_reward"]["value"] == 0.0
        collector.wait_for(lambda: any(s.name == "evaluation ruler" for s in collector.trace(trace_id)))
        root = _root(collector.trace(trace_id))
        (evaluation,) = [s for s in collector.trace(trace_id) if s.name == "evaluation ruler"]
        assert evaluation.parent_span_id == root.span_id
        assert evaluation.attributes["gen_ai.evaluation.name"] == "ruler"
        assert evaluation.attributes["gen_ai.evaluation.score.value"] == expected
        assert evaluation.attributes["gen_ai.evaluation.explanation"] == trajectory.metadata["ruler"]["explanation"]
        assert evaluation.attributes["langfuse.observation.type"] == "evaluator"
        assert evaluation.events[0][0] == "gen_ai.evaluation.result"
    count = len(collector.scores)
    assert ti.export_scores(scored) is scored  # unchanged scores are not sent again
    assert langfuse.force_flush() and len(collector.scores) == count


async def test_plain_otlp_endpoint_gets_spans_and_evaluations(collector, client):
    processor = ti.export_to_otlp(f"{collector.url}/v1/traces")
    assert ti.export_to_otlp(f"{collector.url}/v1/traces") is processor  # attached once
    async with ti.rollout(task="plain") as r:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "plain"}])
    trajectory = r.trajectory.model_copy(update={"reward": 0.5})
    ti.export_scores([trajectory])
    assert processor.force_flush()
    trace_id = trajectory.trace_id
    collector.wait_for(lambda: len(collector.trace(trace_id)) == 3)
    spans = collector.trace(trace_id)
    assert {s.path for s in spans} == {"/v1/traces"} and "authorization" not in spans[0].headers
    root = _root(spans)
    (evaluation,) = [s for s in spans if s.name == "evaluation reward"]
    assert evaluation.parent_span_id == root.span_id and evaluation.attributes["gen_ai.evaluation.score.value"] == 0.5
    assert not [s for s in collector.scores if s.get("traceId") == trace_id]  # no Langfuse, no score POSTs


def test_missing_swapped_or_wrong_keys_and_bad_urls_are_clear_errors(collector, monkeypatch):
    with pytest.raises(tracerl.ConfigError, match="LANGFUSE_PUBLIC_KEY.*LANGFUSE_SECRET_KEY"):
        ti.export_to_langfuse(collector.url)
    with pytest.raises(ValueError, match="LANGFUSE_SECRET_KEY"):
        ti.export_to_langfuse(collector.url, public_key=PK)
    with pytest.raises(tracerl.ConfigError, match="swapped"):
        ti.export_to_langfuse(collector.url, SK, PK)
    with pytest.raises(tracerl.ConfigError, match="rejected the keys \\(401\\)"):
        ti.export_to_langfuse(collector.url, PK, "sk-lf-wrong", check=True)
    with pytest.raises(tracerl.ConfigError, match="not an http"):
        ti.export_to_langfuse("localhost:3000", PK, SK)
    with pytest.raises(tracerl.ConfigError, match="OTLP endpoint 'collector:4318' is not an http"):
        ti.export_to_otlp("collector:4318")
    with pytest.raises(tracerl.ConfigError, match="cannot reach Langfuse"):
        ti.export_to_langfuse(f"http://127.0.0.1:{_free_port()}", PK, SK, check=True, timeout_s=2)
    monkeypatch.setenv("LANGFUSE_BASE_URL", collector.url)
    monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", PK)
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", SK)
    processor = ti.export_to_langfuse(check=True)
    assert processor.endpoint == f"{collector.url}/api/public/otel/v1/traces"


async def test_wrong_keys_at_export_time_are_counted_not_raised(collector, client):
    processor = ti.export_to_langfuse(collector.url, PK, "sk-lf-wrong")
    async with ti.rollout() as r:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "wrong keys"}])
        r.reward = 1.0
    assert sampled(r.trajectory)[0].message["content"] == "answer: wrong keys"
    processor.force_flush()
    counts = ti.capture_error_counts()
    assert counts.get("otlp_export", 0) >= 1 and counts.get("langfuse_auth", 0) >= 1
    assert not [s for s in collector.spans if s.trace_id == r.trajectory.trace_id]


async def test_collector_down_never_breaks_the_agent(client):
    port = _free_port()  # nothing listens here
    processor = ti.export_to_langfuse(f"http://127.0.0.1:{port}", PK, SK, timeout_s=1)
    async with ti.rollout(task="down") as r:
        answer = await openai_tool_agent(client, "marker-D")
        r.reward = 0.25
    assert answer == "answer: looked up: marker-D" and r.trajectory.reward == 0.25
    assert ti.export_scores(r.trajectory) is r.trajectory
    processor.force_flush(5000)
    counts = ti.capture_error_counts()
    assert counts.get("otlp_export", 0) >= 1 and counts.get("langfuse_scores", 0) >= 1


def test_export_scores_without_exporter_or_trace_id_only_counts():
    trajectory = tracerl.Trajectory(messages_and_choices=[], reward=1.0)
    assert ti.export_scores(trajectory) is trajectory
    assert ti.capture_error_counts() == {"export_not_configured": 1}


def test_export_scores_counts_trajectories_without_trace_id(collector, langfuse):
    trajectory = tracerl.Trajectory(messages_and_choices=[], reward=1.0)
    ti.export_scores(tracerl.TrajectoryGroup([trajectory]))
    assert ti.capture_error_counts() == {"export_scores_no_trace": 1}


async def test_langfuse_sdk_and_tracerl_share_one_provider(collector, client, monkeypatch):
    """The Langfuse SDK owns the provider and its exporter; tracerl captures on it, and
    tracerl's spans (MCP protocol spans included, with ``langfuse_span_filter``) reach Langfuse
    next to the SDK's own spans, while the trajectory is still built."""
    from langfuse import Langfuse
    from langfuse.span_filter import is_default_export_span
    from opentelemetry.sdk.trace import TracerProvider

    from tracerl.integrations import processor as capture

    monkeypatch.setattr(capture, "_provider", capture._provider)  # restored after the test
    monkeypatch.setattr(capture, "_tracer", capture._tracer)
    provider = TracerProvider()
    lf = Langfuse(
        public_key=PK, secret_key=SK, base_url=collector.url, tracer_provider=provider,
        should_export_span=export.langfuse_span_filter,
    )  # fmt: skip
    ti.configure_tracing(provider)
    with lf.start_as_current_observation(name="app-step", as_type="span"):
        pass
    async with ti.rollout(task="sdk") as r:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "via sdk"}])
        tools_list = get_tracer().start_span("tools/list", attributes={semconv.MCP_METHOD_NAME: "tools/list", semconv.LAYER: "mcp"})
        tools_list.end()
    assert sampled(r.trajectory)[0].message["content"] == "answer: via sdk"
    assert not is_default_export_span(tools_list) and export.langfuse_span_filter(tools_list)
    lf.flush()
    trace_id = r.trajectory.trace_id
    collector.wait_for(lambda: len(collector.trace(trace_id)) == 3 and any(s.name == "app-step" for s in collector.spans))
    spans = collector.trace(trace_id)
    root = _root(spans)
    assert {s.name for s in spans} == {"rollout", "chat m", "tools/list"}
    assert all(s.parent_span_id == root.span_id for s in spans if s is not root)
    assert all(s.headers["x-langfuse-sdk-name"] == "python" for s in spans)  # sent by the SDK's exporter
    (app_step,) = [s for s in collector.spans if s.name == "app-step"]
    assert app_step.scope == "langfuse-sdk" and app_step.trace_id != trace_id
    lf.shutdown()
