"""Trainer memory grows with the packed tokens, not with their square; bf16 makes no fp32 copy of the head.

Peak memory is the process's resident high-water mark (``VmHWM`` in ``/proc/self/status``), reset
just before the step by writing ``5`` to ``/proc/self/clear_refs``, in a fresh child process per
size: it counts everything the step touches (PyTorch's CPU tensors come from ``malloc``, which
``tracemalloc`` does not see), and no earlier size's freed-but-kept memory hides a later one's; glibc's malloc is told to map every block over 128 kB
on its own (``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave the resident set and the mark is what
the step held at once rather than how glibc's heap fragmented.
"Above the weights" is that peak minus the process's resident memory just before the step (the
model, its LoRA and the libraries loaded).  The model is narrow (Llama-shaped, hidden 64, 2 layers,
a 32k vocabulary) so the attention over the packed row, not the weights, is what could grow: with
the dense ``[B, 1, T, T]`` mask of before, 16k packed tokens held a 256 MB boolean mask (and SDPA's
float copy of it) against 4 MB at 2k.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

VOCAB, HIDDEN, LAYERS = 32_000, 64, 2
SHORT, LONG = 2048, 16384


def write_model(folder: Path, dtype: torch.dtype = torch.float32) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LONG,
                         tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(dtype).save_pretrained(folder)
    return folder


def shared_prompt_batch(tokens: int, siblings: int = 4):
    """One packed row of ``tokens``: a shared prompt (a quarter) and ``siblings`` suffixes, the last quarter of each
    trained (what grows with the row is attention; the vocabulary projection is chunked already)."""
    from tracerl.train.packing import pack_sequences
    from tracerl.train.tokenization import TrainingSequence

    generator = torch.Generator().manual_seed(tokens)
    prompt = tokens // 4
    suffix = (tokens - prompt) // siblings
    ids = torch.randint(0, VOCAB, (prompt + siblings * suffix,), generator=generator).tolist()
    sequences = [
        TrainingSequence(ids[:prompt] + ids[prompt + i * suffix : prompt + (i + 1) * suffix],
                         [0.0] * (prompt + suffix - suffix // 4) + [1.0] * (suffix // 4),
                         [float("nan")] * (prompt + suffix), trajectory_index=i, group_index=0, advantage=1.0 - i / 2)  # fmt: skip
        for i in range(siblings)
    ]
    (batch,) = pack_sequences(sequences, [4.0 / suffix] * siblings, max_tokens=tokens)
    assert batch.input_ids_BT.shape == (1, prompt + siblings * suffix)
    return batch


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_above_weights(folder: str, tokens: int) -> dict[str, float]:
    """In this process: load the trainer, take one step on ``tokens`` packed tokens; bytes of peak above the loaded state."""
    from tracerl.train.step_config import StepConfig
    from tracerl.train.trainer import LoRATrainer

    trainer = LoRATrainer(folder, device="cpu")
    batch = shared_prompt_batch(tokens)
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    metrics = trainer.step([batch], StepConfig(learning_rate=1e-4, max_mismatch_kl=None))
    assert metrics["trained_tokens"] > 0.15 * tokens
    return {"above": _status("VmHWM") - before, "before": before}


def _in_child(folder: Path, tokens: int) -> dict[str, float]:
    code = f"import json, tests.test_trainer_memory as t; print(json.dumps(t.peak_above_weights({str(folder)!r}, {tokens})))"
    # glibc's malloc, every block over 128 kB its own mapping returned on free: the high-water mark is what the step
    # held at once, not where glibc's heap happened to fragment (jemalloc, when preloaded, would be another allocator)
    env = {**os.environ, "TRACERL_JEMALLOC": "off", "MALLOC_MMAP_THRESHOLD_": "131072"}
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_peak_memory_grows_with_tokens_not_their_square(tmp_path):
    folder = write_model(tmp_path / "narrow")
    short, long = _in_child(folder, SHORT), _in_child(folder, LONG)
    ratio = long["above"] / short["above"]
    print(f"peak above the loaded state: {short['above'] / 2**20:.0f} MB at {SHORT}, {long['above'] / 2**20:.0f} MB at {LONG} ({ratio:.1f}x)")
    assert ratio <= 9.0, (short, long)


class _HeadCopies(torch.overrides.TorchFunctionMode):
    """Counts the fp32 tensors of the output embedding's shape (either way round) that any torch call returns."""

    def __init__(self, shape: tuple[int, int]) -> None:
        super().__init__()
        self.shapes, self.copies = {shape, shape[::-1]}, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32 and tuple(tensor.shape) in self.shapes:
                self.copies += 1
        return out


def test_bf16_makes_no_fp32_copy_of_the_output_embedding(tmp_path):
    """In bf16 the head projects each logprob chunk in bf16 (the logits, not the head, become fp32):
    no fp32 ``[vocabulary, hidden]`` tensor is made in a micro-batch's forward or its recompute."""
    from tracerl.train.step_config import StepConfig
    from tracerl.train.trainer import LoRATrainer

    trainer = LoRATrainer(write_model(tmp_path / "narrow", torch.bfloat16), device="cpu", dtype=torch.bfloat16)
    head = trainer.model.get_output_embeddings().weight
    assert head.dtype == torch.bfloat16 and tuple(head.shape) == (VOCAB, HIDDEN)
    batch = shared_prompt_batch(512)
    with _HeadCopies(tuple(head.shape)) as seen:
        metrics = trainer.step([batch], StepConfig(learning_rate=1e-4, max_mismatch_kl=None))
    assert metrics["trained_tokens"] > 0 and math.isfinite(metrics["loss"])
    assert seen.copies == 0


@pytest.mark.parametrize("which", ["LoRATrainer", "LoRAPool"])
def test_the_base_model_is_loaded_straight_onto_its_device_in_its_dtype(tmp_path, monkeypatch, which):
    """tracerl's trainer and the Tinker service's both ask transformers for the base on its device and in its dtype
    (``device_map``): an 8B model is never first materialised whole in the CPU's memory and then moved."""
    import transformers

    from tracerl.tinker.lora_pool import LoRAPool
    from tracerl.train.trainer import LoRATrainer

    real = transformers.AutoModelForCausalLM.from_pretrained
    asked: list[dict] = []

    def spy(*args, **kwargs):  # the real loader, with what it was asked for noted
        asked.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    folder = write_model(tmp_path / "narrow", torch.bfloat16)
    loaded = {"LoRATrainer": LoRATrainer, "LoRAPool": LoRAPool}[which](folder, device="cpu", dtype=torch.bfloat16)
    assert [(kw.get("device_map"), kw.get("dtype")) for kw in asked] == [("cpu", torch.bfloat16)]
    base = loaded.model.get_base_model() if which == "LoRATrainer" else loaded.base
    assert {p.dtype for name, p in base.named_parameters() if "lora_" not in name} == {torch.bfloat16}
