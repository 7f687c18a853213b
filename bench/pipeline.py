"""The synchronous loop vs ``tracerl.PipelineTrainer``, side by side: time and steps to a held-out target.

Two tasks, each run by both loops over the same seeds, with the demo's model, backend, tasks,
rollout, reward and held-out set (``examples/demo.py``: SmolLM2-135M, LoRA r16, vLLM serving
the merged policy when its runtime is installed, 2 groups x 8 rollouts per step, lr 1e-4):

* ``demo``: the demo task as it is (the ``add`` tool is computed in the rollout);
* ``slow_tool``: the same with the tool served by a real MCP server whose ``add`` sleeps a
  uniform 0.5-2 s per call (``bench/slow_add_server.py``, stdio, one session shared by the
  run's rollouts), as agent tools do.

Fixed settings: ``max_staleness`` 1, target held-out reward 0.9 (greedy, the demo's 16 held-out
tasks), evaluated after every step in both loops, at most ``--max-steps`` steps.  The clock is
wall time from the first step's start (set-up and the step-0 eval excluded; later evals
included, the same in both loops).  Utilisation: the trainer's is the time inside
``backend.train`` over the wall time; inference's is the fraction of 0.25 s samples of vLLM's
``vllm:num_requests_running`` (its Prometheus ``/metrics``) that are above 0.  Each run is a
subprocess of its own; the matmul ceiling (``bench/ceiling.py``) is measured before each, and
the peak memory of its whole process tree (worker, vLLM, MCP server; PSS, so shared pages count
once) while it runs.

A second measurement, ``--steps N``, runs each loop for exactly N steps with no eval and
reports seconds per step: the throughput each loop sustains once the first step is behind it,
which the race to a target reached at step 1 or 2 cannot show.  Its results go to
``bench/results/pipeline_steps.json``.

``--split-cores`` stands in for a trainer on a device of its own: inference (vLLM, its engine
and the MCP server) runs on core 0 and the loop with its trainer on core 1, in both loops
alike, and the backend does not pause serving while a step trains
(``LocalBackend(pause_serving_while_training=False)``).  Its results go to ``*_split_cores.json``.

    flock /tmp/tracerl-heavy.lock .venv/bin/python bench/pipeline.py --seeds 0,1,2              (make bench-pipeline)
    flock /tmp/tracerl-heavy.lock .venv/bin/python bench/pipeline.py --seeds 0,1,2 --steps 4    (make bench-pipeline)
    flock /tmp/tracerl-heavy.lock .venv/bin/python bench/pipeline.py --seeds 0,1,2 --steps 4 --split-cores       (make bench-pipeline)
    flock /tmp/tracerl-heavy.lock .venv/bin/python bench/pipeline.py --seeds 0,1,2 --tasks slow_tool --split-cores   (make bench-pipeline)
    .venv/bin/python bench/pipeline.py --table-only [--steps 4] [--split-cores]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))
TASKS = ("demo", "slow_tool")
LOOPS = ("synchronous", "pipelined")


# -- one run (a worker process) -----------------------------------------------------------
def demo_args(seed: int, data: str) -> argparse.Namespace:
    import demo

    return demo.parse_args(["--seed", str(seed), "--data", data])


class SlowAdd:
    """The MCP server's ``add``, one stdio session for the run's rollouts (concurrent calls wait side by side)."""

    async def __aenter__(self) -> "SlowAdd":
        from contextlib import AsyncExitStack

        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client

        self.stack = AsyncExitStack()
        params = StdioServerParameters(command=sys.executable, args=[str(ROOT / "bench" / "slow_add_server.py")])
        read, write = await self.stack.enter_async_context(stdio_client(params))
        self.session = await self.stack.enter_async_context(ClientSession(read, write))
        await asyncio.wait_for(self.session.initialize(), 60)
        return self

    async def __call__(self, a: int, b: int) -> str:
        result = await asyncio.wait_for(self.session.call_tool("add", {"a": a, "b": b}), 60)
        return result.content[0].text

    async def __aexit__(self, *exc: Any) -> None:
        await self.stack.aclose()


class InferenceBusy:
    """Samples vLLM's running-request gauge every 0.25 s through the proxy."""

    def __init__(self, model: Any) -> None:
        self.url = model.inference_base_url.removesuffix("/v1") + "/metrics"
        self.headers = {"Authorization": f"Bearer {model.inference_api_key}"}
        self.samples: list[float] = []
        self.task: asyncio.Task | None = None

    async def _poll(self) -> None:
        import httpx

        async with httpx.AsyncClient(timeout=5, headers=self.headers) as client:
            while True:
                try:
                    text = (await client.get(self.url)).text
                    running = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running"))
                    self.samples.append(running)
                except (httpx.HTTPError, ValueError, IndexError):
                    pass
                await asyncio.sleep(0.25)

    def start(self) -> None:
        self.task = asyncio.create_task(self._poll())

    async def stop(self) -> float | None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        return sum(1 for s in self.samples if s > 0) / len(self.samples) if self.samples else None


