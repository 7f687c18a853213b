"""Shared helpers for the capture tests (fake server fixtures, tool schemas, checks)."""

from __future__ import annotations

from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator

if TYPE_CHECKING:  # imported lazily: openinference_agent.py uses these helpers without tracerl
    import tracerl

LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look something up.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}


def sampled(trajectory: tracerl.Trajectory) -> list[tracerl.Choice]:
    from tracerl import Choice

    return [item for item in trajectory.messages_and_choices if isinstance(item, Choice)]


def roles(items: list[Any]) -> list[str]:
    from tracerl import Choice

    return [item.message["role"] if isinstance(item, Choice) else item["role"] for item in items]


def assert_tokens_match_server(trajectory: tracerl.Trajectory, responses: list[dict[str, Any]]) -> None:
    """Every sampled turn carries exactly the ids / logprobs the server sent for its response id."""
    by_id = {r["id"]: r for r in responses}
    for choice in trajectory.sampled_turns():
        response = by_id[choice.response_id]
        server_choice = response["choices"][0]
        assert choice.token_ids == server_choice["token_ids"]
        assert choice.prompt_token_ids == (response.get("prompt_token_ids") or server_choice.get("prompt_token_ids"))
        assert choice.logprobs == [e["logprob"] for e in server_choice["logprobs"]["content"]]


async def openai_tool_agent(client: Any, question: str, *, model: str = "m", stream: bool = False) -> str:
    """A plain OpenAI-client agent loop with one tool; the tool echoes a marker."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": question}]
    for _ in range(4):
        if stream:
            chunks = [c async for c in await client.chat.completions.create(model=model, messages=messages, tools=[LOOKUP_TOOL], stream=True)]
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            calls: dict[int, dict[str, Any]] = {}
            for c in chunks:
                for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                    slot = calls.setdefault(d.index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                    slot["id"] = slot["id"] or d.id
                    slot["function"]["name"] += d.function.name or ""
                    slot["function"]["arguments"] += d.function.arguments or ""
            message: dict[str, Any] = {"role": "assistant", "content": content or None}
            if calls:
                message["tool_calls"] = [calls[i] for i in sorted(calls)]
        else:
            response = await client.chat.completions.create(model=model, messages=messages, tools=[LOOKUP_TOOL])
            message = response.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        if not message.get("tool_calls"):
            return message.get("content") or ""
        for call in message["tool_calls"]:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"looked up: {question}"})
    return ""


async def litellm_tool_agent(litellm: Any, base_url: str, question: str, *, model: str) -> None:
    """A LiteLLM agent loop with one tool (up to three calls); the tool says ``tool says {question}``."""
    messages: list[Any] = [{"role": "user", "content": question}]
    for _ in range(3):
        response = await litellm.acompletion(model=model, base_url=base_url, api_key="x", messages=messages, tools=[LOOKUP_TOOL])
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"tool says {question}"})


@contextmanager
def openinference_beside_tracerl() -> Iterator[Any]:
    """OpenInference's OpenAI, LiteLLM and LangChain instrumentors on the global SDK provider,
    with tracerl capturing (and exporting) on that provider too; yields the provider."""
    from openinference.instrumentation.langchain import LangChainInstrumentor
    from openinference.instrumentation.litellm import LiteLLMInstrumentor
    from openinference.instrumentation.openai import OpenAIInstrumentor
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    import tracerl.integrations as ti

    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())
    provider = trace.get_tracer_provider()
    ti.instrument(tracer_provider=provider)  # capture sees every span on the shared provider
    instrumentors = [OpenAIInstrumentor(), LiteLLMInstrumentor(), LangChainInstrumentor()]
    for instrumentor in instrumentors:
        instrumentor.instrument(tracer_provider=provider)
    try:
        yield provider
    finally:
        for instrumentor in instrumentors:
            instrumentor.uninstrument()


def parallel_branches_graph(llm: Any) -> Any:
    """A LangGraph graph whose two nodes (``branch_a``, ``branch_b``) run in parallel from START,
    each asking ``llm`` about the state's ``topic``."""
    from langgraph.graph import END, START, StateGraph
    from typing_extensions import TypedDict

    class State(TypedDict, total=False):
        topic: str
        a: str
        b: str

    async def branch_a(state: State) -> State:
        return {"a": (await llm.ainvoke(f"branch A {state['topic']}")).content}

    async def branch_b(state: State) -> State:
        return {"b": (await llm.ainvoke(f"branch B {state['topic']}")).content}

    graph = StateGraph(State)
    graph.add_node("branch_a", branch_a)
    graph.add_node("branch_b", branch_b)
    for node in ("branch_a", "branch_b"):
        graph.add_edge(START, node)
        graph.add_edge(node, END)
    return graph.compile()


@asynccontextmanager
async def served_and_recorded(name: str, base_path: Any) -> AsyncIterator[tuple[Any, Any, list[dict[str, Any]]]]:
    """A trainable SmolLM2 model on a LocalBackend (transformers server), and every answer the
    server gives, recorded as it sent it: what a capture test holds the trajectories against."""
    import tracerl

    model = tracerl.TrainableModel(name, "tests", "smollm2-135m", base_path=base_path)
    backend = tracerl.LocalBackend(inference="transformers")
    await model.register(backend)
    server = backend._models[model.name].server
    answers: list[dict[str, Any]] = []
    original = server.complete

    async def recording_complete(request: Any) -> dict[str, Any]:
        answer = await original(request)
        answers.append(answer)
        return answer

    server.complete = recording_complete
    try:
        yield model, backend, answers
    finally:
        await backend.close()
