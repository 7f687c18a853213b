"""Importing OTLP trace files: what tracerl exported, and what OpenInference's instrumentors
recorded without tracerl (in a process of their own), come back as the trajectories tracerl
captures live.  Files are written by the loopback collector as the OpenTelemetry
Collector's file exporter writes them (OTLP JSON lines, length-prefixed protobuf)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from capture_fake_server import FakeOpenAIServer, Reply
from capture_helpers import openai_tool_agent
from otlp_collector import OTLPCollector

import tracerl
import tracerl.integrations as ti
from tracerl.integrations import importers
from tracerl.integrations.importers import ImportSummary, TraceImportError, import_otlp

pytest.importorskip("langgraph")
session_loop = pytest.mark.asyncio(loop_scope="session")  # on the async tests only: a mark on sync ones warns
TESTS = Path(__file__).parent


def script(body: dict[str, Any]) -> Reply:
    """Call the first offered tool once (``add`` with numbers), then answer with its result."""
    messages, tools = body["messages"], body.get("tools") or []
    results = [m for m in messages if m["role"] == "tool"]
    if tools and not results:
        name = tools[0]["function"]["name"]
        question = next(m["content"] for m in messages if m["role"] == "user")
        return Reply(tool_calls=[(name, {"a": 2, "b": 3} if name == "add" else {"query": question})])
    return Reply(content=f"done: {results[-1]['content'] if results else ''}")


@pytest.fixture(scope="module")
def server():
    ti.instrument("openai", "langchain")
    with FakeOpenAIServer(script) as srv:
        ti.register_endpoint(srv.base_url)  # tracerl-served: captured turns carry token ids
        yield srv
        ti.unregister_endpoint(srv.base_url)


@pytest.fixture()
def collector():
    with OTLPCollector() as c:
        yield c


def react_agent(server) -> Any:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langchain.agents import create_agent

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = ChatOpenAI(model="policy", base_url=server.base_url, api_key="x", max_retries=0)
    return create_agent(llm, [add], system_prompt="Use the tools.")


def numbered_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with tool-call ids numbered by first use (two runs draw different ids)."""
    ids: dict[str, str] = {}
    out = json.loads(json.dumps(messages))
    for message in out:
        for call in message.get("tool_calls") or ():
            call["id"] = ids.setdefault(call["id"], f"call-{len(ids)}")
        if message.get("tool_call_id"):
            message["tool_call_id"] = ids.setdefault(message["tool_call_id"], f"call-{len(ids)}")
    return out


async def captured_rollouts(server, questions: list[str], kind: str) -> list[tracerl.Trajectory]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    agent = react_agent(server)
    out = []
    for question in questions:
        async with ti.rollout(task=question, group=f"group-{kind}") as r:
            if kind == "langgraph":
                await agent.ainvoke({"messages": [("user", question)]})
            else:
                await openai_tool_agent(client, question)
        out.append(r.trajectory)
    return out


async def exported_rollouts(server, collector, *runs: tuple[list[str], str], compression: str = "gzip") -> list[tracerl.Trajectory]:
    """Rollouts captured by tracerl and exported over OTLP to ``collector`` (all of them arrived)."""
    exporter = ti.export_to_otlp(collector.url + "/v1/traces", compression=compression)
    try:
        captured = []
        for questions, kind in runs:
            captured += await captured_rollouts(server, questions, kind)
        ti.get_tracer_provider().force_flush()
        ids = {t.trace_id for t in captured}
        collector.wait_for(lambda: ids <= {s.trace_id for s in collector.spans if s.parent_span_id is None})
    finally:
        exporter.shutdown()
    return captured


# -- round trips -------------------------------------------------------------------------------------
@session_loop
@pytest.mark.parametrize("file_format", ["json", "proto"])
async def test_rollouts_tracerl_exported_come_back_as_captured(file_format, server, collector, tmp_path):
    captured = await exported_rollouts(server, collector, (["add two and three", "now sum"], "langgraph"), (["look it up"], "openai"))
    ids = {t.trace_id for t in captured}
    path = collector.dump(tmp_path / f"traces.{file_format}", file_format)
    summary = ImportSummary()
    imported = {t.trace_id: t for t in import_otlp(path, summary=summary)}
    assert set(imported) >= ids and summary.duplicate_traces == 0
    for live in captured:
        back = imported[live.trace_id]
        assert back.messages() == live.messages()
        assert back.tools == live.tools
        assert [c.response_id for c in back.sampled_turns()] == [c.response_id for c in live.sampled_turns()]
        assert all(c.token_ids is None for c in back.sampled_turns())  # token ids never leave the process
        assert back.metadata["retokenized"] is True
        assert back.metadata["task"] == live.metadata["task"] and back.metadata["session"] == live.metadata["group"]
        provenance = back.metadata["import"]
        assert provenance["source"] == "otlp" and provenance["trace_id"] == live.trace_id
        assert len(provenance["span_ids"]) >= len(back.sampled_turns())


@session_loop
@pytest.mark.parametrize("kind", ["langgraph", "openai"])
async def test_openinference_traces_recorded_without_tracerl_come_back_as_captured(kind, server, collector, tmp_path):
    questions = ["add two and three", "sum it up"]
    record_without_tracerl(kind, server, collector, questions)
    assert not any(s.scope.startswith("tracerl") for s in collector.spans)
    path = collector.dump(tmp_path / "openinference.jsonl")
    summary = ImportSummary()
    imported = import_otlp(path, summary=summary)
    captured = await captured_rollouts(server, questions, kind)
    assert [numbered_ids(t.messages()) for t in imported] == [numbered_ids(t.messages()) for t in captured]
    assert [t.tools for t in imported] == [t.tools for t in captured]
    for t in imported:
        assert len(t.sampled_turns()) == 2 and t.additional_histories == []  # both model turns are trainable turns
    if kind == "langgraph":  # the OpenAI SDK's span of each request is a trace of its own: a duplicate
        assert summary.duplicate_traces == 4 and summary.stitched_traces == 0
    else:  # every request is a trace of its own: each conversation is stitched from two
        assert summary.stitched_traces == 2 and len(imported[0].metadata["import"]["trace_ids"]) == 2


