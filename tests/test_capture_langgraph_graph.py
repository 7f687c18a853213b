"""The LangGraph graph in the trace: runs become nested spans, named and nested exactly as
Langfuse's own LangChain integration names and nests them (its real ``CallbackHandler``
runs the same graphs side by side), and the trajectory is unchanged.

Our spans are read back from a real OTLP/HTTP endpoint on loopback (the collector that
decodes protobuf as Langfuse's ingestion does); Langfuse's from its SDK's own exporter.
"""

from __future__ import annotations

from typing import Any

import pytest
from capture_fake_server import FakeOpenAIServer, Reply
from capture_helpers import parallel_branches_graph
from otlp_collector import OTLPCollector

import tracerl.integrations as ti

pytest.importorskip("langgraph")
pytest.importorskip("langfuse")
pytestmark = pytest.mark.asyncio(loop_scope="session")

from langchain_core.documents import Document  # noqa: E402
from langchain_core.retrievers import BaseRetriever  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from langgraph.graph import END, START, StateGraph  # noqa: E402
from langchain.agents import create_agent  # noqa: E402
from typing_extensions import TypedDict  # noqa: E402

# Langfuse's ingestion maps OpenInference span kinds to observation types (ObservationTypeMapper)
OBSERVATION_TYPE = {"CHAIN": "chain", "AGENT": "agent", "RETRIEVER": "retriever"}


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class KnowledgeBase(BaseRetriever):
    """A retriever with one document per query."""

    def _get_relevant_documents(self, query: str, *, run_manager: Any) -> list[Document]:
        return [Document(page_content=f"notes on {query}", id="doc-1", metadata={"source": "kb"})]


def script(body: dict[str, Any]) -> Reply:
    messages = body["messages"]
    if body.get("tools") and not any(m["role"] == "tool" for m in messages):
        return Reply(tool_calls=[("add", {"a": 2, "b": 3})])
    last = messages[-1]["content"]
    return Reply(content=f"done: {last if isinstance(last, str) else ''}")


@pytest.fixture(scope="module")
def server():
    ti.instrument("openai", "langchain")
    with FakeOpenAIServer(script) as srv:
        yield srv


@pytest.fixture(scope="module")
def collector():
    with OTLPCollector() as c:
        exporter = ti.export_to_otlp(c.url + "/v1/traces", compression="none")
        yield c
        exporter.shutdown()


@pytest.fixture(scope="module")
def langfuse_handler():
    """Langfuse's own LangChain CallbackHandler, on its own provider, exporting in memory."""
    from langfuse import Langfuse
    from langfuse.langchain import CallbackHandler
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    client = Langfuse(
        public_key="pk-lf-graph", secret_key="sk-lf-graph", base_url="http://127.0.0.1:9",
        tracer_provider=TracerProvider(), span_exporter=exporter, tracing_enabled=True,
    )  # fmt: skip
    yield CallbackHandler(public_key="pk-lf-graph"), client, exporter
    client.shutdown()


# -- the graphs --------------------------------------------------------------------------------------
def llm_of(server) -> ChatOpenAI:
    return ChatOpenAI(model="policy", base_url=server.base_url, api_key="x", max_retries=0)


def react_graph(server) -> Any:
    return create_agent(llm_of(server), [add], system_prompt="Use the tools.")


class BranchState(TypedDict, total=False):
    topic: str
    a: str
    b: str


def parallel_graph(server) -> Any:
    return parallel_branches_graph(llm_of(server))


class OuterState(TypedDict, total=False):
    question: str
    messages: list
    final: str


def subgraph_graph(server) -> Any:
    llm, retriever = llm_of(server), KnowledgeBase()

    async def retrieve(state: OuterState) -> OuterState:
        docs = await retriever.ainvoke(state["question"])
        return {"messages": [("user", f"research {docs[0].page_content}")]}

    async def answer(state: OuterState) -> OuterState:
        return {"final": (await llm.ainvoke(f"summarize {state['messages'][-1].content}")).content}

    graph = StateGraph(OuterState)
    graph.add_node("retrieve", retrieve)
    graph.add_node("research", react_graph(server))  # a compiled ReAct graph as a node: a subgraph
    graph.add_node("answer", answer)
    graph.add_edge(START, "retrieve")
    graph.add_edge("retrieve", "research")
    graph.add_edge("research", "answer")
    graph.add_edge("answer", END)
    return graph.compile()


