"""The memory plan (``tracerl plan``, :mod:`tracerl.train.memory_plan`) against measured peaks of real steps.

For each of three random-weight Llama-shaped models (fp32 on this CPU, the largest 1.1B parameters)
and three sequence lengths: one GRPO step through tracerl's trainer (``pack_sequences`` +
``LoRATrainer.step``) on one packed row of that length, with the plan's settings (LoRA r=8 on the
seven projections, no gradient checkpointing, ``micro_batch_tokens`` = the row).  Each case runs in
its own process: load the trainer, reset the process's high-water mark (``/proc/self/clear_refs``),
take the step, read ``VmHWM``: the peak resident memory of the step, weights included.  The plan's
``trainer_peak`` for the same settings must be within max(15%, 150 MB) of it.

    python bench/plan_check.py --out bench/results/plan_check.json      # ~3 min on 2 cores (make plan-check)
    python bench/plan_check.py --sizes narrow --seqs 2048                 # seconds (tests/test_memory_plan.py)

The workers run on jemalloc when it is found (as ``make demo``), so the peak is what the step holds,
not glibc's fragmentation; ``--allocator glibc`` measures without it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=2048),
    "narrow": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, vocab_size=8192),
    "0.1b": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4, vocab_size=32000),
    "0.4b": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4, vocab_size=32000),
    "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4, vocab_size=32000),
}  # fmt: skip
"""Llama shapes: small ones, and TinyLlama-1.1B's (1.10B parameters)."""
TOLERANCE, FLOOR_MB = 0.15, 150.0


def within(predicted: float, measured: float) -> bool:
    """The acceptance bound: |plan - measured| <= max(15% of measured, 150 MB)."""
    return abs(predicted - measured) <= max(TOLERANCE * measured, FLOOR_MB * 2**20)


def write_model(size: str, folder: Path) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SIZES[size], max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(folder: Path, seq: int) -> dict[str, Any]:
    """One step in this process: the peak resident bytes from just before it to its end."""
    import gc
    import random

    from tracerl.train.allocator import active_allocator, release_freed_memory
    from tracerl.train.packing import pack_sequences
    from tracerl.train.step_config import StepConfig
    from tracerl.train.tokenization import TrainingSequence
    from tracerl.train.trainer import LoRASettings, LoRATrainer

    trainer = LoRATrainer(folder, lora=LoRASettings(r=8), device="cpu")
    vocab = trainer.model.get_input_embeddings().num_embeddings
    rng = random.Random(seq)
    prompt = seq // 4
    sequence = TrainingSequence([rng.randrange(3, vocab) for _ in range(seq)], [0.0] * prompt + [1.0] * (seq - prompt),
                                [float("nan")] * seq, trajectory_index=0, group_index=0, advantage=1.0)  # fmt: skip
    batches = pack_sequences([sequence], [1.0], max_tokens=seq)
    gc.collect()
    release_freed_memory()
    before = _vm("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    started = time.perf_counter()
    metrics = trainer.step(batches, StepConfig(learning_rate=1e-5))
    seconds = time.perf_counter() - started
    return {"rss_before_step": before, "peak": _vm("VmHWM"), "step_s": seconds, "loss": metrics["loss"], "allocator": active_allocator()}


def predict(folder: Path, seq: int) -> dict[str, Any]:
    from tracerl.train.memory_plan import PlanSettings, plan

    result = plan(folder, PlanSettings(device="cpu", gpu_memory_bytes=1 << 50, seq_len=seq, micro_batch_tokens=seq, dtype="float32",
                                       inference=None, lora_rank=8))  # fmt: skip
    return {"predicted_peak": result.trainer_peak, "predicted_resident": result.trainer_resident,
            "parts": {part.name: part.bytes for part in result.parts}}  # fmt: skip


def run_case(folder: Path, seq: int, allocator: str, timeout: float) -> dict[str, Any]:
    env = dict(os.environ)
    if allocator == "jemalloc":
        from tracerl.train.allocator import RELAUNCHED, find_jemalloc

        library = find_jemalloc()
        if library is not None:
            env["LD_PRELOAD"] = ":".join(p for p in (str(library), env.get("LD_PRELOAD", "")) if p)
            env[RELAUNCHED] = "1"
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(folder), "--seqs", str(seq)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"worker for {folder.name} at {seq} tokens exited {proc.returncode}: {proc.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="0.1b,0.4b,1.1b")
    parser.add_argument("--seqs", default="256,512,1024")
    parser.add_argument("--allocator", choices=("jemalloc", "glibc"), default="jemalloc")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--timeout", type=float, default=900.0, help="Seconds a case may take.")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    if args.worker is not None:
        print("RESULT " + json.dumps(measure(args.worker, seqs[0])), flush=True)
        return
    rows = []
    started = time.monotonic()
    for size in args.sizes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"plan-check-{size}-") as tmp:
            folder = Path(tmp) / f"llama-{size}"
            parameters = write_model(size, folder)
            for seq in seqs:
                measured = run_case(folder, seq, args.allocator, args.timeout)
                predicted = predict(folder, seq)
                row = {"size": size, "parameters": parameters, "seq_len": seq, **measured, **predicted}
                row["error"] = (row["predicted_peak"] - row["peak"]) / row["peak"]
                row["within"] = within(row["predicted_peak"], row["peak"])
                rows.append(row)
                print(f"{size:>5} {parameters / 1e9:5.2f}B  T={seq:5d}  measured {row['peak'] / 2**30:6.2f} GiB  "
                      f"plan {row['predicted_peak'] / 2**30:6.2f} GiB  {row['error']:+6.1%}  {'ok' if row['within'] else 'OUTSIDE'}  "
                      f"step {row['step_s']:.0f} s", flush=True)  # fmt: skip
    report = {
        "benchmark": "plan_check", "bound": f"|plan - measured| <= max({TOLERANCE:.0%}, {FLOOR_MB:.0f} MB)",
        "device": "cpu", "dtype": "float32", "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "seconds": time.monotonic() - started, "all_within": all(r["within"] for r in rows), "rows": rows,
    }  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    if not report["all_within"]:
        sys.exit("some predictions are outside the bound")


if __name__ == "__main__":
    main()
