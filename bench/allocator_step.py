"""The trainer's step under each C allocator: peak memory and step time, side by side in one run.

Why this exists: PyTorch's CPU tensors come straight from ``malloc``, and a training step frees
thousands of activation-sized tensors; how the allocator treats that freed memory decides how
far the step's peak rises above what it really holds (``tracerl.train.allocator``).

The step is tracerl's own (``pack_sequences`` + ``LoRATrainer.step``, gradient checkpointing on,
as in the demo) on a randomly initialised Llama with SmolLM2-135M's shape (``gpu_check``'s model
folder; random weights time the same matmuls), on the demo's shape: 2 groups x 8 sequences, a
409-token shared prompt and 20-39-token completions (~1,250 computed tokens), LoRA r16/alpha32.
Each allocator runs in its own process (an allocator is chosen at process start), rounds
alternate the sides, and each process takes ``--steps`` steps after one warm-up step.  Peak =
the process's RSS sampled every 20 ms during the timed steps, against its RSS after the first
step (weights touched): the step's own memory.  % of ceiling: 4·P·(forward tokens) FLOPs (the
adapter-only backward does not compute weight gradients of the base; the recompute is not
counted) over the step time, against ``bench/ceiling.py`` measured in this invocation.

    flock /tmp/tracerl-heavy.lock .venv/bin/python bench/allocator_step.py [--rounds 2] [--json bench/results/allocator_step.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
PARAMETERS = 134.5e6

SIDES: dict[str, dict[str, Any]] = {
    "glibc": {"label": "glibc malloc (default)", "jemalloc": False, "mallopt_mmap_mb": 0, "decay": None},
    "glibc-mmap-1mb": {"label": "glibc, M_MMAP_THRESHOLD 1 MB", "jemalloc": False, "mallopt_mmap_mb": 1, "decay": None},
    "jemalloc-decay": {"label": "jemalloc, its default decay (10 s)", "jemalloc": True, "mallopt_mmap_mb": 0, "decay": 10_000},
    "jemalloc": {"label": "jemalloc, decay off in the step (tracerl)", "jemalloc": True, "mallopt_mmap_mb": 0, "decay": None},
}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def worker(side: str, steps: int, folder: Path) -> dict[str, Any]:
    """One allocator's process: warm-up step, then ``steps`` timed steps with RSS sampled."""
    spec = SIDES[side]
    libc = ctypes.CDLL(None)
    if spec["mallopt_mmap_mb"]:
        libc.mallopt(-3, int(spec["mallopt_mmap_mb"] * 2**20))  # M_MMAP_THRESHOLD
    from gpu_check import SMOLLM2_135M, random_words

    from tracerl.train.allocator import active_allocator
    from tracerl.train.grpo import equal_trajectory_weights
    from tracerl.train.packing import pack_sequences
    from tracerl.train.tokenization import TrainingSequence
    from tracerl.train.trainer import LoRASettings, LoRATrainer, StepConfig

    trainer = LoRATrainer(folder, lora=LoRASettings(r=16, alpha=32), device="cpu", gradient_checkpointing=True)
    if spec["decay"] is not None:  # undo tracerl's setting: jemalloc as it comes
        for kind in ("dirty", "muzzy"):
            value = ctypes.c_ssize_t(spec["decay"])
            libc.mallctl(f"arenas.{kind}_decay_ms".encode(), None, None, ctypes.byref(value), ctypes.c_size_t(8))
            libc.mallctl(f"arena.0.{kind}_decay_ms".encode(), None, None, ctypes.byref(value), ctypes.c_size_t(8))
    vocab, prompt_tokens = SMOLLM2_135M["vocab_size"], 409
    sequences = []
    for g in range(2):
        prompt = random_words(prompt_tokens, vocab, seed=1000 + g)
        for i in range(8):
            completion = 20 + (i * 7) % 20
            sequences.append(TrainingSequence(
                token_ids=prompt + random_words(completion, vocab, seed=g * 100 + i),
                weights=[0.0] * prompt_tokens + [1.0] * completion,
                old_logprobs=[float("nan")] * (prompt_tokens + completion),
                trajectory_index=len(sequences), group_index=g, advantage=1.0 if i % 2 == 0 else -1.0,
            ))  # fmt: skip
    weights = equal_trajectory_weights([s.num_trainable for s in sequences])
    config = StepConfig(learning_rate=1e-5)
    trainer.step(pack_sequences(sequences, weights, max_tokens=2048, pad_token_id=0), config)  # warm-up: weights touched
    base = _rss_mb()
    peak, stop = [base], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_mb())
            time.sleep(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    times, metrics = [], {}
    for _ in range(steps):
        started = time.perf_counter()
        metrics = trainer.step(pack_sequences(sequences, weights, max_tokens=2048, pad_token_id=0), config)
        times.append(time.perf_counter() - started)
    stop.set()
    thread.join()
    return {"side": side, "allocator": active_allocator(), "step_s": times, "rss_after_warmup_mb": base,
            "peak_rss_mb": peak[0], "step_peak_above_mb": peak[0] - base, "rss_after_mb": _rss_mb(),
            "forward_tokens": metrics["forward_tokens"]}  # fmt: skip


def run_side(side: str, steps: int, folder: Path, jemalloc: Path | None) -> dict[str, Any]:
    from tracerl.train.allocator import RELAUNCHED

    env = dict(os.environ)
    env[RELAUNCHED] = "1"  # the worker picks its allocator here, not by relaunching
    env.pop("LD_PRELOAD", None)
    if SIDES[side]["jemalloc"]:
        assert jemalloc is not None
        env["LD_PRELOAD"] = str(jemalloc)
    out = subprocess.run([sys.executable, __file__, "--worker", side, "--steps", str(steps), "--folder", str(folder)],
                         env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"{side} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="rounds; each runs every side once, order rotated")
    p.add_argument("--steps", type=int, default=3, help="timed steps per process")
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--json", default="bench/results/allocator_step.json")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, Path(args.folder))))
        return
    from ceiling import describe, measure_ceiling
    from gpu_check import SMOLLM2_135M, write_random_model

    from tracerl.train.allocator import find_jemalloc

    jemalloc = find_jemalloc()
    sides = [s for s in args.sides.split(",") if s]
    if jemalloc is None:
        print("no jemalloc found: its sides are skipped (apt-get install libjemalloc2)")
        sides = [s for s in sides if not SIDES[s]["jemalloc"]]
    folder = Path(tempfile.mkdtemp(prefix="tracerl-allocator-")) / "model"
    write_random_model(SMOLLM2_135M, folder, "cpu")
    ceiling_before = measure_ceiling()
    print(describe(ceiling_before), flush=True)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    for r in range(args.rounds):
        order = sides[r % len(sides):] + sides[: r % len(sides)]
        for side in order:
            result = run_side(side, args.steps, folder, jemalloc)
            runs[side].append(result)
            print(f"  round {r + 1} {side:<16} peak +{result['step_peak_above_mb']:.0f} MB, steps "
                  + " ".join(f"{t:.1f}" for t in result["step_s"]) + " s", flush=True)  # fmt: skip
    ceiling_after = measure_ceiling()
    rate = max(ceiling_before["matmul_gflops"], ceiling_after["matmul_gflops"])
    rows = []
    for side in sides:
        times = [t for run in runs[side] for t in run["step_s"]]
        median = statistics.median(times)
        tokens = runs[side][0]["forward_tokens"]
        rows.append({"side": side, "label": SIDES[side]["label"], "step_s_median": median, "step_s_min": min(times),
                     "step_s_max": max(times), "step_peak_above_mb_median": statistics.median(r["step_peak_above_mb"] for r in runs[side]),
                     "peak_rss_mb_median": statistics.median(r["peak_rss_mb"] for r in runs[side]),
                     "rss_after_mb_median": statistics.median(r["rss_after_mb"] for r in runs[side]),
                     "forward_tokens": tokens, "ceiling_pct": 100 * 4 * PARAMETERS * tokens / median / (rate * 1e9)})  # fmt: skip
    report = {"command": sys.argv, "jemalloc": str(jemalloc) if jemalloc else None, "rounds": args.rounds, "steps": args.steps,
              "ceiling_before": ceiling_before, "ceiling_after": ceiling_after, "rows": rows, "runs": runs}  # fmt: skip
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nceiling {rate:.0f} GFLOP/s; {args.rounds} rounds x {args.steps} steps per side; peak = RSS above the warmed-up process\n")
    print("| allocator | step s (median, min–max) | % of ceiling | step peak above weights | process peak RSS | RSS after the steps |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['label']} | {row['step_s_median']:.2f} ({row['step_s_min']:.2f}–{row['step_s_max']:.2f}) | {row['ceiling_pct']:.1f}% | "
              f"+{row['step_peak_above_mb_median']:.0f} MB | {row['peak_rss_mb_median']:.0f} MB | {row['rss_after_mb_median']:.0f} MB |")  # fmt: skip


if __name__ == "__main__":
    main()
