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
  lengths (``bench/results/completion_lengths.json``: every sampled turn of the mcp-server-time agent's
  training run, SmolLM2-135M, max_tokens 64), and each rollout starts after a uniform delay in
  ``[0, --start-spread-s]`` (its environment set-up: an MCP session, a sandbox); the delay is not
  counted in the rollout's wall time.

    flock /tmp/tracerl-heavy.lock .venv/bin/python bench/scale_sim.py [--configs 1x8,8x64,64x1000]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
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
from tracerl.net.http_server import free_port

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


# where a profiled function's file lies -> whose work it is (the first match wins)
_COMPONENTS = (
    ("tracerl", ("/core/", "/integrations/")),
    ("bench script (driver's rollout / simulator)", ("/bench/",)),
    ("OpenAI SDK", ("/openai/",)),
    ("pydantic", ("/pydantic/", "/pydantic_core/")),
    ("HTTP client (httpx, httpcore, h11, anyio, aiohttp)", ("/httpx/", "/httpx2/", "/httpcore/", "/httpcore2/", "/h11/", "/anyio/",
                                                           "/sniffio/", "/aiohttp/", "/yarl/", "/multidict/")),
    ("typing (stdlib: the OpenAI SDK's parameter transform calls it)", ("/typing.py", "/typing_extensions.py")),
    ("HTTP server (uvicorn, starlette, fastapi)", ("/uvicorn/", "/starlette/", "/fastapi/", "/httptools/")),
    ("json", ("/json/",)),
    ("event loop (asyncio)", ("/asyncio/", "/selectors.py", "/uvloop/")),
    ("OpenTelemetry", ("/opentelemetry/",)),
)


def _component(filename: str, function: str) -> str:
    if filename == "~":  # a C function, named by what it is part of
        if "pydantic_core" in function:
            return "pydantic"
        if any(m in function for m in ("json", "scanner", "encoder", "orjson")):
            return "json"
        if any(m in function for m in ("socket", "epoll", "select", "uvloop", "_ssl", "poll")):
            return "socket I/O and polling (C)"
        return "other C builtins"
    for name, markers in _COMPONENTS:
        if any(m in filename for m in markers):
            return name
    return "other Python"


