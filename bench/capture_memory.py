"""Capture memory of one long rollout, measured with tracemalloc.

    python bench/capture_memory.py [--turns 50 100] [--chars 500]

An agent chats for N turns with a local OpenAI-compatible server (separate process): each
turn sends the whole history (a user message of ``--chars`` characters per turn, plus the
answers) and appends the answer.  Rows, per N:

- ``held``: memory capture holds at the last moment inside the rollout (tracemalloc, this
  process), minus what the same agent holds without capture (its own message list);
- ``end peak``: the peak above that while the rollout ends (spans made real, trajectory built);
- ``span input``: characters of ``gen_ai.input.messages`` over the rollout's chat spans.

Linear capture doubles these when N doubles; capture that stores each call's whole input
quadruples them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import tracemalloc
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import SpanProcessor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capture_overhead import start_server  # noqa: E402


class InputSizes(SpanProcessor):
    """A span processor summing the chat spans' input characters."""

    def __init__(self) -> None:
        self.chars = 0

    def on_end(self, span: Any) -> None:
        self.chars += len((span.attributes or {}).get("gen_ai.input.messages", ""))


async def agent(client: Any, turns: int, chars: int, scope: Any | None, marks: dict[str, int]) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"turn {turn}: " + "x" * chars})
        response = await client.chat.completions.create(model="m", messages=messages)
        messages.append({"role": "assistant", "content": response.choices[0].message.content})
    gc.collect()
    marks["end"] = tracemalloc.get_traced_memory()[0]


async def measure(base_url: str, turns: int, chars: int, capture: bool) -> dict[str, int]:
    import tracerl.integrations as ti
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "warm up"}])
    marks: dict[str, int] = {}
    gc.collect()
    start = tracemalloc.get_traced_memory()[0]
    if not capture:
        await agent(client, turns, chars, None, marks)
        await client.close()
        return {"held": marks["end"] - start}
    scope = ti.rollout()
    await scope.__aenter__()
    await agent(client, turns, chars, scope, marks)
    tracemalloc.reset_peak()
    await scope.__aexit__(None, None, None)
    peak = tracemalloc.get_traced_memory()[1]
    await client.close()
    assert scope.trajectory.metrics.get("capture_model_calls") == turns, (scope.trajectory.logs, ti.capture_error_counts())
    return {"held": marks["end"] - start, "end_peak": peak - marks["end"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[50, 100])
    parser.add_argument("--chars", type=int, default=500, help="characters of each user message")
    args = parser.parse_args()

    import tracerl.integrations as ti
    from tracerl.integrations.processor import get_tracer_provider

    ti.instrument("openai")
    sizes = InputSizes()
    get_tracer_provider().add_span_processor(sizes)
    process, base_url = start_server()
    try:
        tracemalloc.start()
        print(f"{'turns':>6} {'held KiB':>10} {'end peak KiB':>13} {'span input KiB':>15}")
        for turns in args.turns:
            ti.uninstrument("openai")
            plain = asyncio.run(measure(base_url, turns, args.chars, capture=False))
            ti.instrument("openai")
            sizes.chars = 0
            captured = asyncio.run(measure(base_url, turns, args.chars, capture=True))
            held = (captured["held"] - plain["held"]) / 1024
            print(f"{turns:>6} {held:>10.0f} {captured['end_peak'] / 1024:>13.0f} {sizes.chars / 1024:>15.0f}")
    finally:
        process.terminate()
        process.wait(10)


if __name__ == "__main__":
    main()