GRAPHS = {
    "react": (react_graph, lambda: {"messages": [("user", "add them")]}),
    "parallel": (parallel_graph, lambda: {"topic": "cats"}),
    "subgraph": (subgraph_graph, lambda: {"question": "otters"}),
}


# -- trees -------------------------------------------------------------------------------------------
def tree(nodes: list[tuple[str, str | None, tuple[str, str]]]) -> list[Any]:
    """``(span_id, parent_id, label)`` rows -> nested ``(label, [children])`` in row order."""
    ids = {n[0] for n in nodes}
    kids: dict[str | None, list[tuple[str, str | None, tuple[str, str]]]] = {}
    for node in nodes:
        kids.setdefault(node[1] if node[1] in ids else None, []).append(node)

    def build(parent: str | None) -> list[Any]:
        return [(label, build(span_id)) for span_id, _, label in kids.get(parent, [])]

    return build(None)


def langfuse_tree(spans: list[Any]) -> list[Any]:
    rows = []
    for s in sorted(spans, key=lambda s: s.start_time):
        kind = s.attributes.get("langfuse.observation.type")
        name = "<model call>" if kind == "generation" else s.name
        rows.append((f"{s.context.span_id:016x}", f"{s.parent.span_id:016x}" if s.parent else None, (name, kind)))
    return tree(rows)


def our_tree(collector: OTLPCollector, trace_id: str) -> list[Any]:
    spans = [s for s in collector.trace(trace_id) if s.attributes.get("tracerl.layer") != "openai"]
    root = next(s for s in spans if s.parent_span_id is None)
    rows = []
    for s in sorted((s for s in spans if s is not root), key=lambda s: s.start_time):
        a = s.attributes
        if a.get("gen_ai.operation.name") == "chat":
            label = ("<model call>", "generation")
        elif a.get("gen_ai.operation.name") == "execute_tool":
            label = (a["gen_ai.tool.name"], "tool")  # Langfuse names it by gen_ai.tool.name
        else:
            label = (s.name, OBSERVATION_TYPE[a["openinference.span.kind"]])
        rows.append((s.span_id, s.parent_span_id, label))
    return tree(rows)


async def run_with_langfuse(langfuse_handler, graph: Any, inputs: dict[str, Any]) -> list[Any]:
    handler, client, exporter = langfuse_handler
    exporter.clear()
    await graph.ainvoke(inputs, config={"callbacks": [handler]})
    client.flush()
    return langfuse_tree(list(exporter.get_finished_spans()))


async def run_with_tracerl(collector, graph: Any, inputs: dict[str, Any]) -> tuple[Any, list[Any]]:
    async with ti.rollout(task="graph") as r:
        await graph.ainvoke(inputs)
    ti.get_tracer_provider().force_flush()
    trace_id = r.trajectory.trace_id
    collector.wait_for(lambda: any(s.parent_span_id is None for s in collector.trace(trace_id)))
    return r, our_tree(collector, trace_id)


# -- tests -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(GRAPHS))
async def test_runs_are_named_and_nested_as_langfuse_nests_them(kind, server, collector, langfuse_handler):
    make, inputs = GRAPHS[kind]
    graph = make(server)
    expected = await run_with_langfuse(langfuse_handler, graph, inputs())
    _, ours = await run_with_tracerl(collector, graph, inputs())
    assert ours == expected
    assert ours[0][0][0] == "LangGraph"


