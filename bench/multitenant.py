"""Four models on one ``tracerl serve --tinker`` vs four separate LocalBackends, side by side.

Both sides train the demo's model, task, rollout and reward (``examples/demo.py``: SmolLM2-135M,
LoRA r16, 2 groups x 8 rollouts per step, lr 1e-4); model ``i`` uses the demo's tasks of seed
``i`` on both sides, and every model takes the same number of steps.

* ``shared``: one ``tracerl serve --tinker`` process.  Four tenants (one key each) with one model
  each, trained at once through :class:`tracerl.TinkerBackend` from one client process (each
  round, every model's step concurrently: the service trains one at a time, its sampler decodes
  every tenant's rollouts in the same forward passes).  The service trains all four as peft
  adapters of one copy of the base and samples them all from one transformers server holding
  every saved LoRA.
* ``separate``: four LocalBackends configured as the demo configures one (vLLM serving the merged
  policy, reloaded after each step; the trainer in the process), each in a process of its own.
  They run one after another: four at once would need the sum of their peaks, and that sum is
  what the table shows (the machine has 24 GiB; running them at once would only add swapping).

Per side: peak memory of the whole process tree (the worker and every descendant, sampled every
0.2 s; PSS, which splits shared pages, and the RSS sum, which counts them once per process),
set-up (servers started, models registered), step time (rollouts + train + the new weights
served; of it, ``backend.train``'s), steps per hour of all the models together (shared: the steps
over the wall time of the rounds; separate, run in turn: 3600 / the median step), and decode speed per model: after training,
``--decode-requests`` requests of ``--decode-tokens`` tokens (T=1, one at a time, a short prompt)
to each model's newest weights through its OpenAI endpoint, median tokens/s; % of the matmul
ceiling at 2·P FLOPs per token (``bench/ceiling.py``, measured before each worker).

Shared sampling (the shared side only; issue 45's acceptance): through the ``tinker`` SDK, each
tenant's newest weights sample groups of ``--group`` rows (``num_samples``, one prompt, T=1,
``--sample-tokens`` tokens) ``--sample-requests`` times in a row; ``alone``: tenant 0 by itself;
``together``: all the tenants at once.  Aggregate sampled tokens/s of each, alternated
``--sample-rounds`` times on the same service (the first ``alone`` after a warm-up request).

    flock /tmp/tracerl-heavy.lock .venv/bin/python bench/multitenant.py --json bench/results/multitenant.json   (make bench-multitenant, ~22 min)
    flock /tmp/tracerl-heavy.lock .venv/bin/python bench/multitenant.py --shared-only --json /tmp/shared.json     (the service side: ~14 min)
    .venv/bin/python bench/multitenant.py --table-only --json bench/results/multitenant.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))

GFLOP_PER_TOKEN = 0.27  # 2 x 134.5M parameters
PROMPT = "Write a short story about a robot and its favourite colour."
WORKER_TIMEOUT_S = 3600


# -- the workers ------------------------------------------------------------------------------
def demo_args(seed: int, data: str) -> argparse.Namespace:
    import demo

    return demo.parse_args(["--seed", str(seed), "--data", data])


async def decode_speed(model: Any, requests: int, tokens: int) -> dict[str, float]:
    """Median tokens/s of ``requests`` one-at-a-time completions from the model's newest weights."""
    client = model.openai_client()
    rates, counts = [], []
    for seed in range(requests):
        started = time.perf_counter()
        completion = await client.chat.completions.create(
            model=model.get_inference_name(), messages=[{"role": "user", "content": PROMPT}], max_tokens=tokens, temperature=1.0, seed=seed
        )
        counts.append(completion.usage.completion_tokens)
        rates.append(completion.usage.completion_tokens / (time.perf_counter() - started))
    return {"decode_tok_s": statistics.median(rates), "decode_tokens": statistics.median(counts)}


def start_tinker_server(
    data: Path, keys: dict[str, str], *, env: dict[str, str] | None = None, extra_args: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, str]:
    """``tracerl serve --tinker`` (no OpenAI-compatible inference) on a free port, once it answers its health check.

    ``env``: the server's environment (default: this process's); ``extra_args``: more ``tracerl serve`` options."""
    import httpx

    (data / "keys.json").write_text(json.dumps(keys))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "tracerl", "serve", "--tinker", "--inference", "none", "--tinker-keys", str(data / "keys.json"),
               "--port", str(port), "--path", str(data / "serve"), *extra_args]  # fmt: skip
    server = subprocess.Popen(command, stdout=open(data / "serve.log", "w"), stderr=subprocess.STDOUT, env=env)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"tracerl serve --tinker exited:\n{(data / 'serve.log').read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    raise SystemExit("tracerl serve --tinker did not answer /api/v1/healthz within 300 s")


