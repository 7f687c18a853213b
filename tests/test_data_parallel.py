"""Data-parallel GRPO: two torchrun worker processes (gloo) take the step one process takes.

Both start from the same adapter (its ``B`` made non-zero, so every LoRA weight gets a gradient)
and train on the same packed micro-batches; the adapters they write agree to float tolerance.
The tiny random Llama runs in the light suite; SmolLM2-135M (``real_model``) is the acceptance run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tracerl.cluster.data_parallel import shard, train_step_data_parallel
from tracerl.errors import TrajectoryError
from tracerl.train.packing import pack_sequences
from tracerl.train.tokenization import TrainingSequence
from tracerl.train.trainer import LoRASettings, LoRATrainer, StepConfig

LORA = LoRASettings(r=4, alpha=8, target_modules=("q_proj", "v_proj"))
CONFIG = StepConfig(learning_rate=1e-3, max_grad_norm=1.0, max_mismatch_kl=None)  # made-up sampler logprobs


def _micro_batches(vocab: int, *, bad_token: int | None = None) -> list:
    """Eight sequences (prompt weight 0, completion weight 1, advantages of both signs) in ~4 micro-batches."""
    generator = torch.Generator().manual_seed(0)
    sequences = []
    for i in range(8):
        prompt, completion = 6 + i % 3, 4 + i % 4
        ids = torch.randint(3, vocab, (prompt + completion,), generator=generator).tolist()
        old = (-torch.rand(prompt + completion, generator=generator) * 4).tolist()
        sequences.append(TrainingSequence(ids, [0.0] * prompt + [1.0] * completion, old, trajectory_index=i,
                                          group_index=i // 4, advantage=1.0 if i % 2 else -1.0))
    if bad_token is not None:
        sequences[-1].token_ids[-1] = bad_token
    return pack_sequences(sequences, [1.0] * len(sequences), max_tokens=32, share_prefix=False)


def _start_adapter(model_path: Path, out: Path) -> Path:
    trainer = LoRATrainer(model_path, lora=LORA, device="cpu")
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    trainer.save(out, step=0)
    return out


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "adapter_model.safetensors")


def _vocab(model_path: Path) -> int:
    import json

    return json.loads((model_path / "config.json").read_text())["vocab_size"]


@pytest.fixture(params=["tiny-llama", pytest.param("smollm2-135m", marks=pytest.mark.real_model)])
def model_path(request) -> Path:
    return request.getfixturevalue("tiny_llama" if request.param == "tiny-llama" else "smol_path")


def test_two_gloo_workers_give_the_adapter_one_process_gives(model_path, tmp_path):
    start = _start_adapter(model_path, tmp_path / "0000")
    micro_batches = _micro_batches(_vocab(model_path))
    assert len(micro_batches) >= 3  # both ranks get a share
    single = LoRATrainer(model_path, lora=LORA, adapter_path=start, device="cpu")
    one_metrics = single.step(micro_batches, CONFIG)
    single.save(tmp_path / "single", step=1)
    del single
    dp_metrics = train_step_data_parallel(model_path, micro_batches, CONFIG, tmp_path / "dp", workers=2,
                                          adapter_path=start, lora=LORA)
    assert dp_metrics["data_parallel_workers"] == 2.0
    before, one, two = _weights(start), _weights(tmp_path / "single"), _weights(tmp_path / "dp")
    assert one.keys() == two.keys() == before.keys()
    moved = max(float((one[k] - before[k]).abs().max()) for k in one)
    apart = max(float((one[k] - two[k]).abs().max()) for k in one)
    assert moved > 1e-4  # the step changed the adapter ...
    assert apart < 1e-5  # ... the same way in both
    for key in ("loss", "grad_norm", "trained_tokens", "entropy", "ratio_mean"):
        assert dp_metrics[key] == pytest.approx(one_metrics[key], rel=1e-5, abs=1e-7), key
    assert (tmp_path / "dp" / "optimizer.pt").exists()


def test_a_failure_on_one_rank_stops_every_rank_with_nothing_written(tiny_llama, tmp_path):
    vocab = _vocab(tiny_llama)
    micro_batches = _micro_batches(vocab, bad_token=vocab + 5)  # outside the embedding: in one rank's share only
    owners = [r for r in (0, 1) for mb in shard(micro_batches, r, 2) if int(mb.input_ids_BT.max()) >= vocab]
    assert len(owners) == 1
    with pytest.raises(TrajectoryError, match="outside the model's embedding") as caught:  # the step's own error type
        train_step_data_parallel(tiny_llama, micro_batches, CONFIG, tmp_path / "dp", workers=2, lora=LORA, timeout=600)
    assert ("data-parallel rank 1" in str(caught.value)) == (owners == [1])  # rank 0 raised rank 1's error too
    assert not (tmp_path / "dp").exists()


def test_shards_cover_every_micro_batch_once_and_balance_tokens():
    micro_batches = _micro_batches(4096)
    shares = [shard(micro_batches, r, 3) for r in range(3)]
    assert sorted(id(mb) for share in shares for mb in share) == sorted(id(mb) for mb in micro_batches)
    loads = [sum(mb.num_tokens for mb in share) for share in shares]
    assert max(loads) - min(loads) <= max(mb.num_tokens for mb in micro_batches)