def profile_summary(files: list[Path], calls: int) -> dict[str, Any]:
    """Self time by component (shares, and ms per model call under the profiler) and tracerl's costliest functions."""
    import pstats

    files = [f for f in files if f.exists()]
    if not files:
        return {"missing": True}
    stats = pstats.Stats(*map(str, files)).stats  # type: ignore[attr-defined]
    by_component: dict[str, float] = {}
    own: list[tuple[float, float, str]] = []
    other: dict[str, float] = {}
    total = 0.0
    for (filename, line, function), (_cc, _nc, tt, ct, _callers) in stats.items():
        component = _component(filename, function)
        by_component[component] = by_component.get(component, 0.0) + tt
        total += tt
        if component in ("other Python", "other C builtins"):
            where = function if filename == "~" else filename.split("site-packages/")[-1].split("python3.11/")[-1]
            other[where] = other.get(where, 0.0) + tt
        if component == "tracerl":
            own.append((tt, ct, f"{Path(filename).parent.name}/{Path(filename).name}:{line}({function})"))
    own.sort(reverse=True)
    return {
        "files": [f.name for f in files], "profiled_s": total,
        "self_share": {k: v / total for k, v in sorted(by_component.items(), key=lambda kv: -kv[1])},
        "self_ms_per_call": {k: 1000 * v / calls for k, v in sorted(by_component.items(), key=lambda kv: -kv[1])},
        "tracerl_top_self": [{"function": f, "self_ms_per_call": 1000 * tt / calls, "cumulative_ms_per_call": 1000 * ct / calls}
                             for tt, ct, f in own[:12]],
        "other_top": {k: 1000 * v / calls for k, v in sorted(other.items(), key=lambda kv: -kv[1])[:10]},
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


PROFILED = """import cProfile, os, runpy, signal, sys, time
out, target, *argv = sys.argv[1:]
sys.argv = [target, *argv]
profiler = cProfile.Profile(time.process_time)  # CPU time: an idle event loop's wait is not work


def stop(*_):
    profiler.disable()
    profiler.dump_stats(out + ".tmp")
    os.replace(out + ".tmp", out)


signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())  # the measured gather starts
signal.signal(signal.SIGUSR2, stop)  # ... and ends
if target.endswith(".py"):
    runpy.run_path(target, run_name="__main__")
else:
    runpy.run_module(target, run_name="__main__", alter_sys=True)
"""


async def _profile_window(procs: list[subprocess.Popen], files: list[Path | None], start: bool) -> None:
    """Start (SIGUSR1) or stop (SIGUSR2) the profilers of ``procs``; on stop, wait until each wrote its file."""
    for proc, file in zip(procs, files):
        if file is not None:
            os.kill(proc.pid, signal.SIGUSR1 if start else signal.SIGUSR2)
    if not start:
        for file in files:
            for _ in range(600):
                if file is None or file.exists():
                    break
                await asyncio.sleep(0.05)


def python_cmd(target: str, argv: list[str], profile: Path | None) -> list[str]:
    """``python -m target argv`` (or ``python target.py argv``), under cProfile writing ``profile`` if given."""
    if profile is None:
        return [sys.executable, *(["-m", target] if not target.endswith(".py") else [target]), *argv]
    return [sys.executable, "-c", PROFILED, str(profile), target, *argv]


def make_plan(workload: str, args: argparse.Namespace, seed: int):
    """A rollout's start delay and its calls' completion lengths (drawn before it runs: seeded)."""
    rng = random.Random(seed)
    measured = json.loads((HERE / "results" / "completion_lengths.json").read_text())["completion_tokens"]

    def plan() -> tuple[float, list[int]]:
        if workload == "synchronised":
            return 0.0, [args.tokens] * args.turns
        return rng.uniform(0, args.start_spread_s), [rng.choice(measured) for _ in range(args.turns)]

    return plan


class Driver:
    """One driver process's share of the rollouts: ``groups`` groups through the router at ``port``."""

    def __init__(self, port: int, urls: list[str], groups: int, workload: str, args: argparse.Namespace, seed: int) -> None:
        self.args, self.groups, self.urls = args, groups, urls
        self.model = tracerl.Model("sim-agent", "scale-sim", inference_base_url=f"http://127.0.0.1:{port}/v1",
                                   inference_api_key="sim", inference_timeout=3600)
        # --direct: each group calls one replica itself (no router), to see what the router adds
        self.direct = [tracerl.Model("sim-agent", "scale-sim", inference_base_url=f"{url}/v1", inference_api_key="sim",
                                     inference_timeout=3600) for url in urls]
        if args.client_pool != "tracerl":
            from openai import AsyncOpenAI, DefaultAsyncHttpxClient

            from tracerl.net.http_pool import ShardedTransport, http_module_of
            from tracerl.model import _tag_group

            for m in (self.model, *self.direct):
                # sdk-default: the OpenAI SDK's own pool (1,000 connections, 100 kept alive); sharded: tracerl's without aiohttp
                transport = ShardedTransport(http=http_module_of(DefaultAsyncHttpxClient)) if args.client_pool == "sharded" else None
                m._client = AsyncOpenAI(base_url=m.inference_base_url, api_key="sim", max_retries=0, timeout=3600,
                                        http_client=DefaultAsyncHttpxClient(event_hooks={"request": [_tag_group]}, transport=transport))
                m._client_key = (m.inference_base_url, m.inference_api_key, m.inference_timeout)
        self.records: list[dict[str, float]] = []
        self.plan = make_plan(workload, args, seed)

    async def rollout(self, task: int) -> tracerl.Trajectory:
        args = self.args
        delay, lengths = self.plan()
        if delay:
            await asyncio.sleep(delay)
        started = time.perf_counter()
        messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {task} + {task}?"}]
        engine_s = 0.0
        for turn in range(args.turns):
            client = (self.direct[task % len(self.direct)] if args.direct else self.model).openai_client()
            completion = await client.chat.completions.create(
                model="sim-agent", messages=[m if isinstance(m, dict) else m.message for m in messages],
                max_tokens=lengths[turn], logprobs=True, extra_body={"return_token_ids": True})
            engine_s += float(completion.model_extra["tracerl_sim"]["engine_s"])
            messages.append(tracerl.Choice.from_openai(completion.choices[0], completion))
            if turn + 1 < args.turns:
                messages.append({"role": "user", "content": "Check it and continue."})
        trajectory = tracerl.Trajectory(messages_and_choices=messages, reward=float(task % 2))
        wall = time.perf_counter() - started
        self.records.append({"wall_s": wall, "engine_s": engine_s, "overhead_s": wall - engine_s})
        return trajectory

    async def gather(self, groups: int) -> list[tracerl.TrajectoryGroup]:
        size = self.args.group_size
        return await tracerl.gather_trajectory_groups(
            (tracerl.TrajectoryGroup(self.rollout(g) for _ in range(size)) for g in range(groups)), pbar_desc=None)

    async def warm_up(self) -> None:
        """Not measured: imports, the first connections client->router->replicas."""
        await self.gather(min(self.groups, 4))
        self.records.clear()

    async def measured(self, profile: Path | None = None) -> dict[str, Any]:
        profiler = cProfile.Profile(time.process_time) if profile is not None else None
        cpu = time.process_time()
        started = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        groups = await self.gather(self.groups)
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile)
        return {"records": self.records, "gather_wall_s": time.perf_counter() - started,
                "cpu_s": time.process_time() - cpu, "trajectories": sum(len(g.trajectories) for g in groups),
                "exceptions": sum(len(g.exceptions) for g in groups)}


