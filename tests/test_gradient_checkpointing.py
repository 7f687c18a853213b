"""Gradient checkpointing (every layer or every n-th) trades step time for memory and changes nothing else: same loss, same adapter."""

from __future__ import annotations

import pytest
import torch

from tracerl.train.grpo import LossFn, equal_trajectory_weights
from tracerl.train.packing import pack_sequences
from tracerl.train.tokenization import TrainingSequence
from tracerl.train.trainer import LoRASettings, LoRATrainer, StepConfig

pytestmark = pytest.mark.real_model


def group_batch() -> list[TrainingSequence]:
    """Four completions of one shared prompt (prefix-shared packing, so the mask is not plain causal)."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (48,), generator=g).tolist()
    return [
        TrainingSequence(
            token_ids=prompt + torch.randint(100, 40000, (16,), generator=g).tolist(),
            weights=[0.0] * 48 + [1.0] * 16,
            old_logprobs=[float("nan")] * 64,
            trajectory_index=i,
            group_index=0,
            advantage=1.0 if i % 2 else -1.0,
        )
        for i in range(4)
    ]


def checkpointed_layers(trainer: LoRATrainer) -> list[bool]:
    return [bool(layer.gradient_checkpointing) for layer in trainer.model.get_base_model().model.layers]


def one_step(smol_path, *, checkpointing: bool | int) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One step from a seeded adapter: its loss, gradient norm and the adapter's gradients."""
    torch.manual_seed(0)  # the same LoRA initialisation on both sides
    trainer = LoRATrainer(smol_path, lora=LoRASettings(r=8), device="cpu", gradient_checkpointing=checkpointing)
    stride = int(checkpointing)
    # really on (every layer, or every n-th: the others keep their activations), or off
    assert checkpointed_layers(trainer) == [bool(stride) and i % stride == 0 for i in range(len(checkpointed_layers(trainer)))]
    sequences = group_batch()
    batches = pack_sequences(sequences, equal_trajectory_weights([s.num_trainable for s in sequences]), max_tokens=1024)
    config = StepConfig(learning_rate=1e-3, loss_fn=LossFn.CISPO, max_grad_norm=1.0)
    # a lora_B of zeros has no gradient through lora_A: give it seeded values so both get one.
    # The gradients of one step are compared, not weights after steps: AdamW's first update is
    # lr * sign(gradient), so an element whose gradient is ~0 moves by ±lr on float noise alone
    # (seen: 3e-4 apart between two identical setups after two steps)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(trainer.model.named_parameters()):
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    grads: dict[str, torch.Tensor] = {}

    def accumulate():  # the trainer's own forward/backward, gradients read before clip and update
        result = trainer._accumulate(batches, config)
        grads.update({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
        return result

    (totals, _, _), grad_norm = trainer.apply_update(accumulate, learning_rate=config.learning_rate, max_grad_norm=config.max_grad_norm)
    return {"loss": totals["loss"], "grad_norm": grad_norm}, grads


@pytest.mark.parametrize("checkpointing", [True, 2])
def test_checkpointing_gives_the_same_step(smol_path, checkpointing: bool | int) -> None:
    plain_metrics, plain = one_step(smol_path, checkpointing=False)
    checkpointed_metrics, checkpointed = one_step(smol_path, checkpointing=checkpointing)
    assert plain_metrics["loss"] == pytest.approx(checkpointed_metrics["loss"], rel=1e-5, abs=1e-7)
    assert plain_metrics["grad_norm"] == pytest.approx(checkpointed_metrics["grad_norm"], rel=1e-4)
    assert plain.keys() == checkpointed.keys() and len(plain) > 0
    for name in plain:
        # recomputed activations sum in another order: an element near zero can differ by float noise
        # (seen up to 5e-6 of the tensor's largest gradient), so the tolerance is scaled by that
        scale = plain[name].abs().max().item()
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-3, atol=1e-4 * scale, msg=name)