def record_without_tracerl(kind: str, server, collector, questions: list[str]) -> None:
    """Run the agent in a process of its own, traced by OpenInference only, into ``collector``."""
    subprocess.run(
        [sys.executable, str(TESTS / "openinference_agent.py"), kind, server.base_url, collector.url + "/v1/traces", *questions],
        check=True, timeout=120, env={**os.environ, "PYTHONPATH": str(TESTS)},
    )  # fmt: skip


@session_loop
async def test_imported_traffic_can_be_judged_by_ruler(server, collector, tmp_path):
    from ruler_judge_server import JudgeServer, by_content

    from tracerl.ruler import JudgeEndpoint, ruler_score_group

    record_without_tracerl("openai", server, collector, ["first try", "second try", "third try"])
    group = tracerl.TrajectoryGroup(import_otlp(collector.dump(tmp_path / "traffic.jsonl")))
    with JudgeServer(by_content({"second": 0.9, "third": 0.5}, default=0.1)) as judge:
        scored = await ruler_score_group(group, JudgeEndpoint(judge.base_url, "scripted-judge"), cache=False)
        [request] = judge.requests
    assert [t.messages()[1]["content"] for t in scored] == ["first try", "second try", "third try"]
    assert scored.rewards == [0.1, 0.9, 0.5]
    assert "looked up: second try" in request["messages"][1]["content"]  # tool results are judged too
    assert all(t.metadata["ruler"]["explanation"] for t in scored)
    out = tmp_path / "judged.jsonl"
    importers.write_jsonl(out, [scored])
    [back] = importers.read_groups(out)
    assert back.rewards == [0.1, 0.9, 0.5] and back.trajectories[1].metadata["ruler"]["score"] == 0.9


# -- files ---------------------------------------------------------------------------------------------
@session_loop
async def test_a_torn_or_malformed_file_fails_naming_where(server, collector, tmp_path):
    await exported_rollouts(server, collector, (["one", "two"], "openai"), compression="none")
    proto = collector.dump(tmp_path / "traces.pb", "proto")
    data = proto.read_bytes()
    torn = tmp_path / "torn.pb"
    torn.write_bytes(data[: len(data) - 7])  # the writer died mid-message
    with pytest.raises(TraceImportError, match=r"torn\.pb, byte \d+: .*runs past the end"):
        import_otlp(torn)
    lines = collector.dump(tmp_path / "traces.jsonl").read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(lines[0] + "\n" + '{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": 5}]}]}]}' + "\n")
    with pytest.raises(TraceImportError, match=r"bad\.jsonl, line 2"):
        import_otlp(bad)
    with pytest.raises(TraceImportError, match="cannot read"):
        import_otlp(tmp_path / "missing.jsonl")
    assert isinstance(TraceImportError("x"), tracerl.TracerlError) and isinstance(TraceImportError("x"), ValueError)


@session_loop
async def test_jsonl_out_and_back_groups_by_session_and_task(server, collector, tmp_path):
    await exported_rollouts(server, collector, (["same task", "same task"], "openai"), (["other task"], "langgraph"))
    imported = import_otlp(collector.dump(tmp_path / "t.jsonl"))
    by_session = importers.group_trajectories(imported, by="session")
    assert sorted(len(g) for g in by_session) == [1, 2]
    assert {g.metadata["session"] for g in by_session} == {"group-openai", "group-langgraph"}
    by_task = importers.group_trajectories(imported, by="task")
    assert sorted((g.metadata["task"], len(g)) for g in by_task) == [("other task", 1), ("same task", 2)]
    out = tmp_path / "groups.jsonl"
    assert importers.write_jsonl(out, by_task) == 3
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    back = [tracerl.Trajectory.from_json_dict(row) for row in rows]
    assert [t.messages() for t in back] == [t.messages() for g in by_task for t in g]
    assert all(isinstance(c, tracerl.Choice) for t in back for c in t.sampled_turns())
    assert sorted(len(g) for g in importers.read_groups(out)) == [1, 2]


@session_loop
async def test_cli_imports_a_file_to_trajectory_jsonl(server, collector, tmp_path):
    captured = await exported_rollouts(server, collector, (["cli task", "cli task"], "openai"))
    source = collector.dump(tmp_path / "in.pb", "proto")
    out = tmp_path / "out.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "tracerl.cli", "import", "otlp", str(source), "--out", str(out), "--group-by", "task"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "2 trajectories" in result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["group"] for row in rows] == [0, 0]
    assert [tracerl.Trajectory.from_json_dict(row).messages() for row in rows] == [t.messages() for t in captured]
    bad = subprocess.run(
        [sys.executable, "-m", "tracerl.cli", "import", "otlp", str(tmp_path / "nope.pb"), "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode != 0 and "nope.pb" in bad.stderr and "Traceback" not in bad.stderr


def test_public_api_is_pinned():
    assert sorted(importers.__all__) == [
        "ImportSummary", "LangfuseReader", "TraceImportError", "TraceInfo", "TraceSourceError", "group_trajectories",
        "import_langfuse", "import_otlp", "read_groups", "read_jsonl", "read_otlp_file", "trajectories_from_spans",
        "write_jsonl",
    ]  # fmt: skip