async def shared_worker(args: argparse.Namespace, data: Path) -> dict[str, Any]:
    import demo
    import psutil
    import tracerl

    started = time.monotonic()
    keys = {f"tml-bench-{i}-{secrets.token_hex(8)}": f"tenant{i}" for i in range(args.models)}
    server, url = start_tinker_server(data, keys)
    try:
        models = []
        for i, key in enumerate(keys):
            dargs = demo_args(i, str(data / "runs"))
            backend = tracerl.TinkerBackend(url, key)
            model = demo.make_model(dargs, name=f"tenant{i}")
            await model.register(backend)
            models.append((model, backend, dargs))
        setup = time.monotonic() - started
        seconds: dict[int, list[tuple[float, float]]] = {i: [] for i in range(args.models)}
        rounds_started = time.monotonic()
        for step in range(args.steps):  # every model's step 1 at once, then every model's step 2, ...
            done = await asyncio.gather(*(one_step(model, backend, dargs, step) for model, backend, dargs in models))
            for i, result in enumerate(done):
                seconds[i].append(result)
        rounds_s = time.monotonic() - rounds_started
        decode = [await decode_speed(model, args.decode_requests, args.decode_tokens) for model, _, _ in models]
        sampling = await shared_sampling(models, args)
        served_by = sorted({model.inference_base_url for model, _, _ in models})
        processes = 1 + len(psutil.Process().children(recursive=True))
        for _, backend, _ in models:
            await backend.close()
    finally:
        server.terminate()
        server.wait(60)
    return {"setup_s": setup, "step_s": seconds, "rounds_s": rounds_s, "decode": decode, "sampling": sampling,
            "served_by": served_by, "processes": processes}  # fmt: skip


async def shared_sampling(models: list[tuple[Any, Any, argparse.Namespace]], args: argparse.Namespace) -> dict[str, Any]:
    """Tenant 0 sampling alone vs every tenant sampling at once, groups of ``args.group`` rows, alternated."""
    from tinker import types

    samplers = []
    for model, backend, _ in models:
        training = backend.clients[model.project, model.name]
        samplers.append(await training.save_weights_and_get_sampling_client_async())
    tokenizer = models[0][1].tokenizers[models[0][0].project, models[0][0].name]
    prompt = types.ModelInput.from_ints(list(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True, return_dict=False)))
    seeds = iter(range(10**6))

    async def tenant(sampler: Any) -> int:
        tokens = 0
        for _ in range(args.sample_requests):
            params = types.SamplingParams(max_tokens=args.sample_tokens, temperature=1.0, seed=next(seeds))
            response = await sampler.sample_async(prompt=prompt, num_samples=args.group, sampling_params=params)
            tokens += sum(len(sequence.tokens) for sequence in response.sequences)
        return tokens

    async def timed(group: list[Any]) -> dict[str, float]:
        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(tenant(sampler) for sampler in group)))
        wall = time.perf_counter() - started
        return {"tokens": tokens, "seconds": wall, "tok_s": tokens / wall}

    await samplers[0].sample_async(prompt=prompt, num_samples=args.group, sampling_params=types.SamplingParams(max_tokens=4, seed=0))  # warm-up
    rounds = []
    for _ in range(args.sample_rounds):
        rounds.append({"alone": await timed(samplers[:1]), "together": await timed(samplers)})
    return {"tenants": len(samplers), "group": args.group, "requests": args.sample_requests, "max_tokens": args.sample_tokens,
            "prompt_tokens": prompt.length, "rounds": rounds}  # fmt: skip


async def one_step(model: Any, backend: Any, dargs: argparse.Namespace, step: int) -> tuple[float, float]:
    """Demo step ``step`` of one model (its seed's tasks): the step's wall seconds, and those of
    ``backend.train`` (train, save, the new weights served: the rest is rollouts)."""
    import demo

    tasks = demo.make_tasks(dargs.seed, 400)
    batch = SimpleNamespace(step=step, items=tasks[step * dargs.groups_per_step : (step + 1) * dargs.groups_per_step])
    started = time.monotonic()
    _, result = await demo.train_step(model, backend, batch, dargs)
    train = sum(result.metrics.get(key, 0.0) for key in ("train_seconds", "save_seconds", "hot_load_seconds"))
    return time.monotonic() - started, train


