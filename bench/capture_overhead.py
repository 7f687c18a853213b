"""Per-call cost of capture, side by side, against a local OpenAI-compatible server.

    python bench/capture_overhead.py [--calls 400] [--stream] [--turns] [--rollout-calls 10] [--json PATH]

Rows: the plain ``openai`` client (no instrumentation); tracerl's capture (OpenAI hook,
calls inside rollouts of 10 calls; each call is one record, the trajectory is built when the
rollout ends, and no span is made: nothing else listens); the same with the endpoint
registered as tracerl-served, so requests also ask for token ids + logprobs (a bigger
response to send and parse: that part is the server's and the SDK's, shown apart); and
OpenInference's OpenAI instrumentation (SDK tracer provider, no exporter: its cheapest).
The server runs in a separate process; modes are interleaved in blocks so drift in the
machine's speed hits all of them alike.  "added" is the median minus the plain median.
The work tracerl does at rollout end (the trajectory) is timed apart
and shown per call, and a last line compares totals (call path + rollout end) too.

Workloads: by default every call sends the same two messages (the filed measurement); with
``--turns`` the 10 calls of a rollout are one conversation, as an agent makes them (each call
resends the history plus the model's previous answer and the agent's reply: a result for each
tool call, else a new user turn), in every mode alike.
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


class Workload:
    """What the agent sends on each call: the same two messages, or (``turns``) its growing history.

    With ``turns`` the calls of a rollout are one conversation, as an agent makes them: each call
    resends the history plus the model's previous answer (given to :meth:`answered`) and the
    agent's reply to it (a result for each tool call, else a new user turn); :meth:`restart`
    begins the next rollout's conversation.  Without an answer (streamed calls) a fixed one is sent.
    """

    def __init__(self, *, turns: bool, rollout_calls: int) -> None:
        self.turns, self.rollout_calls = turns, rollout_calls
        self.turn = 0
        self.conversation: list[dict] = []
        self.answer: dict | None = None

    def restart(self) -> None:
        self.turn = 0

    def answered(self, message: dict) -> None:
        """The model's answer to the last call, as the agent keeps it (a message dict)."""
        self.answer = message

    def next_messages(self) -> list[dict]:
        if not self.turns:
            return MESSAGES
        if self.turn % self.rollout_calls == 0:
            self.conversation[:] = list(MESSAGES)
        else:
            answer = self.answer or dict(ANSWER)
            self.conversation.append(answer)
            calls = answer.get("tool_calls") or ()
            for call in calls:
                self.conversation.append({"role": "tool", "tool_call_id": call["id"], "content": ANSWER["content"]})
            if not calls:
                self.conversation.append({"role": "user", "content": f"And what about question {self.turn}?"})
        self.answer = None
        self.turn += 1
        return self.conversation


def write_raw(path: Path, workload: str, indent: int | None = None, **fields: object) -> None:
    """A run's raw result as JSON: the command that made it, when, on which workload, then ``fields``."""
    record = {
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "workload": workload,
        **fields,
    }
    path.write_text(json.dumps(record, indent=indent) + "\n")


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

        workload = Workload(turns=args.turns, rollout_calls=args.rollout_calls)

        def call() -> tuple[float, float]:
            messages = workload.next_messages()
            started, cpu_started = time.perf_counter(), time.process_time()
            result = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=args.stream)
            if args.stream:
                for _ in result:
                    pass
            elapsed = (time.perf_counter() - started) * 1e6, (time.process_time() - cpu_started) * 1e6
            if args.turns and not args.stream:
                workload.answered(result.choices[0].message.model_dump(exclude_none=True))
            return elapsed

        def plain(n: int) -> list[tuple[float, float]]:
            workload.restart()
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
                    workload.restart()
                    scope.__enter__()
                    out.extend(call() for _ in range(calls))
                    started = time.perf_counter()
                    scope.__exit__(None, None, None)  # builds the trajectory
                    convert_us["tracerl+token_ids" if token_ids else "tracerl"].append((time.perf_counter() - started) * 1e6 / calls)
                    captured.append(scope.trajectory.metrics["capture_model_calls"] == calls)
                return out
            finally:
                ti.uninstrument("openai")
                ti.unregister_endpoint(base_url)

        def openinference(n: int) -> list[tuple[float, float]]:
            oi.instrument(tracer_provider=oi_provider)
            workload.restart()
            try:
                return [call() for _ in range(n)]
            finally:
                oi.uninstrument()

        convert_us: dict[str, list[float]] = {"tracerl": [], "tracerl+token_ids": []}  # rollout-end work, per mode
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
        for values in convert_us.values():
            values.clear()
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
        end_us = {name: statistics.median(values) for name, values in convert_us.items()}
        print(
            f"tracerl work at rollout end (trajectory built, not in the rows above), median per call: "
            f"{end_us['tracerl']:.0f} µs; with token ids {end_us['tracerl+token_ids']:.0f} µs; every call captured: {all(captured)}"
        )
        total = None
        if added["openinference"][1] > 0:
            total = (added["tracerl"][1] + end_us["tracerl"]) / added["openinference"][1]
            print(f"tracerl total (cpu added + rollout-end work) / OpenInference added (cpu) = {total:.2f}")
        if args.json is not None:
            write_raw(
                args.json,
                shape,
                stream=args.stream,
                added_us={name: {"wall": w, "cpu": c} for name, (w, c) in added.items()},
                rollout_end_us_per_call=end_us["tracerl"],
                rollout_end_us_per_call_token_ids=end_us["tracerl+token_ids"],
                total_ratio_cpu=total,
                every_call_captured=all(captured),
                samples_us={name: [[round(w, 1), round(c, 1)] for w, c in values] for name, values in samples.items()},
                rollout_end_samples_us={name: [round(v, 1) for v in values] for name, values in convert_us.items()},
            )
    finally:
        process.terminate()
        process.wait(timeout=10)


if __name__ == "__main__":
    main()
