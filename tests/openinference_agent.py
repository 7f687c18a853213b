"""An agent traced by OpenInference's instrumentors only — no tracerl in this process.

    python openinference_agent.py {langgraph|openai} MODEL_BASE_URL OTLP_URL QUESTION...

It stands for what users already run in production: the OpenAI SDK and LangChain
instrumented by OpenInference, spans sent over OTLP/HTTP to a collector.  Each question
is one run of the agent; the process exits after the exporter has flushed.
"""

from __future__ import annotations

import asyncio
import sys


def main() -> None:
    kind, base_url, otlp_url, *questions = sys.argv[1:]
    from openinference.instrumentation.langchain import LangChainInstrumentor
    from openinference.instrumentation.openai import OpenAIInstrumentor
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_url)))
    OpenAIInstrumentor().instrument(tracer_provider=provider)
    LangChainInstrumentor().instrument(tracer_provider=provider)
    assert not any(name.startswith("tracerl") for name in sys.modules), "this agent must run without tracerl"
    run = langgraph_agent(base_url) if kind == "langgraph" else openai_agent(base_url)

    async def all_questions() -> None:  # one event loop: langchain-openai keeps one client per process
        for question in questions:
            await run(question)

    asyncio.run(all_questions())
    provider.shutdown()  # flushes the batch processor


def langgraph_agent(base_url: str):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langchain.agents import create_agent

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = ChatOpenAI(model="policy", base_url=base_url, api_key="x", max_retries=0)
    agent = create_agent(llm, [add], system_prompt="Use the tools.")

    async def run(question: str) -> None:
        await agent.ainvoke({"messages": [("user", question)]})

    return run


def openai_agent(base_url: str):
    from capture_helpers import openai_tool_agent
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)

    async def run(question: str) -> None:
        await openai_tool_agent(client, question)

    return run


if __name__ == "__main__":
    main()