INFERENCE_CORE, TRAINER_CORE = 0, 1


def pin_process(core: int) -> None:
    """Pin every thread of this process to one core; threads and processes it starts later inherit it."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {core})


class TimedBackend:
    """The backend, with the time inside ``train`` summed (the trainer's busy time)."""

    def __init__(self, backend: Any) -> None:
        self.backend, self.busy = backend, 0.0

    async def train(self, model: Any, groups: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            return await self.backend.train(model, groups, **kwargs)
        finally:
            self.busy += time.monotonic() - started

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


async def run_one(loop: str, task: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    import demo

    import tracerl

    dargs = demo_args(seed, tempfile.mkdtemp(prefix="bench-pipeline-"))
    train_tasks, val_tasks = demo.make_tasks(seed, 400), demo.make_tasks(10_000 + seed, dargs.val_tasks)
    model = demo.make_model(dargs, name=f"{loop}-{task}-s{seed}")
    backend = TimedBackend(demo.make_backend(dargs))
    if args.split_cores:
        backend.backend.pause_serving_while_training = False  # inference has a core of its own: it goes on while a step trains
        pin_process(INFERENCE_CORE)  # vLLM and the MCP server start from here, so they inherit it (vLLM binds its threads to what it has)
    await model.register(backend.backend)
    evals: list[dict[str, float]] = []
    clock = {"start": 0.0}

    async with SlowAdd() if task == "slow_tool" else contextlib.nullcontext() as add_tool:
        if args.split_cores:
            import torch

            pin_process(TRAINER_CORE)  # the loop and its trainer threads (asyncio.to_thread) from here on
            torch.set_num_threads(1)

        def one(t: dict, temperature: float, rollout_seed: int | None) -> Any:
            return demo.rollout(model, t, temperature=temperature, seed=rollout_seed, add_tool=add_tool)

        async def evaluate(_model: Any, step: int) -> list[tracerl.TrajectoryGroup]:
            trajectories = await tracerl.gather_trajectories((one(t, 0.0, 0) for t in val_tasks), pbar_desc=None, max_exceptions=len(val_tasks))
            reward = sum(t.reward for t in trajectories) / len(val_tasks)
            evals.append({"step": step, "heldout": reward, "seconds": time.monotonic() - clock["start"] if step else 0.0})
            print(f"[{loop}/{task}/s{seed}] step {step}: held-out {reward:.3f} at {evals[-1]['seconds']:.0f}s", flush=True)
            return [tracerl.TrajectoryGroup([t]) for t in trajectories]

        def reached() -> bool:
            return evals[-1]["heldout"] >= args.target - 1e-9

        def rollout_group(_model: Any, item: tuple[int, int, dict], _config: Any) -> tracerl.TrajectoryGroup:
            step, g, t = item
            return tracerl.TrajectoryGroup(one(t, 1.0, seed * 1_000_003 + step * 997 + g * 31 + i) for i in range(dargs.rollouts))

        busy = InferenceBusy(model)
        fixed = args.steps > 0  # throughput: exactly args.steps steps, no eval
        try:
            if not fixed:
                await model.log(await evaluate(model, 0), split="val", step=0)
            scenarios = [(i // dargs.groups_per_step, i % dargs.groups_per_step, t) for i, t in enumerate(train_tasks)]
            busy.start()
            clock["start"] = time.monotonic()
            if loop == "synchronous":
                step = 0
                while step < (args.steps or args.max_steps) and (fixed or not reached()):
                    batch = scenarios[step * dargs.groups_per_step : (step + 1) * dargs.groups_per_step]
                    groups = await tracerl.gather_trajectory_groups((rollout_group(model, item, None) for item in batch), pbar_desc=None, max_exceptions=0.25)
                    result = await backend.train(model, groups, learning_rate=dargs.lr)
                    step = result.step
                    await model.log(groups, split="train", metrics=result.metrics, step=step)
                    if not fixed:
                        await model.log(await evaluate(model, step), split="val", step=step)
            else:
                trainer = tracerl.PipelineTrainer(
                    model, backend, rollout_group, scenarios, eval_fn=None if fixed else evaluate, eval_every_n_steps=1,
                    groups_per_step=dargs.groups_per_step, max_steps=args.steps or args.max_steps, max_staleness=args.max_staleness,
                    train_kwargs={"learning_rate": dargs.lr}, stop=None if fixed else reached,
                )  # fmt: skip
                await trainer.train()
            wall = time.monotonic() - clock["start"]
        finally:
            inference = await busy.stop()
            await backend.close()
    hit = next((e for e in evals if e["heldout"] >= args.target - 1e-9), None)
    rows = [r for r in model.history() if "train/reward" in r]
    shutil.rmtree(dargs.data, ignore_errors=True)  # the run's checkpoints and history: the result is the row below
    return {
        "loop": loop, "task": task, "seed": seed, "target": args.target, "max_staleness": args.max_staleness,
        "reached": hit is not None, "seconds_to_target": hit["seconds"] if hit else None, "steps_to_target": hit["step"] if hit else None,
        "wall_seconds": round(wall, 1), "steps": len(rows), "fixed_steps": args.steps,
        "seconds_per_step": round(wall / len(rows), 2) if rows else None, "trainer_utilisation": round(backend.busy / wall, 3),
        "inference_utilisation": round(inference, 3) if inference is not None else None,
        "serving": "merged" if backend.backend.serve_merged else "lora", "evals": evals,
        "split_cores": args.split_cores, "step_parts_seconds": step_parts(rows), "dropped_stale": sum(r.get("train/groups_dropped_stale", 0) for r in rows),
        "staleness_mean": statistics.fmean(r.get("train/staleness_mean", 0.0) for r in rows) if rows else 0.0,
    }  # fmt: skip


def step_parts(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds per step inside ``backend.train``: the optimizer step, the checkpoint save, the hot-load."""
    parts = ("train_seconds", "save_seconds", "hot_load_seconds")
    return {part: round(statistics.fmean(r.get(f"train/{part}", 0.0) for r in rows), 2) for part in parts} if rows else {}


# -- the driver ---------------------------------------------------------------------------
def run_worker(loop: str, task: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    from ceiling import measure_ceiling

    ceiling = measure_ceiling()
    cmd = [sys.executable, __file__, "--worker", loop, "--task", task, "--seed", str(seed), "--target", str(args.target),
           "--max-steps", str(args.max_steps), "--max-staleness", str(args.max_staleness), "--steps", str(args.steps)]  # fmt: skip
    cmd += ["--split-cores"] if args.split_cores else []
    from serving_speed import TreeRSS

    print(f"running {loop} on {task}, seed {seed} ...", flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with TreeRSS(proc.pid, pss=True) as memory:  # the worker, its vLLM and its MCP server, sampled as they run
        try:
            stdout, stderr = proc.communicate(timeout=3600)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
    line = next((l for l in stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        print(stdout[-3000:], stderr[-6000:], sep="\n")
        raise SystemExit(f"{loop}/{task}/seed {seed} failed (rc {proc.returncode})")
    return {**json.loads(line[len("RESULT ") :]), "ceiling": ceiling, "peak_tree_pss_mb": round(memory.pss_peak / 2**20)}


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]"


def each_side(runs: list[dict[str, Any]]) -> Iterator[tuple[str, str, list[dict[str, Any]]]]:
    """(task, loop, its runs) for every side with runs, in table order."""
    for task in TASKS:
        for loop in LOOPS:
            if mine := [r for r in runs if r["task"] == task and r["loop"] == loop]:
                yield task, loop, mine


def utilisation(mine: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in mine if r[key] is not None]
    return f"{statistics.median(values):.2f}" if values else "-"


def ceiling_gflops(mine: list[dict[str, Any]]) -> float:
    return statistics.median(r["ceiling"]["matmul_gflops"] for r in mine) if all("ceiling" in r for r in mine) else float("nan")


def print_ratios(medians: dict[tuple[str, str], float], says: str) -> None:
    """One line per task: the synchronous median over the pipelined one."""
    for task in TASKS:
        if (task, "synchronous") in medians and (task, "pipelined") in medians:
            print(f"\n{task}: the pipelined loop {says.format(medians[(task, 'synchronous')] / medians[(task, 'pipelined')])} (ratio of medians)")


def print_table(runs: list[dict[str, Any]]) -> None:
    print("| task | loop | seeds reaching 0.9 | time to target, s: median [min-max] | steps to target | trainer util. | inference util. | groups dropped stale | peak whole-tree memory (PSS), MiB | matmul ceiling GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    medians: dict[tuple[str, str], float] = {}
    for task, loop, mine in each_side(runs):
        times = [r["seconds_to_target"] for r in mine if r["reached"]]
        steps = [float(r["steps_to_target"]) for r in mine if r["reached"]]
        if len(times) == len(mine):
            medians[(task, loop)] = statistics.median(times)
        memory = spread([r["peak_tree_pss_mb"] for r in mine if "peak_tree_pss_mb" in r])
        print(f"| {task} | {loop} | {len(times)}/{len(mine)} | {spread(times)} | {spread(steps)} | {utilisation(mine, 'trainer_utilisation')} | "
              f"{utilisation(mine, 'inference_utilisation')} | {sum(r['dropped_stale'] for r in mine):.0f} | {memory} | {ceiling_gflops(mine):.0f} |")  # fmt: skip
    print_ratios(medians, "reaches the target {:.2f}x sooner")


def print_steps_table(runs: list[dict[str, Any]]) -> None:
    steps = "/".join(str(s) for s in sorted({r["fixed_steps"] for r in runs}))
    print("| task | loop | runs | steps | seconds per step: median [min-max] | trainer util. | inference util. | groups dropped stale | mean staleness | peak whole-tree memory (PSS), MiB | matmul ceiling GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    medians: dict[tuple[str, str], float] = {}
    for task, loop, mine in each_side(runs):
        per_step = [r["seconds_per_step"] for r in mine]
        medians[(task, loop)] = statistics.median(per_step)
        print(f"| {task} | {loop} | {len(mine)} | {steps} | {statistics.median(per_step):.1f} [{min(per_step):.1f}-{max(per_step):.1f}] | "
              f"{utilisation(mine, 'trainer_utilisation')} | {utilisation(mine, 'inference_utilisation')} | {sum(r['dropped_stale'] for r in mine):.0f} | "
              f"{statistics.fmean(r['staleness_mean'] for r in mine):.2f} | {spread([r['peak_tree_pss_mb'] for r in mine])} | {ceiling_gflops(mine):.0f} |")  # fmt: skip
    print_ratios(medians, "runs {:.2f}x the synchronous loop's steps per second")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--steps", type=int, default=0, help="run exactly this many steps with no eval and report seconds per step (0: the race to --target)")
    p.add_argument("--split-cores", action="store_true", help="inference on core 0, the loop and its trainer on core 1 (a trainer on its own device)")
    p.add_argument("--results", type=Path, default=None, help="default: bench/results/pipeline.json, or bench/results/pipeline_steps.json with --steps; *_split_cores.json with --split-cores")
    p.add_argument("--table-only", action="store_true")
    p.add_argument("--worker", choices=LOOPS)
    p.add_argument("--task", choices=TASKS)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(asyncio.run(run_one(args.worker, args.task, args.seed, args))), flush=True)
        return
    if args.results is None:
        args.results = ROOT / "bench" / "results" / f"{'pipeline_steps' if args.steps else 'pipeline'}{'_split_cores' if args.split_cores else ''}.json"
    runs: list[dict[str, Any]] = json.loads(args.results.read_text()) if args.results.exists() else []
    if not args.table_only:
        runs = [r for r in runs if not (r["task"] in args.tasks.split(",") and str(r["seed"]) in args.seeds.split(","))]
        for seed in (int(s) for s in args.seeds.split(",")):
            for task in args.tasks.split(","):
                order = LOOPS if seed % 2 == 0 else LOOPS[::-1]  # alternate which loop runs first
                for loop in order:
                    runs.append(run_worker(loop, task, seed, args))
                    args.results.write_text(json.dumps(runs, indent=1) + "\n")  # an interrupted sweep keeps what finished
    (print_steps_table if args.steps else print_table)(runs)


if __name__ == "__main__":
    main()
