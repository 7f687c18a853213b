"""``LocalBackend.train_sft`` when things go wrong, on a tiny random Llama with SmolLM2's tokenizer.

Faults injected for real: an update that blows the adapter up so the next optimizer step's
loss is non-finite (after an earlier step of the same call was applied), and a disk that
fails while the history row is appended after the checkpoint was committed.
"""

from __future__ import annotations

import json

import pytest
import torch

import tracerl
from sft_helpers import CAPITALS, capital_example
from tracerl.train.sft_config import SFTConfig

QUIET = dict(show_progress=False)


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory, smol_tokenizer):
    """A local base-model folder: a 2-layer random Llama over SmolLM2's vocabulary and chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(smol_tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny-base")
    LlamaForCausalLM(config).save_pretrained(path)
    smol_tokenizer.save_pretrained(path)
    return str(path)


def _data(n: int = 6) -> list[dict]:
    return [capital_example(*c) for c in CAPITALS[:n]]


async def test_a_non_finite_loss_mid_call_leaves_nothing_and_the_next_call_trains(tmp_path, tiny_base):
    model = tracerl.TrainableModel("tiny", "faults", tiny_base, base_path=tmp_path)
    backend = tracerl.LocalBackend(inference=None)
    await model.register(backend)
    before = (model.run_dir.checkpoint_path(0) / "adapter_model.safetensors").read_bytes()
    # step 1 applies an update of ~1e36 to the LoRA (finite weights), step 2's forward overflows
    blow_up = SFTConfig(learning_rate=[1e36, 1e-4, 1e-4], batch_size=2, shuffle=False, **QUIET)
    with pytest.raises(tracerl.NonFiniteError, match=r"SFT loss of micro-batch 1/1 \(optimizer step 2, epoch 1\)"):
        await backend.train_sft(model, _data(), blow_up)
    assert await backend.get_step(model) == 0 and model.run_dir.checkpoint_steps() == [0]
    assert model.history() == []
    assert backend._state(model).trainer is None, "the half-updated trainer is dropped"
    result = await backend.train_sft(model, _data(), SFTConfig(learning_rate=1e-3, batch_size=3, **QUIET))
    assert result.step == 1 and all(torch.isfinite(torch.tensor(list(result.metrics.values()))))
    trainer = backend._state(model).trainer
    assert all(bool(torch.isfinite(p).all()) for p in trainer.params), "reloaded from checkpoint 0, not the blown-up adapter"
    assert (model.run_dir.checkpoint_path(0) / "adapter_model.safetensors").read_bytes() == before
    await backend.close()


async def test_a_failed_history_append_after_the_commit_is_recovered_on_register(tmp_path, tiny_base, monkeypatch):
    model = tracerl.TrainableModel("tiny", "faults", tiny_base, base_path=tmp_path)
    backend = tracerl.LocalBackend(inference=None)
    await model.register(backend)

    def disk_full(self, row):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(tracerl.runs.storage.RunDir, "append_history", disk_full)
        with pytest.raises(OSError, match="No space left"):
            await backend.train_sft(model, _data(4), SFTConfig(learning_rate=1e-3, batch_size=2, **QUIET))
    assert model.run_dir.checkpoint_steps() == [0, 1], "the step was committed before the row"
    assert json.loads((model.run_dir.checkpoint_path(1) / "step.json").read_text())["split"] == "sft"
    await backend.close()
    again = tracerl.TrainableModel("tiny", "faults", tiny_base, base_path=tmp_path)
    other = tracerl.LocalBackend(inference=None)
    await again.register(other)
    [row] = again.history()
    assert row["step"] == 1 and row["recovered"] is True and row["sft/optimizer_steps"] == 2
    result = await other.train_sft(again, _data(4), SFTConfig(learning_rate=1e-3, batch_size=4, **QUIET))
    assert result.step == 2 and [r["step"] for r in again.history()] == [1, 2]
    await other.close()


async def test_arguments_are_checked_before_any_training_step(tmp_path, tiny_base):
    model = tracerl.TrainableModel("tiny", "faults", tiny_base, base_path=tmp_path)
    backend = tracerl.LocalBackend(inference=None)
    await model.register(backend)
    with pytest.raises(tracerl.ConfigError, match="warmup_ratio"):
        await backend.train_sft(model, _data(), {"warmup_ratio": 1.5})
    with pytest.raises(TypeError):
        await backend.train_sft(model, _data(), {"lr": 1e-4})
    with pytest.raises(tracerl.ConfigError, match="config must be an SFTConfig"):
        await backend.train_sft(model, _data(), 1e-4)
    with pytest.raises(tracerl.ConfigError, match="list of 1 values but this call takes 3"):
        await backend.train_sft(model, _data(), SFTConfig(learning_rate=[1e-4], batch_size=2, **QUIET))
    bad = tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, tracerl.Choice(message={"role": "assistant", "content": "a"}, token_ids=[10**9])])
    with pytest.raises(tracerl.TrajectoryError, match="outside the vocabulary"):
        await backend.train_sft(model, [bad], SFTConfig(**QUIET))
    assert await backend.get_step(model) == 0 and model.run_dir.checkpoint_steps() == [0] and model.history() == []
    await backend.close()