async def separate_worker(args: argparse.Namespace, data: Path, index: int) -> dict[str, Any]:
    import demo
    import psutil

    started = time.monotonic()
    dargs = demo_args(index, str(data / "runs"))
    backend = demo.make_backend(dargs)
    model = demo.make_model(dargs, name=f"separate{index}")
    await model.register(backend)
    setup = time.monotonic() - started
    try:
        seconds = [await one_step(model, backend, dargs, step) for step in range(args.steps)]
        decode = await decode_speed(model, args.decode_requests, args.decode_tokens)
        processes = 1 + len(psutil.Process().children(recursive=True))
    finally:
        await backend.close()
    return {"setup_s": setup, "step_s": {index: seconds}, "decode": [decode], "served_by": [model.inference_base_url], "processes": processes}


def worker(args: argparse.Namespace) -> None:
    from tracerl.train.allocator import relaunch_with_jemalloc

    relaunch_with_jemalloc()  # as the demo runs (both sides; the service inherits it)
    with tempfile.TemporaryDirectory(prefix="tracerl-multitenant-") as tmp:
        if args.worker == "shared":
            result = asyncio.run(shared_worker(args, Path(tmp)))
        else:
            result = asyncio.run(separate_worker(args, Path(tmp), int(args.worker.split("-")[1])))
    print("RESULT " + json.dumps(result), flush=True)


