"""Per-call cost of capture, side by side, against a local OpenAI-compatible server.

    python bench/capture_overhead.py [--calls 400] [--stream] [--turns] [--rollout-calls 10] [--json PATH]

Rows: the plain ``openai`` client (no instrumentation); tracerl's capture (OpenAI hook,
calls inside rollouts of 10 calls; inside a rollout a call only records references and
the real spans are made in one batch when the rollout ends, with the trajectory); the same with the endpoint
registered as tracerl-served, so requests also ask for token ids + logprobs (a bigger
response to send and parse: that part is the server's and the SDK's, shown apart); and
OpenInference's OpenAI instrumentation (SDK tracer provider, no exporter: its cheapest).
The server runs in a separate process; modes are interleaved in blocks so drift in the
machine's speed hits all of them alike.  "added" is the median minus the plain median.
The work tracerl does at rollout end (span materialisation + trajectory) is timed apart
and shown per call, and a last line compares totals (call path + rollout end) too.

Workloads: by default every call sends the same two messages (the filed measurement); with
``--turns`` the 10 calls of a rollout are one conversation, as an agent makes them (each call
resends the history plus the previous answer and a new user turn), in every mode alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is the capital of France?"}]
ROLLOUT_CALLS = 10
ANSWER = {"role": "assistant", "content": "Paris is the capital of France; it has been since 508 AD."}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look something up.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }
]


def start_server() -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "capture_fake_server.py")], stdout=subprocess.PIPE, text=True
    )
    base_url = process.stdout.readline().strip()  # type: ignore[union-attr]
    return process, base_url


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400, help="calls per mode")
    parser.add_argument("--block", type=int, default=20, help="calls per interleaved block")
    parser.add_argument("--stream", action="store_true", help="streamed completions")
    parser.add_argument("--turns", action="store_true", help="each rollout's calls form one growing conversation")
    parser.add_argument("--rollout-calls", type=int, default=ROLLOUT_CALLS, help="model calls per rollout (a long agent run: 100)")
    parser.add_argument("--json", type=Path, default=None, help="write the raw samples and the summary here")
    args = parser.parse_args()

    from openai import OpenAI
    from openinference.instrumentation.openai import OpenAIInstrumentor
    from opentelemetry.sdk.trace import TracerProvider

    import tracerl.integrations as ti

    process, base_url = start_server()
    try:
        client = OpenAI(base_url=base_url, api_key="x", max_retries=0)
        oi_provider = TracerProvider()
        oi = OpenAIInstrumentor()
        capture_provider = TracerProvider()
        ti.configure_tracing(capture_provider)

        conversation: list[dict] = []
        turn = [0]

        def next_messages() -> list[dict]:
            """What the agent sends now: the same two messages, or (``--turns``) its growing history."""
            if not args.turns:
                return MESSAGES
            if turn[0] % args.rollout_calls == 0:
                conversation[:] = list(MESSAGES)
            else:
                conversation.extend([dict(ANSWER), {"role": "user", "content": f"And what about question {turn[0]}?"}])
            turn[0] += 1
            return conversation

        def call() -> tuple[float, float]:
            messages = next_messages()
            started, cpu_started = time.perf_counter(), time.process_time()
            result = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=args.stream)
            if args.stream:
                for _ in result:
                    pass
            return (time.perf_counter() - started) * 1e6, (time.process_time() - cpu_started) * 1e6

        def plain(n: int) -> list[tuple[float, float]]:
            turn[0] = 0
            return [call() for _ in range(n)]

        def tracerl(n: int, token_ids: bool = False) -> list[tuple[float, float]]:
            ti.instrument("openai")
            if token_ids:
                ti.register_endpoint(base_url)
            try:
                out: list[tuple[float, float]] = []
                while len(out) < n:
                    scope = ti.rollout()
                    calls = min(args.rollout_calls, n - len(out))
                    turn[0] = 0
                    scope.__enter__()
                    out.extend(call() for _ in range(calls))
                    started = time.perf_counter()
                    scope.__exit__(None, None, None)  # builds the trajectory
                    convert_us.append((time.perf_counter() - started) * 1e6 / calls)
                    captured.append(scope.trajectory.metrics["capture_model_calls"] == calls)
                return out
            finally:
                ti.uninstrument("openai")
                ti.unregister_endpoint(base_url)

        def openinference(n: int) -> list[tuple[float, float]]:
            oi.instrument(tracer_provider=oi_provider)
            turn[0] = 0
            try:
                return [call() for _ in range(n)]
            finally:
                oi.uninstrument()

        convert_us: list[float] = []
        captured: list[bool] = []
        modes = {
            "uninstrumented": plain,
            "tracerl": tracerl,
            "tracerl+token_ids": lambda n: tracerl(n, token_ids=True),
            "openinference": openinference,
        }
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in modes}
        for fn in modes.values():  # warm-up: connections, imports, first spans
            fn(10)
        convert_us.clear()
        captured.clear()
        done = 0
        while done < args.calls:
            n = min(args.block, args.calls - done)
            for name, fn in modes.items():
                samples[name].extend(fn(n))
            done += n
        shape = f"rollouts of {args.rollout_calls}-turn conversations" if args.turns else "the same two messages per call"
        shape += f", {args.rollout_calls} calls per rollout"
        print(f"{args.calls} calls per mode{' (streamed)' if args.stream else ''}, {shape}, server {base_url} (separate process)")
        print("wall = latency seen by the agent; cpu = this process's CPU time per call (robust to a busy machine)")
        header = f"{'mode':<20}" + "".join(f"{h:>12}" for h in ("wall med µs", "wall p90", "wall added", "cpu med µs", "cpu p90", "cpu added"))
        print(header)
        wall_base = statistics.median(w for w, _ in samples["uninstrumented"])
        cpu_base = statistics.median(c for _, c in samples["uninstrumented"])
        added: dict[str, tuple[float, float]] = {}
        for name, values in samples.items():
            walls, cpus = [w for w, _ in values], [c for _, c in values]
            added[name] = (statistics.median(walls) - wall_base, statistics.median(cpus) - cpu_base)
            print(
                f"{name:<20}{statistics.median(walls):>12.0f}{percentile(walls, 0.9):>12.0f}{added[name][0]:>12.0f}"
                f"{statistics.median(cpus):>12.0f}{percentile(cpus, 0.9):>12.0f}{added[name][1]:>12.0f}"
            )
        for column, index in (("wall", 0), ("cpu", 1)):
            if added["openinference"][index] > 0:
                ratio = added["tracerl"][index] / added["openinference"][index]
                print(f"tracerl added / OpenInference added ({column}) = {ratio:.2f}")
        end_us = statistics.median(convert_us)
        print(
            f"tracerl work at rollout end (spans materialised + trajectory built): median {end_us:.0f} µs per call "
            f"(not in the rows above); every call captured: {all(captured)}"
        )
        total = None
        if added["openinference"][1] > 0:
            total = (added["tracerl"][1] + end_us) / added["openinference"][1]
            print(f"tracerl total (cpu added + rollout-end work) / OpenInference added (cpu) = {total:.2f}")
        if args.json is not None:
            args.json.write_text(
                json.dumps(
                    {
                        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
                        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        "workload": shape,
                        "stream": args.stream,
                        "added_us": {name: {"wall": w, "cpu": c} for name, (w, c) in added.items()},
                        "rollout_end_us_per_call": end_us,
                        "total_ratio_cpu": total,
                        "every_call_captured": all(captured),
                        "samples_us": {name: [[round(w, 1), round(c, 1)] for w, c in values] for name, values in samples.items()},
                        "rollout_end_samples_us": [round(v, 1) for v in convert_us],
                    }
                )
                + "\n"
            )
    finally:
        process.terminate()
        process.wait(timeout=10)


if __name__ == "__main__":
    main()
