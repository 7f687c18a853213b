"""Scale on paper, measured in simulation: the router and ``gather_trajectory_groups`` over N replicas.

Three processes, as a deployment would have them: the simulated replicas
(``bench/sim_replicas.py``: decode on a clock at this machine's measured vLLM speed), tracerl's
router (``python -m tracerl.cluster``, the real one) and this driver, which runs
``gather_trajectory_groups`` over groups of rollouts.  Each rollout is the README's agent shape:
``--turns`` chat calls through ``model.openai_client()`` (``return_token_ids`` + logprobs,
``tracerl.Choice.from_openai``), then a ``Trajectory``.

Orchestration overhead of a rollout = its wall time − the simulated engine time of its calls
(each answer carries it, see ``sim_replicas``): the client, the router (policy, HTTP relay),
the replica's HTTP layer, JSON, trajectory building and the gather, all on this machine's two
shared cores.  Reported per configuration: median/p99 overhead in ms and as a share of the
rollout's wall time, and the CPU time per model call of each process (driver, router, replicas),
which says where the overhead is spent.

Two workloads (``--workloads``):

- ``synchronised`` (the worst case): every rollout starts in the same millisecond and every call
  asks for ``--tokens`` tokens, so a whole wave of answers finishes in one engine tick and the
  client and the router meet it as one burst;
- ``measured``: each call's completion length is drawn (seeded) from a real agent's measured
  lengths (``bench/completion_lengths.json``: every sampled turn of the mcp-server-time agent's
  training run, SmolLM2-135M, max_tokens 64), and each rollout starts after a uniform delay in
  ``[0, --start-spread-s]`` (its environment set-up: an MCP session, a sandbox); the delay is not
  counted in the rollout's wall time.

    flock /tmp/tracerl-heavy.lock .venv/bin/python bench/scale_sim.py [--configs 1x8,8x64,64x1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

import tracerl
from tracerl.inference._http import free_port

HERE = Path(__file__).resolve().parent
SYSTEM = "You are a careful calculator agent. Think step by step, call tools when useful, answer briefly."


def _start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    """By the process group we started (never by name)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def _wait_healthy(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2) as client:
        while True:
            try:
                if (await client.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not become healthy in {timeout:.0f} s")
            await asyncio.sleep(0.1)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


async def run_config(replicas: int, rollouts: int, workload: str, args: argparse.Namespace) -> dict[str, Any]:
    sim = _start([sys.executable, str(HERE / "sim_replicas.py"), "--replicas", str(replicas),
                  "--rate-at-knee", str(args.rate_at_knee), "--knee", str(args.knee)])
    router = None
    try:
        line = sim.stdout.readline()
        if not line.startswith("PORTS "):
            raise RuntimeError(f"sim replicas did not start: {line}{sim.stderr.read()[-2000:]}")
        urls = [f"http://127.0.0.1:{p}" for p in line.split()[1:]]
        port = free_port()
        router = _start([sys.executable, "-m", "tracerl.cluster", "--port", str(port), "--http", args.router_http,
                         "--loop", args.router_loop, *[a for url in urls for a in ("--replica", url)]])
        await _wait_healthy(f"http://127.0.0.1:{port}/health")
        model = tracerl.Model("sim-agent", "scale-sim", inference_base_url=f"http://127.0.0.1:{port}/v1",
                              inference_api_key="sim", inference_timeout=3600)
        # --direct: each group calls one replica itself (no router), to see what the router adds
        direct = [tracerl.Model("sim-agent", "scale-sim", inference_base_url=f"{url}/v1", inference_api_key="sim",
                                inference_timeout=3600) for url in urls]
        if args.client_pool == "sdk-default":  # the OpenAI SDK's own pool (1,000 connections, 100 kept alive)
            from openai import AsyncOpenAI, DefaultAsyncHttpxClient

            from tracerl.model import _tag_group

            for m in (model, *direct):
                m._client = AsyncOpenAI(base_url=m.inference_base_url, api_key="sim", max_retries=0, timeout=3600,
                                        http_client=DefaultAsyncHttpxClient(event_hooks={"request": [_tag_group]}))
                m._client_key = (m.inference_base_url, m.inference_api_key, m.inference_timeout)
        records: list[dict[str, float]] = []
        rng = random.Random(args.seed)
        measured = json.loads((HERE / "completion_lengths.json").read_text())["completion_tokens"]

        def plan() -> tuple[float, list[int]]:
            """A rollout's start delay and its calls' completion lengths (drawn before it runs: seeded)."""
            if workload == "synchronised":
                return 0.0, [args.tokens] * args.turns
            return rng.uniform(0, args.start_spread_s), [rng.choice(measured) for _ in range(args.turns)]

        async def rollout(task: int) -> tracerl.Trajectory:
            delay, lengths = plan()
            if delay:
                await asyncio.sleep(delay)
            started = time.perf_counter()
            messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {task} + {task}?"}]
            engine_s = 0.0
            for turn in range(args.turns):
                client = (direct[task % len(direct)] if args.direct else model).openai_client()
                completion = await client.chat.completions.create(
                    model="sim-agent", messages=[m if isinstance(m, dict) else m.message for m in messages],
                    max_tokens=lengths[turn], logprobs=True, extra_body={"return_token_ids": True})
                engine_s += float(completion.model_extra["tracerl_sim"]["engine_s"])
                messages.append(tracerl.Choice.from_openai(completion.choices[0], completion))
                if turn + 1 < args.turns:
                    messages.append({"role": "user", "content": "Check it and continue."})
            trajectory = tracerl.Trajectory(messages_and_choices=messages, reward=float(task % 2))
            wall = time.perf_counter() - started
            records.append({"wall_s": wall, "engine_s": engine_s, "overhead_s": wall - engine_s})
            return trajectory

        groups_n = max(rollouts // args.group_size, 1)
        # warm-up (not measured): imports, the first connections client->router->replicas
        await tracerl.gather_trajectory_groups(
            (tracerl.TrajectoryGroup(rollout(g) for _ in range(args.group_size)) for g in range(min(groups_n, 4))),
            pbar_desc=None)
        records.clear()
        cpu_before = (time.process_time(), cpu_seconds(router.pid), cpu_seconds(sim.pid))
        started = time.perf_counter()
        groups = await tracerl.gather_trajectory_groups(
            (tracerl.TrajectoryGroup(rollout(g) for _ in range(args.group_size)) for g in range(groups_n)), pbar_desc=None)
        gather_wall = time.perf_counter() - started
        cpu_after = (time.process_time(), cpu_seconds(router.pid), cpu_seconds(sim.pid))
        async with httpx.AsyncClient() as client:
            state = (await client.get(f"http://127.0.0.1:{port}/router/replicas")).json()["replicas"]
    finally:
        if router is not None:
            _stop(router)
        _stop(sim)
    overhead = [r["overhead_s"] for r in records]
    share = [r["overhead_s"] / r["wall_s"] for r in records]
    served = [r["served"] for r in state]
    calls = len(records) * args.turns
    driver_cpu, router_cpu, sim_cpu = (after - before for after, before in zip(cpu_after, cpu_before))
    return {
        "workload": workload, "replicas": replicas, "rollouts": len(records), "groups": groups_n, "turns": args.turns, "tokens_per_call": args.tokens,
        "trajectories": sum(len(g.trajectories) for g in groups),
        "exceptions": sum(len(g.exceptions) for g in groups),
        "gather_wall_s": gather_wall,
        "rollout_wall_s_median": statistics.median(r["wall_s"] for r in records),
        "engine_s_median": statistics.median(r["engine_s"] for r in records),
        "overhead_ms_median": 1000 * statistics.median(overhead),
        "overhead_ms_p99": 1000 * percentile(overhead, 0.99),
        "overhead_ms_max": 1000 * max(overhead),
        "overhead_share_median": statistics.median(share),
        "overhead_share_p99": percentile(share, 0.99),
        "requests_per_replica_min": min(served), "requests_per_replica_max": max(served),
        "replicas_used": sum(1 for s in served if s),
        "driver_cpu_ms_per_call": 1000 * driver_cpu / calls,
        "router_cpu_ms_per_call": 1000 * router_cpu / calls,
        "replicas_cpu_ms_per_call": 1000 * sim_cpu / calls,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="1x8,8x64,16x256,64x512,64x1000", help="REPLICASxROLLOUTS, comma-separated")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64, help="completion tokens per call")
    p.add_argument("--rate-at-knee", type=float, default=101.0, help="replica decode tokens/s at --knee concurrent (vLLM, measured)")
    p.add_argument("--knee", type=int, default=8)
    p.add_argument("--workloads", default="synchronised,measured", help="synchronised and/or measured (see above)")
    p.add_argument("--start-spread-s", type=float, default=1.0, help="measured workload: rollouts start within this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--router-http", choices=["auto", "h11", "httptools"], default="auto")
    p.add_argument("--router-loop", choices=["auto", "asyncio", "uvloop"], default="auto")
    p.add_argument("--client-pool", choices=["sharded", "sdk-default"], default="sharded",
                   help="model.openai_client()'s pool (tracerl.http_pool) or the OpenAI SDK's default one")
    p.add_argument("--direct", action="store_true", help="bypass the router: each group calls one replica")
    p.add_argument("--json", default=str(HERE / "scale_sim.json"))
    args = p.parse_args()
    results = []
    for workload in args.workloads.split(","):
        for config in args.configs.split(","):
            replicas, rollouts = (int(x) for x in config.split("x"))
            print(f"{workload}: {replicas} replicas x {rollouts} concurrent rollouts ...", flush=True)
            results.append(asyncio.run(run_config(replicas, rollouts, workload, args)))
            r = results[-1]
            print(f"  rollout wall {r['rollout_wall_s_median']:.2f} s, overhead median {r['overhead_ms_median']:.1f} ms "
                  f"({100 * r['overhead_share_median']:.2f}%), p99 {r['overhead_ms_p99']:.1f} ms; CPU ms/call driver "
                  f"{r['driver_cpu_ms_per_call']:.2f} router {r['router_cpu_ms_per_call']:.2f} "
                  f"replicas {r['replicas_cpu_ms_per_call']:.2f}", flush=True)
    print()
    print("| workload | replicas | concurrent rollouts | rollout wall (median) | simulated engine time | overhead median | p99 | "
          "overhead share median | p99 | CPU ms per call: driver / router / replicas | requests/replica min–max |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['workload']} | {r['replicas']} | {r['rollouts']} | {r['rollout_wall_s_median']:.2f} s | "
              f"{r['engine_s_median']:.2f} s | {r['overhead_ms_median']:.1f} ms | {r['overhead_ms_p99']:.1f} ms | "
              f"{100 * r['overhead_share_median']:.2f}% | {100 * r['overhead_share_p99']:.2f}% | "
              f"{r['driver_cpu_ms_per_call']:.2f} / {r['router_cpu_ms_per_call']:.2f} / {r['replicas_cpu_ms_per_call']:.2f} | "
              f"{r['requests_per_replica_min']}–{r['requests_per_replica_max']} |")
    Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"\nraw results: {args.json}")


if __name__ == "__main__":
    main()
