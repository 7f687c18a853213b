"""Soak of ``tracerl serve --tinker`` under several tenants and a sampling flood (issue 45's acceptance).

One server process (SmolLM2-135M, the embedded model), ``--tenants`` tenants (one key each) driven
at once through the official ``tinker`` SDK, each a thread running ``--iterations`` iterations of
what an RL loop does (tinker-cookbook's shape): ``forward_backward`` (cross-entropy, ``--datums``
datums of ``--tokens`` tokens) → ``optim_step`` → an unnamed ``save_weights_for_sampler``
(``save_weights_and_get_sampling_client``) → ``sample`` (``--samples`` rows of ``--sample-tokens``
tokens), on rank-``--rank`` adapters.  The sampler's adapter cap is set below the tenant count
(``--max-sampler-adapters``, 1 a tenant), so adapters are evicted and reloaded all the time.

Phases: warm-up (not measured), ``calm`` (the tenants alone, until every tenant has done a quarter
of its iterations: a barrier), then ``flood``: a fifth tenant's ``--flood-threads`` threads sample
the base model with the largest requests the limits allow (``max_num_samples`` rows of
``max_sample_tokens`` tokens after a ``max_prompt_tokens`` prompt) until the tenants finish.

Recorded, and checked against the acceptance bounds:

* sampler adapters loaded, the service's own count (``GET /api/v1/tracerl/stats``, polled every
  0.5 s, and its peak): never above the cap;
* the server's process-tree RSS (sampled every 0.5 s): the peak over the last fifth of the flood
  phase within +10% of the peak over its first fifth (after warm-up, the same load);
* 5xx answers (the server's access log) and lost futures (an SDK call that raised): none;
* each tenant's iterations done when the first tenant finished all of its: within ±20% of the mean;
* the tenants' p95 iteration time in the flood phase ≤ 2× the calm phase's.

    flock /tmp/tracerl-heavy.lock .venv/bin/python bench/tinker_soak.py --json bench/results/tinker_soak.json   (make soak-tinker)
    flock /tmp/tracerl-heavy.lock .venv/bin/python bench/tinker_soak.py --iterations 20 --json /tmp/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from multitenant import start_tinker_server  # noqa: E402 - the one way the benches start a service

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=None, help="iterations not measured (default: max(2, iterations // 20))")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--datums", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--sample-tokens", type=int, default=8)
    parser.add_argument("--flood-threads", type=int, default=4, help="0: no flooding tenant")
    parser.add_argument("--max-sampler-adapters", type=int, default=3)
    parser.add_argument("--max-num-samples", type=int, default=8, help="the server's limit: the flood's rows a request")
    parser.add_argument("--max-sample-tokens", type=int, default=32, help="the server's limit: the flood's tokens a row")
    parser.add_argument("--max-prompt-tokens", type=int, default=128, help="the server's limit: the flood's prompt")
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args(argv)


def start_server(data: Path, keys: dict[str, str], args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """The service under test, with the soak's limits (the ``TRACERL_TINKER_*`` settings) and an access log."""
    env = {
        **os.environ, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1",
        "TRACERL_TINKER_MAX_SAMPLER_ADAPTERS": str(args.max_sampler_adapters), "TRACERL_TINKER_MAX_SAMPLER_ADAPTERS_PER_TENANT": "1",
        "TRACERL_TINKER_MAX_NUM_SAMPLES": str(args.max_num_samples), "TRACERL_TINKER_MAX_SAMPLE_TOKENS": str(args.max_sample_tokens),
        "TRACERL_TINKER_MAX_PROMPT_TOKENS": str(args.max_prompt_tokens),
    }  # fmt: skip
    return start_tinker_server(data, keys, env=env, extra_args=("--access-log", str(data / "access.log")))


def tree_rss(pid: int) -> int:
    import psutil

    total = 0
    try:
        root = psutil.Process(pid)
        for process in [root, *root.children(recursive=True)]:
            try:
                total += process.memory_info().rss
            except psutil.Error:
                pass
    except psutil.Error:
        return 0
    return total


def p95(values: list[float]) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(0.95 * len(ordered)) - 1))]


