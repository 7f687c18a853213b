"""What this machine can do right now: dense fp32 matmul GFLOP/s and memory-copy GB/s.

Every benchmark calls :func:`measure_ceiling` in its own invocation, so a figure and the
ceiling it is compared with are measured under the same load (the machine is shared: a
throughput number without the ceiling of that moment cannot be judged).  A benchmark then
reports ``percent_of_matmul(gflops, ceiling)``.

- **matmul**: ``a @ b`` on square fp32 matrices of 1024, 2048 and 3072, best of 3 after one
  warm-up each; 2·n³ FLOPs per product.  The best size is the machine's dense ceiling.
- **copy**: ``dst.copy_(src)`` of a 256 MiB fp32 tensor, best of 3; read + write counted
  (2 × 256 MiB per copy), the figure ``STREAM copy`` reports.

    .venv/bin/python bench/ceiling.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import datetime, timezone
from typing import Any

MATMUL_SIZES = (1024, 2048, 3072)
COPY_MIB = 256


def _best_seconds(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def matmul_gflops(sizes: tuple[int, ...] = MATMUL_SIZES, repeats: int = 3) -> dict[str, float]:
    """Best-of-``repeats`` GFLOP/s of an fp32 square matmul, per size."""
    import torch

    generator = torch.Generator().manual_seed(0)
    result = {}
    with torch.inference_mode():
        for n in sizes:
            a = torch.randn(n, n, generator=generator)
            b = torch.randn(n, n, generator=generator)
            out = torch.empty(n, n)
            torch.matmul(a, b, out=out)  # warm-up: thread pool, page faults
            seconds = _best_seconds(lambda: torch.matmul(a, b, out=out), repeats)
            result[str(n)] = 2 * n**3 / seconds / 1e9
    return result


def copy_gbps(mib: int = COPY_MIB, repeats: int = 3) -> float:
    """Best-of-``repeats`` GB/s of a large tensor copy (bytes read + bytes written)."""
    import torch

    src = torch.ones(mib * 1024 * 1024 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: fault the pages in
    seconds = _best_seconds(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * 4 / seconds / 1e9


def measure_ceiling() -> dict[str, Any]:
    """Both probes plus what they ran under (threads, load average, time); a few seconds."""
    import torch

    load_before = os.getloadavg()
    by_size = matmul_gflops()
    bandwidth = copy_gbps()
    return {
        "matmul_gflops": max(by_size.values()),
        "matmul_gflops_by_size": by_size,
        "copy_gbps": bandwidth,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average_1_5_15": list(load_before),
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
    }


def percent_of_matmul(gflops: float, ceiling: dict[str, Any]) -> float:
    """``gflops`` as a percentage of the ceiling's best dense matmul rate."""
    return 100.0 * gflops / ceiling["matmul_gflops"]


def percent_of_copy(gbps: float, ceiling: dict[str, Any]) -> float:
    return 100.0 * gbps / ceiling["copy_gbps"]


def describe(ceiling: dict[str, Any]) -> str:
    """One line for a benchmark's table header."""
    load = ", ".join(f"{x:.2f}" for x in ceiling["load_average_1_5_15"])
    return (
        f"ceiling at {ceiling['measured_at']}: matmul {ceiling['matmul_gflops']:.1f} GFLOP/s fp32 "
        f"(best of {', '.join(f'{k}²' for k in ceiling['matmul_gflops_by_size'])}), copy {ceiling['copy_gbps']:.1f} GB/s, "
        f"{ceiling['torch_threads']} torch threads, load average {load}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args()
    ceiling = measure_ceiling()
    print(describe(ceiling))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ceiling, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
