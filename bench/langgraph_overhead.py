"""Per-model-call cost of tracing a LangGraph ReAct agent, side by side.

    python bench/langgraph_overhead.py [--runs 200] [--block 5]

Rows: the agent uninstrumented; tracerl's capture (OpenAI + LangChain hooks, each run in
a rollout, so the graph, its nodes and every call become spans and the rollout a
trajectory); OpenInference's LangChain + OpenAI instrumentors (SDK tracer provider, no
exporter: their cheapest); Langfuse's own LangChain ``CallbackHandler`` (in-memory
exporter).  Each run is one ReAct episode with two model calls and one tool call against a
local OpenAI-compatible server in a separate process; times are per model call, the
whole episode included (tracerl's span materialisation and trajectory at rollout end too).
Modes are interleaved in blocks so drift in the machine's speed hits all of them alike.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]


def agent_of(base_url: str) -> Any:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langchain.agents import create_agent

    @tool
    def lookup(query: str) -> str:
        """Look something up."""
        return "found " + query

    llm = ChatOpenAI(model="m", base_url=base_url, api_key="x", max_retries=0)
    return create_agent(llm, [lookup])


def modes(agent: Any) -> dict[str, Callable[[int], list[tuple[float, float]]]]:
    import tracerl.integrations as ti
    from langfuse import Langfuse
    from langfuse.langchain import CallbackHandler
    from openinference.instrumentation.langchain import LangChainInstrumentor
    from openinference.instrumentation.openai import OpenAIInstrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    ti.configure_tracing(TracerProvider())
    oi_provider, oi = TracerProvider(), [LangChainInstrumentor(), OpenAIInstrumentor()]
    exporter = InMemorySpanExporter()
    Langfuse(public_key="pk-lf-bench", secret_key="sk-lf-bench", base_url="http://127.0.0.1:9",
             tracer_provider=TracerProvider(), span_exporter=exporter)  # fmt: skip
    langfuse = CallbackHandler(public_key="pk-lf-bench")

    def timed(n: int, run: Callable[[], None]) -> list[tuple[float, float]]:
        out = []
        for _ in range(n):
            started, cpu = time.perf_counter(), time.process_time()
            run()
            out.append(((time.perf_counter() - started) * 1e6 / 2, (time.process_time() - cpu) * 1e6 / 2))
        return out

    def episode(config: dict[str, Any] | None = None) -> None:
        agent.invoke({"messages": [("user", "q")]}, config=config)

    def plain(n: int) -> list[tuple[float, float]]:
        return timed(n, episode)

    def tracerl(n: int) -> list[tuple[float, float]]:
        ti.instrument("openai", "langchain")

        def in_rollout() -> None:
            with ti.rollout():
                episode()

        try:
            return timed(n, in_rollout)
        finally:
            ti.uninstrument("openai", "langchain")

    def openinference(n: int) -> list[tuple[float, float]]:
        for instrumentor in oi:
            instrumentor.instrument(tracer_provider=oi_provider)
        try:
            return timed(n, episode)
        finally:
            for instrumentor in oi:
                instrumentor.uninstrument()

    def langfuse_handler(n: int) -> list[tuple[float, float]]:
        try:
            return timed(n, lambda: episode({"callbacks": [langfuse]}))
        finally:
            exporter.clear()

    return {"uninstrumented": plain, "tracerl": tracerl, "openinference": openinference, "langfuse handler": langfuse_handler}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="episodes per mode")
    parser.add_argument("--block", type=int, default=5, help="episodes per interleaved block")
    args = parser.parse_args()
    process = subprocess.Popen([sys.executable, str(ROOT / "tests" / "capture_fake_server.py")], stdout=subprocess.PIPE, text=True)
    try:
        base_url = process.stdout.readline().strip()  # type: ignore[union-attr]
        table = modes(agent_of(base_url))
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in table}
        for fn in table.values():  # warm-up
            fn(5)
        done = 0
        while done < args.runs:
            n = min(args.block, args.runs - done)
            for name, fn in table.items():
                samples[name].extend(fn(n))
            done += n
        print(f"{args.runs} ReAct episodes per mode (2 model calls + 1 tool call each), per model call, server {base_url}")
        print(f"{'mode':<18}{'wall med µs':>13}{'wall added':>12}{'cpu med µs':>12}{'cpu added':>11}")
        wall0 = statistics.median(w for w, _ in samples["uninstrumented"])
        cpu0 = statistics.median(c for _, c in samples["uninstrumented"])
        for name, values in samples.items():
            wall, cpu = statistics.median(w for w, _ in values), statistics.median(c for _, c in values)
            print(f"{name:<18}{wall:>13.0f}{wall - wall0:>12.0f}{cpu:>12.0f}{cpu - cpu0:>11.0f}")
    finally:
        process.terminate()
        process.wait(timeout=10)


if __name__ == "__main__":
    main()
