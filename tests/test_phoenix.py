"""A real Phoenix server receives a captured LangGraph rollout over OTLP; read back through
Phoenix's own API, every span keeps its parent and its attributes (span kinds, GenAI
attributes, LangGraph metadata).  The spans also go to the loopback collector, which
records exactly what was sent, to compare against."""

from __future__ import annotations

import json

import pytest
from capture_fake_server import FakeOpenAIServer
from otlp_collector import OTLPCollector
from test_import_otlp import react_agent, script

import tracerl.integrations as ti

pytest.importorskip("phoenix.client", reason="install the phoenix extra: pip install -e '.[phoenix]'")
pytest.importorskip("langgraph")
pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture(scope="module")
def phoenix():
    from phoenix_server import PhoenixServer

    with PhoenixServer() as server:
        yield server


async def test_a_rollout_in_phoenix_keeps_its_parents_and_attributes(phoenix):
    ti.instrument("openai", "langchain")
    with FakeOpenAIServer(script) as model, OTLPCollector() as collector:
        to_phoenix = ti.export_to_otlp(phoenix.url + "/v1/traces")
        to_collector = ti.export_to_otlp(collector.url + "/v1/traces")
        try:
            async with ti.rollout(task="add two and three", group="phoenix") as r:
                await react_agent(model).ainvoke({"messages": [("user", "add two and three")]})
            to_phoenix.force_flush()
            to_collector.force_flush()
        finally:
            to_phoenix.shutdown()
            to_collector.shutdown()
    sent = {s.span_id: s for s in collector.trace(r.trajectory.trace_id)}
    stored = {s["context"]["span_id"]: s for s in phoenix.spans(r.trajectory.trace_id, expected=len(sent))}
    assert len(sent) >= 8 and set(stored) == set(sent)  # create_agent: rollout, graph, nodes, 2 model calls, tool
    for span_id, span in sent.items():
        assert stored[span_id]["parent_id"] == span.parent_span_id, span.name
        assert stored[span_id]["name"] == span.name
    by_name: dict[str, list] = {}
    for s in stored.values():
        by_name.setdefault(s["name"], []).append(s)
    [root] = by_name["rollout"]
    assert root["parent_id"] is None and root["attributes"]["tracerl.rollout.task"] == "add two and three"
    [graph] = by_name["LangGraph"]
    assert graph["span_kind"] == "CHAIN" and graph["parent_id"] == root["context"]["span_id"]
    # create_agent's model node: a CHAIN (Langfuse's rule makes AGENT only of names or classes saying "agent")
    assert len(by_name["model"]) == 2 and {s["span_kind"] for s in by_name["model"]} == {"CHAIN"}
    assert all(s["attributes"]["metadata.langgraph_node"] == "model" for s in by_name["model"])
    [tool] = by_name["execute_tool add"]
    assert tool["attributes"]["gen_ai.tool.name"] == "add" and tool["attributes"]["gen_ai.tool.call.result"] == "5"
    assert stored[tool["parent_id"]]["name"] == "tools"
    chats = [s for s in stored.values() if s["attributes"].get("gen_ai.operation.name") == "chat"]
    assert len(chats) == 4 and {s["span_kind"] for s in chats} == {"LLM"}  # Phoenix reads GenAI's chat as LLM
    for chat in chats:
        messages = chat["attributes"]["gen_ai.input.messages"]
        assert json.loads(messages if isinstance(messages, str) else json.dumps(messages))[0]["role"] == "system"
        if chat["attributes"]["tracerl.layer"] == "openai":  # the SDK's span sits under LangChain's
            assert stored[chat["parent_id"]]["attributes"]["tracerl.layer"] == "langchain"