async def _child_main(spec: dict[str, Any]) -> None:
    """``--drive-child``: one of ``--driver-processes`` drivers; warm up, say READY, run on GO, print RESULT."""
    args = argparse.Namespace(**spec["args"])
    driver = Driver(spec["port"], spec["urls"], spec["groups"], spec["workload"], args, spec["seed"])
    await driver.warm_up()
    print("READY", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    result = await driver.measured(Path(spec["profile"]) if spec.get("profile") else None)
    print("RESULT " + json.dumps(result), flush=True)


async def _drive_in_processes(k: int, port: int, urls: list[str], groups_n: int, workload: str,
                              args: argparse.Namespace, profile: Path | None, on_ready: Any) -> list[dict[str, Any]]:
    """Run the groups over ``k`` driver processes (each its own share), measured together from one GO
    (``on_ready`` runs when every one has warmed up, just before it)."""
    shares = [groups_n // k + (1 if i < groups_n % k else 0) for i in range(k)]
    children = []
    for i, share in enumerate(shares):
        spec = {"args": {a: v for a, v in vars(args).items()}, "port": port, "urls": urls, "groups": share,
                "workload": workload, "seed": args.seed + 1000 * i,
                "profile": str(profile.with_name(f"{profile.stem}-{i}.prof")) if profile else None}
        children.append(await asyncio.create_subprocess_exec(
            sys.executable, str(Path(__file__).resolve()), "--drive-child", json.dumps(spec),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, start_new_session=True))

    async def expect(child: Any, prefix: str) -> str:
        while True:
            line = (await child.stdout.readline()).decode()
            if not line:
                raise RuntimeError(f"a driver process exited before {prefix} (rc {await child.wait()})")
            if line.startswith(prefix):
                return line[len(prefix):].strip()

    try:
        await asyncio.gather(*(expect(c, "READY") for c in children))
        on_ready()
        for child in children:
            child.stdin.write(b"GO\n")
            await child.stdin.drain()
        results = [json.loads(r) for r in await asyncio.gather(*(expect(c, "RESULT ") for c in children))]
        return results
    except BaseException:
        for child in children:
            if child.returncode is None:
                child.kill()  # a driver we started, by its own handle
        raise
    finally:
        for child in children:
            if child.returncode is None:
                child.stdin.close()
                await child.wait()


async def run_config(replicas: int, rollouts: int, workload: str, args: argparse.Namespace) -> dict[str, Any]:
    tag = f"{workload}-{replicas}x{rollouts}-k{args.driver_processes}"
    prof_dir = Path(args.profile) if args.profile else None
    if prof_dir is not None:
        prof_dir.mkdir(parents=True, exist_ok=True)
    prof = (lambda name: prof_dir / f"{name}-{tag}.prof") if prof_dir is not None else (lambda name: None)
    sim = _start(python_cmd(str(HERE / "sim_replicas.py"), ["--replicas", str(replicas), "--rate-at-knee",
                                                             str(args.rate_at_knee), "--knee", str(args.knee)], prof("replicas")))
    router = None
    try:
        line = sim.stdout.readline()
        if not line.startswith("PORTS "):
            raise RuntimeError(f"sim replicas did not start: {line}{sim.stderr.read()[-2000:]}")
        urls = [f"http://127.0.0.1:{p}" for p in line.split()[1:]]
        port = free_port()
        router = _start(python_cmd("tracerl.cluster", ["--port", str(port), "--http", args.router_http, "--loop", args.router_loop,
                                                       *[a for url in urls for a in ("--replica", url)]], prof("router")))
        await _wait_healthy(f"http://127.0.0.1:{port}/health")
        servers, server_profiles = [router, sim], [prof("router"), prof("replicas")]
        groups_n = max(rollouts // args.group_size, 1)
        if args.driver_processes == 1:
            driver = Driver(port, urls, groups_n, workload, args, args.seed)
            await driver.warm_up()
            await _profile_window(servers, server_profiles, start=True)
            cpu_before = (cpu_seconds(router.pid), cpu_seconds(sim.pid))
            results = [await driver.measured(prof("driver"))]
        else:
            snapshot: list[tuple[float, float]] = []

            def ready() -> None:
                for proc, file in zip(servers, server_profiles):
                    if file is not None:
                        os.kill(proc.pid, signal.SIGUSR1)
                snapshot.append((cpu_seconds(router.pid), cpu_seconds(sim.pid)))

            results = await _drive_in_processes(args.driver_processes, port, urls, groups_n, workload, args, prof("driver"), ready)
            cpu_before = snapshot[0]
        cpu_after = (cpu_seconds(router.pid), cpu_seconds(sim.pid))
        await _profile_window(servers, server_profiles, start=False)
        async with httpx.AsyncClient() as client:
            state = (await client.get(f"http://127.0.0.1:{port}/router/replicas")).json()["replicas"]
    finally:
        if router is not None:
            _stop(router)
        _stop(sim)
    records = [r for result in results for r in result["records"]]
    overhead = [r["overhead_s"] for r in records]
    share = [r["overhead_s"] / r["wall_s"] for r in records]
    served = [r["served"] for r in state]
    calls = len(records) * args.turns
    router_cpu, sim_cpu = (after - before for after, before in zip(cpu_after, cpu_before))
    driver_cpu = sum(result["cpu_s"] for result in results)
    out = {
        "workload": workload, "replicas": replicas, "rollouts": len(records), "groups": groups_n, "turns": args.turns,
        "tokens_per_call": args.tokens, "driver_processes": args.driver_processes,
        "trajectories": sum(result["trajectories"] for result in results),
        "exceptions": sum(result["exceptions"] for result in results),
        "gather_wall_s": max(result["gather_wall_s"] for result in results),
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
    if prof_dir is not None:
        out["profile"] = {name: profile_summary(sorted(prof_dir.glob(f"{name}-{tag}*.prof")), calls)
                          for name in ("driver", "router", "replicas")}
    return out


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
    p.add_argument("--client-pool", choices=["tracerl", "sharded", "sdk-default"], default="tracerl",
                   help="tracerl: model.openai_client() as it is (aiohttp when installed); sharded: its httpx pools "
                        "(without aiohttp); sdk-default: the OpenAI SDK's own pool")
    p.add_argument("--direct", action="store_true", help="bypass the router: each group calls one replica")
    p.add_argument("--driver-processes", type=int, default=1,
                   help="run the rollouts over K driver processes (each its own share of the groups), as one would "
                        "deploy 1,000 rollouts (RayRollouts tasks on worker nodes); 1: all in this process")
    p.add_argument("--profile", default=None, help="write cProfile stats of every process (driver, router, replicas) "
                   "to this folder and add a per-component summary to the JSON")
    p.add_argument("--drive-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=str(HERE / "results" / "scale_sim.json"))
    args = p.parse_args()
    if args.drive_child:
        asyncio.run(_child_main(json.loads(args.drive_child)))
        return
    if args.driver_processes < 1:
        p.error("--driver-processes must be >= 1")
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
            for name, summary in r.get("profile", {}).items():
                if "self_share" in summary:
                    print(f"  {name} self time: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in summary["self_share"].items()
                                                            if v >= 0.02), flush=True)
    print()
    print("| workload | replicas | concurrent rollouts | driver processes | rollout wall (median) | simulated engine time | overhead median | p99 | "
          "overhead share median | p99 | CPU ms per call: driver / router / replicas | requests/replica min–max |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['workload']} | {r['replicas']} | {r['rollouts']} | {r['driver_processes']} | {r['rollout_wall_s_median']:.2f} s | "
              f"{r['engine_s_median']:.2f} s | {r['overhead_ms_median']:.1f} ms | {r['overhead_ms_p99']:.1f} ms | "
              f"{100 * r['overhead_share_median']:.2f}% | {100 * r['overhead_share_p99']:.2f}% | "
              f"{r['driver_cpu_ms_per_call']:.2f} / {r['router_cpu_ms_per_call']:.2f} / {r['replicas_cpu_ms_per_call']:.2f} | "
              f"{r['requests_per_replica_min']}–{r['requests_per_replica_max']} |")
    Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"\nraw results: {args.json}")


if __name__ == "__main__":
    main()