async def test_nodes_parallel_branches_and_subgraphs_are_where_they_ran(server, collector):
    rollout, ours = await run_with_tracerl(collector, parallel_graph(server), {"topic": "dogs"})
    [(graph_label, nodes)] = ours
    assert graph_label == ("LangGraph", "chain")
    assert sorted(label for label, _ in nodes) == [("branch_a", "chain"), ("branch_b", "chain")]
    for _, children in nodes:  # each branch's model call under its own node, never the other's
        assert [label for label, _ in children] == [("<model call>", "generation")]
    assert len(rollout.trajectory.additional_histories) == 1  # the converter still sees two calls

    rollout, ours = await run_with_tracerl(collector, subgraph_graph(server), {"question": "owls"})
    [(_, nodes)] = ours
    assert [label for label, _ in nodes] == [("retrieve", "chain"), ("research", "chain"), ("answer", "chain")]
    retrieve, research, _ = nodes
    assert [label for label, _ in retrieve[1]] == [("KnowledgeBase", "retriever")]
    [(subgraph, sub_nodes)] = research[1]  # the create_agent graph inside the node, its own nodes inside
    assert subgraph == ("LangGraph", "chain")
    assert [label for label, _ in sub_nodes] == [("model", "chain"), ("tools", "chain"), ("model", "chain")]
    assert ("add", "tool") in [label for label, _ in sub_nodes[1][1]]


async def test_node_spans_carry_langgraph_metadata_and_model_calls_nest_under_them(server, collector):
    import json

    rollout, _ = await run_with_tracerl(collector, subgraph_graph(server), {"question": "bees"})
    spans = {s.span_id: s for s in collector.trace(rollout.trajectory.trace_id)}
    by_name = {}
    for s in spans.values():
        by_name.setdefault(s.name, []).append(s)
    [answer] = by_name["answer"]
    metadata = json.loads(answer.attributes["metadata"])
    assert metadata["langgraph_node"] == "answer" and metadata["langgraph_step"] == 3
    assert answer.attributes["openinference.span.kind"] == "CHAIN"
    [retriever] = by_name["KnowledgeBase"]
    assert retriever.attributes["input.value"] == "bees"
    assert retriever.attributes["retrieval.documents.0.document.content"] == "notes on bees"
    assert retriever.attributes["retrieval.documents.0.document.id"] == "doc-1"
    # the OpenAI SDK's span of each request sits under LangChain's span of the same request
    for span in spans.values():
        if span.attributes.get("tracerl.layer") == "openai":
            parent = spans[span.parent_span_id]
            assert parent.attributes["tracerl.layer"] == "langchain"
            assert parent.attributes["gen_ai.operation.name"] == "chat"
            assert parent.attributes["gen_ai.response.id"] == span.attributes["gen_ai.response.id"]


