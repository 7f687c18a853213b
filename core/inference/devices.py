"""Which device and dtype a model runs in, and whether a GPU has room for it.

One place decides the numeric format so the trainer and the transformers server agree:
fp32 on CPU (bf16 matmuls are 5–40x slower there), bf16 on CUDA (half the memory of fp32 and
the tensor-core path; the LoRA math and logprobs are still done in fp32 where it matters).

The memory check runs before a model is loaded onto a GPU.  Without it a GPU that another
process (a vLLM server, a notebook) already fills fails deep inside ``from_pretrained`` with a
bare ``CUDA out of memory``; with it the error says how much is free, how much is needed and
what to do.  The arithmetic (:func:`check_free_memory`) takes plain numbers so it is tested
without a GPU; :func:`check_cuda_memory` feeds it ``torch.cuda.mem_get_info``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError, InsufficientMemoryError

if TYPE_CHECKING:  # pragma: no cover
    import torch

GIB = 1024**3
TRAIN_OVERHEAD = 1.05
"""The trainer's load needs ≈ weights × this + :data:`FIXED_OVERHEAD_BYTES`: its LoRA, the LoRA's gradients and
AdamW state (16 bytes a LoRA parameter: 1–3% of a bf16 base at rank 8–32).  This checks the load only: a step's
activations, masks and logprob chunks depend on the sequence length, micro-batch and checkpointing, and are
checked with the whole run by the memory plan at ``LocalBackend.register`` (:mod:`tracerl.train.memory_plan`),
which replaced a flat 1.35 × weights that assumed gradient checkpointing."""
SERVE_OVERHEAD = 1.25
"""Transformers-server need ≈ weights × this + fixed: the KV cache of a few dozen short rows."""
FIXED_OVERHEAD_BYTES = 1 * GIB
"""CUDA context, cuBLAS workspaces and the allocator's slack."""


def default_device() -> str:
    """``"cuda"`` when a CUDA GPU is visible, else ``"cpu"``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def release_cached_gpu_memory() -> None:
    """Hand PyTorch's cached, unused CUDA blocks back to the driver (nothing on a CPU).

    Between a training step and waking a vLLM that slept through it on the same GPU: vLLM's
    wake-up re-allocates its weights and KV cache from the driver, which cannot see memory
    PyTorch's caching allocator still holds for the trainer."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def is_cuda(device: "str | torch.device") -> bool:
    return str(device).startswith("cuda")


DTYPES = ("auto", "float32", "bfloat16")
"""The weight formats tracerl trains and serves in (``"auto"``: :func:`dtype_for` the device)."""


def dtype_for(device: "str | torch.device", dtype: "str | torch.dtype | None" = None) -> "torch.dtype":
    """The dtype a model's weights take on ``device``: ``dtype`` when given (a name of :data:`DTYPES`
    or a torch dtype), else bf16 on CUDA and fp32 elsewhere."""
    import torch

    if dtype is not None and dtype != "auto":
        if isinstance(dtype, torch.dtype):
            return dtype
        if dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(map(repr, DTYPES))}, got {dtype!r}")
        return getattr(torch, dtype)
    return torch.bfloat16 if is_cuda(device) else torch.float32


def checkpoint_parameters(model_path: str | os.PathLike[str]) -> int:
    """Number of weights in the safetensors files of ``model_path``, read from their headers only."""
    from safetensors import safe_open

    total = 0
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                shape = handle.get_slice(key).get_shape()
                count = 1
                for size in shape:
                    count *= int(size)
                total += count
    return total


def needed_bytes(parameters: int, dtype_bytes: int, *, overhead: float) -> int:
    """Bytes a model of ``parameters`` weights needs on the GPU (weights × overhead + fixed)."""
    return int(parameters * dtype_bytes * overhead) + FIXED_OVERHEAD_BYTES


def check_free_memory(free_bytes: int, total_bytes: int, need_bytes: int, *, what: str, device: str = "cuda") -> None:
    """Raise :class:`InsufficientMemoryError` explaining the shortfall when ``need_bytes > free_bytes``.

    The message names the device, what is free of what total, what ``what`` needs, how much
    other processes hold, and the ways out (free the GPU, share it by pausing vLLM, a smaller
    model, or the CPU).
    """
    if need_bytes <= free_bytes:
        return
    held = max(total_bytes - free_bytes, 0)
    ways = [
        "stop what holds it (`nvidia-smi` lists the processes)" if held > 0.1 * total_bytes else None,
        "when vLLM serves on the same GPU, lower its `gpu_memory_utilization` (server_options) so the trainer fits beside it",
        "use a smaller base model",
        "or train on the CPU (`LocalBackend(device='cpu')`)",
    ]
    raise InsufficientMemoryError(
        f"{device} has {free_bytes / GIB:.1f} GiB free of {total_bytes / GIB:.1f} GiB "
        f"({held / GIB:.1f} GiB held by other processes or this one); {what} needs about "
        f"{need_bytes / GIB:.1f} GiB. To fix: " + "; ".join(w for w in ways if w),
        free_bytes=free_bytes,
        total_bytes=total_bytes,
        need_bytes=need_bytes,
    )


def check_cuda_memory(device: "str | torch.device", need_bytes: int, *, what: str) -> None:
    """:func:`check_free_memory` with this GPU's numbers (``torch.cuda.mem_get_info``); nothing on CPU."""
    if not is_cuda(device):
        return
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    check_free_memory(int(free), int(total), need_bytes, what=what, device=str(device))


def check_room_for(
    model_path: str | os.PathLike[str],
    device: "str | torch.device",
    *,
    overhead: float,
    what: str,
    dtype: "torch.dtype | None" = None,
) -> None:
    """Before loading ``model_path`` onto a GPU: is there room for its weights in ``dtype``
    (default :func:`dtype_for` ``device``)?  Nothing is checked on CPU."""
    if not is_cuda(device):
        return
    dtype = dtype or dtype_for(device)
    need = needed_bytes(checkpoint_parameters(model_path), dtype.itemsize, overhead=overhead)
    check_cuda_memory(device, need, what=f"{what} ({Path(model_path).name} in {str(dtype).removeprefix('torch.')})")


def nvidia_smi_memory() -> list[tuple[int, int]]:
    """(free, total) bytes of each GPU this process may use, from ``nvidia-smi`` (no CUDA context
    is created here); ``[]`` without ``nvidia-smi``.  Honours a numeric ``CUDA_VISIBLE_DEVICES``."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return []
    command = ["nvidia-smi", "--query-gpu=index,memory.free,memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    mib = 1024 * 1024
    rows = {}
    for line in out.strip().splitlines():
        index, free, total = (part.strip() for part in line.split(","))
        rows[index] = (int(float(free)) * mib, int(float(total)) * mib)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible and all(part.strip().isdigit() for part in visible.split(",")):
        return [rows[i.strip()] for i in visible.split(",") if i.strip() in rows]
    return [rows[i] for i in sorted(rows, key=int)]