def soak(args: argparse.Namespace, data: Path) -> dict[str, Any]:
    """Run the soak against a server started in ``data``; the measurements and the checks."""
    import httpx
    import tinker
    from tinker import types

    warmup = args.warmup if args.warmup is not None else max(2, args.iterations // 20)
    calm_until = max(warmup + 2, args.iterations // 4)  # the flood starts once every tenant did this many
    if calm_until >= args.iterations:
        raise SystemExit(f"--iterations {args.iterations} leaves no flood phase after {calm_until} calm iterations")
    names = [f"t{i}" for i in range(args.tenants)]
    keys = {f"tml-soak-key-{name:0>12}": name for name in [*names, "flood"]}
    key_of = {name: key for key, name in keys.items()}
    server, url = start_server(data, keys, args)
    started = time.monotonic()
    stop = threading.Event()
    flood_on = threading.Event()
    barrier = threading.Barrier(args.tenants + 1)
    lock = threading.Lock()
    done = dict.fromkeys(names, 0)
    at_first_finish: dict[str, int] = {}
    times: dict[str, list[tuple[str, float]]] = {name: [] for name in names}
    lost: list[str] = []
    adapters_seen: list[int] = []
    rss: list[tuple[float, int, str]] = []  # (time, bytes, phase)
    flood_requests = [0]

    def tenant(name: str, seed: int) -> None:
        rng = random.Random(seed)
        try:
            client = tinker.ServiceClient(base_url=url, api_key=key_of[name])
            train = client.create_lora_training_client(base_model=BASE, rank=args.rank, seed=seed).result()
            prompt = types.ModelInput.from_ints([rng.randrange(100, 10000) for _ in range(12)])
            for iteration in range(args.iterations):
                if iteration == calm_until:
                    barrier.wait()
                start = time.monotonic()
                batch = []
                for _ in range(args.datums):
                    tokens = [rng.randrange(100, 10000) for _ in range(args.tokens + 1)]
                    batch.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                             loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * args.tokens}))  # fmt: skip
                train.forward_backward(batch, "cross_entropy").result()
                train.optim_step(types.AdamParams(learning_rate=1e-4)).result()
                sampler = train.save_weights_and_get_sampling_client().result()
                answer = sampler.sample(prompt, num_samples=args.samples,
                                        sampling_params=types.SamplingParams(max_tokens=args.sample_tokens, temperature=1.0)).result()  # fmt: skip
                assert len(answer.sequences) == args.samples
                phase = "warmup" if iteration < warmup else "calm" if iteration < calm_until else "flood"
                with lock:
                    times[name].append((phase, time.monotonic() - start))
                    done[name] += 1
                    if done[name] == args.iterations and not at_first_finish:
                        at_first_finish.update(done)
        except Exception as error:  # noqa: BLE001 - a lost future: counted, reported
            with lock:
                lost.append(f"{name}: {type(error).__name__}: {error}"[:500])
            barrier.abort()

    def flood(index: int) -> None:
        rng = random.Random(1000 + index)
        try:
            client = tinker.ServiceClient(base_url=url, api_key=key_of["flood"])
            sampler = client.create_sampling_client(base_model=BASE).result()
            params = types.SamplingParams(max_tokens=args.max_sample_tokens, temperature=1.0)
            while not stop.is_set():
                prompt = types.ModelInput.from_ints([rng.randrange(100, 10000) for _ in range(args.max_prompt_tokens)])
                sampler.sample(prompt, num_samples=args.max_num_samples, sampling_params=params).result()
                with lock:
                    flood_requests[0] += 1
        except Exception as error:  # noqa: BLE001
            with lock:
                lost.append(f"flood {index}: {type(error).__name__}: {error}"[:500])

    def monitor() -> None:
        while not stop.wait(0.5):
            try:
                answer = httpx.get(f"{url}/api/v1/tracerl/stats", headers={"X-API-Key": key_of[names[0]]}, timeout=10).json()
                adapters_seen.append(int(answer["service"]["sampler_adapters_loaded"]))
                adapters_seen.append(int(answer["service"]["sampler_adapters_in_engine"]))
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            with lock:
                phase = "flood" if flood_on.is_set() else "calm" if all(len(t) >= warmup for t in times.values()) else "warmup"
            rss.append((time.monotonic(), tree_rss(server.pid), phase))

    threads = [threading.Thread(target=tenant, args=(name, i), daemon=True) for i, name in enumerate(names)]
    watcher = threading.Thread(target=monitor, daemon=True)
    floods: list[threading.Thread] = []
    try:
        watcher.start()
        for thread in threads:
            thread.start()
        try:
            barrier.wait()  # every tenant did its calm iterations
            flood_on.set()
            floods = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(args.flood_threads)]
            for thread in floods:
                thread.start()
        except threading.BrokenBarrierError:
            pass
        for thread in threads:
            thread.join()
        stop.set()
        for thread in [*floods, watcher]:
            thread.join(timeout=600)
        stats = httpx.get(f"{url}/api/v1/tracerl/stats", headers={"X-API-Key": key_of[names[0]]}, timeout=30).json()
        usage = {name: httpx.get(f"{url}/api/v1/tracerl/usage", headers={"X-API-Key": key_of[name]}, timeout=30).json()["usage"] for name in [*names, "flood"]}
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    wall = time.monotonic() - started

    statuses: dict[str, int] = {}
    for line in (data / "access.log").read_text().splitlines():
        found = re.search(r" (\d{3}) [\d.]+ms ", line)
        if found:
            statuses[found.group(1)] = statuses.get(found.group(1), 0) + 1
    server_errors = sum(n for code, n in statuses.items() if code.startswith("5"))
    log_errors = len(re.findall(r"tinker operation failed|Traceback", (data / "serve.log").read_text()))

    flood_rss = [(t, b) for t, b, phase in rss if phase == "flood" and b > 0]
    rss_first = rss_last = 0
    if len(flood_rss) >= 5:
        span = flood_rss[-1][0] - flood_rss[0][0]
        rss_first = max(b for t, b in flood_rss if t <= flood_rss[0][0] + span / 5)
        rss_last = max(b for t, b in flood_rss if t >= flood_rss[-1][0] - span / 5)
    calm = [s for name in names for phase, s in times[name] if phase == "calm"]
    flooded = [s for name in names for phase, s in times[name] if phase == "flood"]
    snapshot = at_first_finish or dict(done)
    mean_done = statistics.mean(snapshot.values()) if snapshot else 0.0
    cap = args.max_sampler_adapters
    result = {
        "config": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()} | {"warmup": warmup, "calm_until": calm_until},
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "wall_s": round(wall, 1),
        "iterations_done": done,
        "iterations_done_when_first_finished": snapshot,
        "lost_futures": lost,
        "http_statuses": statuses,
        "server_errors_5xx": server_errors,
        "server_log_errors": log_errors,
        "sampler_adapters_cap": cap,
        "sampler_adapters_max_seen": max(adapters_seen, default=0),
        "sampler_adapters_peak": stats["service"]["sampler_adapters_peak"],
        "sampler_adapter_loads": stats["service"]["sampler_adapter_loads"],
        "sampler_adapter_evictions": stats["service"]["sampler_adapter_evictions"],
        "rss_mb": {"first_fifth_of_flood_peak": round(rss_first / 2**20), "last_fifth_of_flood_peak": round(rss_last / 2**20),
                   "peak": round(max((b for _, b, _ in rss), default=0) / 2**20), "samples": len(rss)},  # fmt: skip
        "iteration_s": {"calm_p50": statistics.median(calm) if calm else None, "calm_p95": p95(calm),
                        "flood_p50": statistics.median(flooded) if flooded else None, "flood_p95": p95(flooded)},  # fmt: skip
        "flood_requests": flood_requests[0],
        "usage": usage,
    }
    result["checks"] = {
        "adapters_within_cap": result["sampler_adapters_max_seen"] <= cap and result["sampler_adapters_peak"] <= cap,
        "no_5xx": server_errors == 0 and log_errors == 0,
        "no_lost_future": not lost and all(n == args.iterations for n in done.values()),
        "rss_within_10pct": bool(rss_first) and rss_last <= 1.10 * rss_first,
        "work_within_20pct": bool(snapshot) and all(abs(n - mean_done) <= 0.2 * mean_done for n in snapshot.values()),
        "flood_p95_within_2x": bool(calm and flooded) and p95(flooded) <= 2 * p95(calm),
    }
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tinker-soak-") as tmp:
        result = soak(args, Path(tmp))
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    failed = [name for name, ok in result["checks"].items() if not ok]
    print("soak:", "every check passed" if not failed else f"FAILED: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