async def test_after_a_graph_run_new_spans_nest_under_the_caller_again(server, collector):
    """LangChain ends async runs in a copy of the caller's context (its handlers are shielded
    tasks), so the attachment made at the start cannot be undone there; what is left current
    must behave as the caller's span, or a later model call would nest under an ended node."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    async with ti.rollout(task="graph, then a call") as r:
        await react_graph(server).ainvoke({"messages": [("user", "add them")]})
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "after"}])
    ti.get_tracer_provider().force_flush()
    trace_id = r.trajectory.trace_id
    collector.wait_for(lambda: any(s.parent_span_id is None for s in collector.trace(trace_id)))
    spans = collector.trace(trace_id)
    root = next(s for s in spans if s.parent_span_id is None)
    [after] = [s for s in spans if "after" in s.attributes.get("gen_ai.input.messages", "")]
    assert after.parent_span_id == root.span_id
    [graph] = [s for s in spans if s.name == "LangGraph"]
    assert graph.parent_span_id == root.span_id


async def test_trajectory_is_unchanged_by_the_graph_spans(server, collector):
    rollout, _ = await run_with_tracerl(collector, react_graph(server), {"messages": [("user", "add them")]})
    t = rollout.trajectory
    assert [m["role"] for m in t.messages()] == ["system", "user", "assistant", "tool", "assistant"]
    assert t.metrics["capture_model_calls"] == 2 and t.metrics["capture_tool_runs"] == 1
    assert t.messages()[3]["content"] == "5" and t.additional_histories == []
    assert t.metrics["capture_errors"] == 0


async def test_a_failing_node_marks_its_runs_failed_and_leaves_no_span_current(server, collector):
    from opentelemetry import trace

    from tracerl.integrations import langchain_hook

    async def broken(state: BranchState) -> BranchState:
        raise ValueError("node exploded")

    graph = StateGraph(BranchState)
    graph.add_node("broken", broken)
    graph.add_edge(START, "broken")
    graph.add_edge("broken", END)
    app = graph.compile()
    with pytest.raises(ValueError, match="node exploded"):
        async with ti.rollout(task="broken") as r:
            try:
                await app.ainvoke({"topic": "x"})
            finally:
                current = trace.get_current_span()  # after the graph failed, inside the rollout
    # the graph's and the node's spans are no longer what new spans nest under
    assert current.get_span_context() == r._span.get_span_context()
    assert len(langchain_hook.handler()._runs) == 0  # every run's span was closed
    ti.get_tracer_provider().force_flush()
    trace_id = r.trajectory.trace_id
    collector.wait_for(lambda: any(s.parent_span_id is None for s in collector.trace(trace_id)))
    spans = {s.name: s for s in collector.trace(trace_id)}
    for name in ("LangGraph", "broken"):
        assert spans[name].status_code == 2 and spans[name].attributes["error.type"] == "ValueError"


async def test_an_interrupt_is_control_flow_not_an_error(server, collector):
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.types import interrupt

    async def ask(state: BranchState) -> BranchState:
        return {"a": interrupt("which topic?")}

    graph = StateGraph(BranchState)
    graph.add_node("ask", ask)
    graph.add_edge(START, "ask")
    graph.add_edge("ask", END)
    app = graph.compile(checkpointer=InMemorySaver())
    async with ti.rollout(task="interrupt") as r:
        await app.ainvoke({"topic": "x"}, config={"configurable": {"thread_id": "t1"}})
    ti.get_tracer_provider().force_flush()
    trace_id = r.trajectory.trace_id
    collector.wait_for(lambda: any(s.parent_span_id is None for s in collector.trace(trace_id)))
    spans = {s.name: s for s in collector.trace(trace_id)}
    assert spans["ask"].status_code == 0 and "error.type" not in spans["ask"].attributes


async def test_in_langfuse_the_nodes_appear_nested_and_each_request_is_one_generation(server):
    """Through export_to_langfuse and Langfuse's ingestion mapping (``langfuse_mapping``)."""
    with OTLPCollector("pk-lf-graph", "sk-lf-graph") as lf:
        exporter = ti.export_to_langfuse(lf.url, "pk-lf-graph", "sk-lf-graph")
        try:
            async with ti.rollout(task="add them") as r:
                await react_graph(server).ainvoke({"messages": [("user", "add them")]})
            exporter.force_flush()
        finally:
            exporter.shutdown()
        trace_id = r.trajectory.trace_id
        lf.wait_for(lambda: any(s.parent_span_id is None for s in lf.trace(trace_id)))
        observations = {o.id: o for o in lf.observations(trace_id)}
    requests = len([s for s in server.responses if s["id"] in {c.response_id for c in r.trajectory.sampled_turns()}])

    def path(o: Any) -> list[tuple[str, str]]:
        out = []
        while o.parent_id in observations:
            o = observations[o.parent_id]
            out.append((o.name, o.type))
        return out[::-1]

    generations = [o for o in observations.values() if o.type == "generation"]
    assert len(generations) == requests == 2
    for generation in generations:  # rollout > LangGraph > the create_agent "model" node > (LangChain's call) > the call
        assert path(generation)[:4] == [("rollout", "agent"), ("LangGraph", "chain"), ("model", "chain"), ("chat policy", "span")]
    [tool] = [o for o in observations.values() if o.type == "tool"]
    assert tool.name == "add" and path(tool)[-1] == ("tools", "chain")
    assert {o.session_id for o in observations.values()} == {observations[tool.parent_id].session_id}
