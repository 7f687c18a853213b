"""Importing from Langfuse's public API: traces recorded by Langfuse's own SDK (its LangChain
CallbackHandler, exporting over OTLP as it does to Langfuse) and by tracerl's exporter are
read back from a Langfuse stand-in on loopback (Langfuse's field names, page and cursor
pagination over several pages, a 429 with Retry-After) and give the captured trajectories."""

from __future__ import annotations

import os
import subprocess
import sys
import pytest
from capture_fake_server import FakeOpenAIServer
from langfuse_api_server import LangfuseAPIServer
from test_import_otlp import captured_rollouts, numbered_ids, react_agent, script

import tracerl
import tracerl.integrations as ti
from tracerl.integrations.importers import ImportSummary, LangfuseReader, TraceSourceError, import_langfuse

pytest.importorskip("langgraph")
pytest.importorskip("langfuse")
session_loop = pytest.mark.asyncio(loop_scope="session")  # on the async tests only: a mark on sync ones warns
KEYS = {"public_key": "pk-lf-import", "secret_key": "sk-lf-import"}
QUESTIONS = ["add two and three", "sum it up", "what is the total", "once more"]


@pytest.fixture(scope="module")
def server():
    ti.instrument("openai", "langchain")
    with FakeOpenAIServer(script) as srv:
        ti.register_endpoint(srv.base_url)
        yield srv
        ti.unregister_endpoint(srv.base_url)


@pytest.fixture(scope="module")
def recorded_by_langfuse(server):
    """Four LangGraph runs traced by Langfuse's own CallbackHandler into the stand-in (two sessions)."""
    from langfuse import Langfuse
    from langfuse.langchain import CallbackHandler
    from opentelemetry.sdk.trace import TracerProvider

    with LangfuseAPIServer(**KEYS) as lf:
        client = Langfuse(**KEYS, base_url=lf.url, tracer_provider=TracerProvider())
        handler = CallbackHandler(public_key=KEYS["public_key"])
        agent = react_agent(server)

        async def run_all() -> None:
            for i, question in enumerate(QUESTIONS):
                metadata = {"langfuse_session_id": f"session-{i % 2}", "langfuse_tags": ["prod", f"q{i}"]}
                await agent.ainvoke({"messages": [("user", question)]}, config={"callbacks": [handler], "metadata": metadata})

        yield lf, run_all, client


@session_loop
async def test_langfuse_sdk_traces_come_back_as_captured(server, recorded_by_langfuse):
    lf, run_all, client = recorded_by_langfuse
    await run_all()
    client.flush()
    lf.wait_for(lambda: len(lf.trace_objects()) == len(QUESTIONS))
    limited = len(lf.reads) + 3  # the third read request from now: 429, Retry-After: 1
    lf.rate_limit_requests = {limited}
    waits: list[float] = []
    summary = ImportSummary()
    imported = import_langfuse(lf.url, **KEYS, page_size=1, summary=summary, sleep=waits.append)
    captured = await captured_rollouts(server, QUESTIONS, "langgraph")
    assert [numbered_ids(t.messages()) for t in imported] == [numbered_ids(t.messages()) for t in captured]
    assert [t.tools for t in imported] == [t.tools for t in captured]
    assert waits == [1.0]  # the server's Retry-After, honoured ...
    [(path, query, _), (again_path, again_query, _)] = [r for r in lf.reads if r[2] in (limited, limited + 1)]
    assert (again_path, again_query) == (path, query)  # ... then the same request again
    trace_pages = [q for path, q, _ in lf.reads if path == "/api/public/traces"]
    assert [q["page"] for q in trace_pages] == ["1", "2", "3", "4"]
    assert all(q["limit"] == "1" and q["orderBy"] == "timestamp.asc" for q in trace_pages)
    observation_reads = [q for path, q, _ in lf.reads if path == "/api/public/v2/observations"]
    per_trace = [len(lf.observation_objects(t["id"], raw_io=True)) for t in lf.trace_objects()]
    assert len(observation_reads) == sum(per_trace) + 1  # one page per observation, one retried
    assert sum("cursor" in q for q in observation_reads) >= sum(per_trace) - 4  # followed meta.cursor
    for t, trace_object in zip(imported, lf.trace_objects()):
        provenance = t.metadata["import"]
        assert provenance["source"] == "langfuse" and provenance["trace_id"] == trace_object["id"] == t.trace_id
        observations = {o["id"]: o for o in lf.observation_objects(trace_object["id"], raw_io=True)}
        assert [observations[i]["type"] for i in provenance["observation_ids"]] == ["GENERATION", "TOOL", "GENERATION"]
        assert t.metadata["retokenized"] is True and all(c.token_ids is None for c in t.sampled_turns())
    assert [t.metadata["session"] for t in imported] == ["session-0", "session-1", "session-0", "session-1"]
    assert sorted(imported[0].metadata["tags"]) == ["prod", "q0"]


@session_loop
async def test_filters_reach_the_api_and_pick_the_traces(recorded_by_langfuse):
    lf, run_all, client = recorded_by_langfuse
    if len(lf.trace_objects()) < len(QUESTIONS):
        await run_all()
        client.flush()
        lf.wait_for(lambda: len(lf.trace_objects()) >= len(QUESTIONS))
    lf.rate_limit_requests = set()
    session_1 = import_langfuse(lf.url, **KEYS, session="session-1")
    assert [t.metadata["session"] for t in session_1] == ["session-1", "session-1"]
    tagged = import_langfuse(lf.url, **KEYS, tags=["prod", "q2"])
    assert [t.messages()[1]["content"] for t in tagged] == [QUESTIONS[2]]
    one = lf.trace_objects()[3]["id"]
    by_id = import_langfuse(lf.url, **KEYS, trace_ids=[one])
    assert [t.trace_id for t in by_id] == [one]
    assert import_langfuse(lf.url, **KEYS, since="2999-01-01T00:00:00Z") == []
    assert len(import_langfuse(lf.url, **KEYS, since="1h", limit=3)) == 3
    assert import_langfuse(lf.url, **KEYS, name="no such trace") == []
    sent = [q for path, q, _ in lf.reads if path == "/api/public/traces"]
    assert any(q.get("sessionId") == "session-1" for q in sent)
    assert any(q.get("fromTimestamp") == "2999-01-01T00:00:00Z" for q in sent)
    assert any(q.get("name") == "no such trace" for q in sent)