# -- the orchestrator -------------------------------------------------------------------------
def run_worker(args: argparse.Namespace, side: str) -> dict[str, Any]:
    """One worker process, its whole tree's memory sampled until it exits."""
    from ceiling import measure_ceiling
    from serving_speed import TreeRSS

    ceiling = measure_ceiling()
    command = [sys.executable, os.path.abspath(__file__), "--worker", side, "--models", str(args.models), "--steps", str(args.steps),
               "--decode-requests", str(args.decode_requests), "--decode-tokens", str(args.decode_tokens), "--group", str(args.group),
               "--sample-requests", str(args.sample_requests), "--sample-tokens", str(args.sample_tokens),
               "--sample-rounds", str(args.sample_rounds)]  # fmt: skip
    print(f"running {side} ...", flush=True)
    started = time.monotonic()
    with tempfile.TemporaryFile(mode="w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
        with TreeRSS(process.pid, pss=True) as memory:
            try:
                process.wait(WORKER_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.seek(0)
        output = log.read()
    line = next((l for l in output.splitlines() if l.startswith("RESULT ")), None)
    if process.returncode != 0 or line is None:
        print(output[-6000:])
        raise SystemExit(f"{side} worker failed (rc {process.returncode})")
    result = json.loads(line[len("RESULT ") :])
    result.update(side=side, wall_s=time.monotonic() - started, peak_pss_mb=memory.pss_peak / 2**20, peak_rss_mb=memory.peak / 2**20,
                  ceiling_gflops=ceiling["matmul_gflops"])  # fmt: skip
    print(f"  {side}: peak tree PSS {result['peak_pss_mb']:.0f} MB, {time.monotonic() - started:.0f} s", flush=True)
    return result


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The two sides' rows: the separate workers summed (memory, set-up) or pooled (steps, decode)."""
    rows = {}
    for label, members in (("shared", [r for r in runs if r["side"] == "shared"]), ("separate", [r for r in runs if r["side"] != "shared"])):
        if not members:  # --shared-only
            continue
        steps = [s for r in members for seconds in r["step_s"].values() for s, _ in seconds]
        train = [t for r in members for seconds in r["step_s"].values() for _, t in seconds]
        decode = [d["decode_tok_s"] for r in members for d in r["decode"]]
        ceiling = statistics.median(r["ceiling_gflops"] for r in members)
        rows[label] = {
            "peak_pss_mb": sum(r["peak_pss_mb"] for r in members),
            "peak_rss_mb": sum(r["peak_rss_mb"] for r in members),
            "processes": sum(r["processes"] for r in members),
            "servers": sum(len(r["served_by"]) for r in members),
            "setup_s": sum(r["setup_s"] for r in members),
            "step_s_median": statistics.median(steps),
            "step_s_range": [min(steps), max(steps)],
            "train_s_median": statistics.median(train),
            "steps_per_hour": (len(steps) * 3600 / sum(r["rounds_s"] for r in members)) if label == "shared" else 3600 / statistics.median(steps),
            "decode_tok_s": decode,
            "decode_percent_of_ceiling": 100 * statistics.median(decode) * GFLOP_PER_TOKEN / ceiling,
            "ceiling_gflops": ceiling,
        }
    shared = next(r for r in runs if r["side"] == "shared")
    if shared.get("sampling"):
        sampling = shared["sampling"]
        alone = [r["alone"] for r in sampling["rounds"]]
        together = [r["together"] for r in sampling["rounds"]]
        rate = {k: sum(r["tokens"] for r in v) / sum(r["seconds"] for r in v) for k, v in (("alone", alone), ("together", together))}
        rows["sampling"] = {
            "alone_tok_s": rate["alone"],
            "together_tok_s": rate["together"],
            "speedup": rate["together"] / rate["alone"],
            "alone_rounds_tok_s": [r["tok_s"] for r in alone],
            "together_rounds_tok_s": [r["tok_s"] for r in together],
            "alone_percent_of_ceiling": 100 * rate["alone"] * GFLOP_PER_TOKEN / shared["ceiling_gflops"],
            "together_percent_of_ceiling": 100 * rate["together"] * GFLOP_PER_TOKEN / shared["ceiling_gflops"],
        }
    return rows


def table(result: dict[str, Any]) -> str:
    rows = result["summary"]
    lines = [
        "| side | peak PSS | RSS sum | processes | servers | set-up | step [range] | in `train` | steps/h | decode tok/s per model [range] | % ceiling |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    n = result["settings"]["models"]
    for label, name in (("shared", f"{n} models, one `tracerl serve --tinker`"), ("separate", f"{n} LocalBackends (sum)")):
        if label not in rows:
            continue
        r = rows[label]
        decode = r["decode_tok_s"]
        lines.append(
            f"| {name} | {r['peak_pss_mb']:,.0f} MB | {r['peak_rss_mb']:,.0f} MB | {r['processes']} | {r['servers']} | {r['setup_s']:.0f} s "
            f"| {r['step_s_median']:.0f} s [{r['step_s_range'][0]:.0f}–{r['step_s_range'][1]:.0f}] | {r['train_s_median']:.0f} s | {r['steps_per_hour']:.0f} "
            f"| {statistics.median(decode):.1f} [{min(decode):.1f}–{max(decode):.1f}] | {r['decode_percent_of_ceiling']:.1f}% |"
        )
    shared, separate = rows["shared"], rows.get("separate")
    lines.append("")
    if separate is not None:
        lines.append(
            f"Shared/separate: memory {shared['peak_pss_mb'] / separate['peak_pss_mb']:.2f}× (PSS), steps/hour "
            f"{shared['steps_per_hour'] / separate['steps_per_hour']:.2f}×, decode per model "
            f"{statistics.median(shared['decode_tok_s']) / statistics.median(separate['decode_tok_s']):.2f}×."
        )
    if "sampling" in rows:
        lines += ["", sampling_table(result)]
    return "\n".join(lines)


def sampling_table(result: dict[str, Any]) -> str:
    """Shared sampling: one tenant alone vs every tenant at once, on the same service."""
    rows = result["summary"]["sampling"]
    sampling = next(r for r in result["runs"] if r["side"] == "shared")["sampling"]
    what = f"groups of {sampling['group']} rows × {sampling['max_tokens']} tokens, {sampling['requests']} requests a tenant, {len(sampling['rounds'])} rounds"
    lines = [
        f"| sampling ({what}) | aggregate tok/s [rounds] | % ceiling |",
        "|---|---:|---:|",
        f"| 1 tenant alone | {rows['alone_tok_s']:.1f} [{', '.join(f'{v:.1f}' for v in rows['alone_rounds_tok_s'])}] | {rows['alone_percent_of_ceiling']:.1f}% |",
        f"| {sampling['tenants']} tenants at once | {rows['together_tok_s']:.1f} [{', '.join(f'{v:.1f}' for v in rows['together_rounds_tok_s'])}] "
        f"| {rows['together_percent_of_ceiling']:.1f}% |",
        "",
        f"{sampling['tenants']} tenants at once / 1 alone: {rows['speedup']:.2f}× aggregate sampled tokens/s.",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=int, default=4)
    p.add_argument("--steps", type=int, default=1, help="demo steps per model")
    p.add_argument("--decode-requests", type=int, default=2)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--group", type=int, default=8, help="rows a sampling request asks for (num_samples)")
    p.add_argument("--sample-requests", type=int, default=2, help="sampling requests a tenant makes in a row, per round")
    p.add_argument("--sample-tokens", type=int, default=64)
    p.add_argument("--sample-rounds", type=int, default=2, help="alone/together rounds, alternated")
    p.add_argument("--shared-only", action="store_true", help="the shared side only (no LocalBackends): ~5 min")
    p.add_argument("--json", default=None, help="write the raw results here (and read them with --table-only)")
    p.add_argument("--table-only", action="store_true")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.table_only:
        print(table(json.loads(Path(args.json).read_text())))
        return
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runs = [run_worker(args, "shared")] + ([] if args.shared_only else [run_worker(args, f"separate-{i}") for i in range(args.models)])
    result = {"started": started, "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "settings": vars(args) | {"json": None},
              "runs": runs, "summary": summarize(runs)}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
