"""Device and dtype choice, and the start-up check that explains a GPU with too little free memory."""

from __future__ import annotations

import pytest
import torch

import tracerl
from tracerl.inference.devices import (
    FIXED_OVERHEAD_BYTES,
    GIB,
    TRAIN_OVERHEAD,
    check_free_memory,
    check_room_for,
    checkpoint_parameters,
    dtype_for,
    needed_bytes,
)
from tracerl.errors import InsufficientMemoryError


def test_bf16_on_cuda_fp32_elsewhere():
    assert dtype_for("cuda") is torch.bfloat16
    assert dtype_for("cuda:1") is torch.bfloat16
    assert dtype_for(torch.device("cuda", 0)) is torch.bfloat16
    assert dtype_for("cpu") is torch.float32


def test_enough_free_memory_passes():
    check_free_memory(10 * GIB, 80 * GIB, 9 * GIB, what="the trainer")


def test_too_little_free_memory_is_explained_with_the_numbers():
    with pytest.raises(InsufficientMemoryError) as caught:
        check_free_memory(2 * GIB, 80 * GIB, 5 * GIB, what="the trainer (m in bfloat16)", device="cuda:0")
    error = caught.value
    message = str(error)
    assert "cuda:0 has 2.0 GiB free of 80.0 GiB" in message
    assert "78.0 GiB held by other processes" in message
    assert "the trainer (m in bfloat16) needs about 5.0 GiB" in message
    assert "nvidia-smi" in message and "gpu_memory_utilization" in message and "device='cpu'" in message
    assert (error.free_bytes, error.total_bytes, error.need_bytes) == (2 * GIB, 80 * GIB, 5 * GIB)
    assert isinstance(error, MemoryError) and isinstance(error, tracerl.TracerlError)


def test_an_empty_gpu_that_is_too_small_does_not_blame_other_processes():
    with pytest.raises(InsufficientMemoryError) as caught:
        check_free_memory(int(7.9 * GIB), 8 * GIB, 12 * GIB, what="the trainer")
    assert "nvidia-smi" not in str(caught.value) and "smaller base model" in str(caught.value)


def test_the_need_is_counted_from_the_checkpoint_headers(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, str(tmp_path / "model.safetensors"))
    save_file({"c": torch.zeros(2, 2, 2)}, str(tmp_path / "model-2.safetensors"))
    assert checkpoint_parameters(tmp_path) == 12 + 5 + 8
    assert needed_bytes(10**9, 2, overhead=TRAIN_OVERHEAD) == int(2e9 * TRAIN_OVERHEAD) + FIXED_OVERHEAD_BYTES


def test_nothing_is_checked_on_cpu(tmp_path):
    check_room_for(tmp_path / "absent", "cpu", overhead=TRAIN_OVERHEAD, what="the trainer")  # no file read, no error