@session_loop
async def test_tracerl_exported_traces_come_back_exactly(server):
    """export_to_langfuse -> Langfuse's ingestion mapping -> public API -> the same trajectories."""
    with LangfuseAPIServer(**KEYS) as lf:
        exporter = ti.export_to_langfuse(lf.url, **KEYS)
        try:
            captured = await captured_rollouts(server, ["add two and three", "sum it up"], "langgraph")
            captured += await captured_rollouts(server, ["look it up"], "openai")
            exporter.force_flush()
            ids = {t.trace_id for t in captured}
            lf.wait_for(lambda: ids <= {t["id"] for t in lf.trace_objects()})
        finally:
            exporter.shutdown()
        imported = {t.trace_id: t for t in import_langfuse(lf.url, **KEYS, trace_ids=sorted(ids))}
        generations = [o for t in ids for o in lf.observation_objects(t, raw_io=False) if o["type"] == "GENERATION"]
    # Langfuse moves gen_ai.tool.definitions into the generation's input: {"messages": [...], "tools": [...]}
    assert generations and all(isinstance(o["input"], dict) and o["input"]["tools"] for o in generations)
    for live in captured:
        back = imported[live.trace_id]
        assert back.messages() == live.messages()
        assert back.tools == live.tools and live.tools
        assert back.metadata["task"] == live.metadata["task"]


@session_loop
async def test_an_older_server_without_v2_observations_is_read_page_by_page(server):
    with LangfuseAPIServer(v2=False, **KEYS) as lf:
        exporter = ti.export_to_langfuse(lf.url, **KEYS)
        try:
            [live] = await captured_rollouts(server, ["look it up"], "openai")
            exporter.force_flush()
            lf.wait_for(lambda: live.trace_id in {t["id"] for t in lf.trace_objects()})
        finally:
            exporter.shutdown()
        with LangfuseReader(lf.url, **KEYS, page_size=2) as reader:
            observations = reader.observations(live.trace_id)
        pages = [q["page"] for path, q, _ in lf.reads if path == "/api/public/observations"]
        [back] = import_langfuse(lf.url, **KEYS, trace_ids=[live.trace_id])
    assert len(observations) == len(lf.observation_objects(live.trace_id, raw_io=False)) > 2
    assert pages == [str(p) for p in range(1, len(pages) + 1)] and len(pages) >= 2
    assert back.messages() == live.messages()


# -- faults ----------------------------------------------------------------------------------------------
def test_wrong_keys_fail_clearly():
    with LangfuseAPIServer(**KEYS) as lf:
        with pytest.raises(TraceSourceError, match="rejected the keys"):
            import_langfuse(lf.url, public_key="pk-lf-wrong", secret_key="sk-lf-wrong")
    with pytest.raises(tracerl.ConfigError, match="LANGFUSE_SECRET_KEY"):
        LangfuseReader("http://127.0.0.1:9", public_key="pk-lf-x", secret_key="")
    with pytest.raises(tracerl.ConfigError, match="not an http"):
        LangfuseReader("localhost:3000", **KEYS)


def test_a_server_that_keeps_rate_limiting_fails_after_the_retries():
    with LangfuseAPIServer(rate_limit_requests=tuple(range(1, 10)), retry_after="0.01", **KEYS) as lf:
        with pytest.raises(TraceSourceError, match="answered 429"):
            import_langfuse(lf.url, **KEYS, max_retries=3)
        assert len(lf.reads) == 4


def test_a_hanging_server_times_out_instead_of_hanging():
    with LangfuseAPIServer(hang_s=5.0, **KEYS) as lf:
        with pytest.raises(TraceSourceError, match="failed 2 times"):
            import_langfuse(lf.url, **KEYS, timeout_s=0.2, max_retries=1, sleep=lambda s: None)


def test_an_unreachable_host_fails_clearly():
    from loopback_app import free_port

    with pytest.raises(TraceSourceError, match="ConnectError"):
        import_langfuse(f"http://127.0.0.1:{free_port()}", **KEYS, max_retries=0)


def test_cli_reads_keys_from_the_environment(tmp_path):
    with LangfuseAPIServer(**KEYS) as lf:
        out = tmp_path / "out.jsonl"
        env = {**os.environ, "LANGFUSE_PUBLIC_KEY": KEYS["public_key"], "LANGFUSE_SECRET_KEY": KEYS["secret_key"],
               "LANGFUSE_BASE_URL": lf.url}  # fmt: skip
        result = subprocess.run(
            [sys.executable, "-m", "tracerl.cli", "import", "langfuse", "--session", "none-yet", "--out", str(out)],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert "0 trajectories" in result.stderr and out.read_text() == ""
        assert lf.reads and lf.reads[0][1]["sessionId"] == "none-yet"
        env["LANGFUSE_SECRET_KEY"] = "sk-lf-wrong"
        bad = subprocess.run(
            [sys.executable, "-m", "tracerl.cli", "import", "langfuse", "--out", str(out)],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert bad.returncode == 1 and "rejected the keys" in bad.stderr and "Traceback" not in bad.stderr

