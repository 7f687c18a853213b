"""The trainer computes the distribution each turn was sampled from: its temperature, top-k and top-p.

A turn recorded with ``Choice.sampling`` (what tracerl's servers send) is trained on
``log_softmax(logits / T)`` with the turn's filters applied, the distribution its recorded
logprobs come from; a greedy turn is kept as context and not trained.  Checked on SmolLM2's real
weights against the model's own forward, and the gradient against autograd through that forward.
"""

from __future__ import annotations

import pytest
import torch

import tracerl
from tracerl.train.forward import processed_logits
from tracerl.train.grpo import policy_loss
from tracerl.train.packing import pack_sequences
from tracerl.train.step_config import StepConfig
from tracerl.train.tokenization import TokenizeStats, tokenize_trajectory

PROMPT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def trainer(smol_path):
    from tracerl.train.trainer import LoRASettings, LoRATrainer

    trainer = LoRATrainer(smol_path, device="cpu", lora=LoRASettings(r=4, alpha=8))
    with torch.no_grad():  # a non-zero adapter, so the gradient reaches A as well as B
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(0))
    return trainer


def _turn(tokenizer, text: str, sampling: dict | None) -> tracerl.Trajectory:
    from tracerl.train.tokenization import render_ids

    prompt = render_ids(tokenizer, PROMPT, None, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    choice = tracerl.Choice(message={"role": "assistant", "content": text}, token_ids=ids, prompt_token_ids=prompt,
                            logprobs=None, sampling=sampling)  # fmt: skip
    return tracerl.Trajectory(messages_and_choices=[*PROMPT, choice], reward=1.0)


def _own_logprobs(trainer, sequence, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Each trained token's logprob under the model's own forward, tempered and filtered as sampled."""
    ids = torch.tensor([sequence.token_ids])
    logits = trainer.model(input_ids=ids).logits[0, :-1].float()
    n = len(logits)
    processed = processed_logits(logits, torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p))
    logprobs = torch.log_softmax(processed, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
    trained = torch.tensor(sequence.weights[1:]) > 0
    return logprobs[trained]


def test_a_turn_sampled_at_temperature_0_7_trains_on_the_tempered_distribution(trainer, smol_tokenizer):
    [sequence] = tokenize_trajectory(_turn(smol_tokenizer, "Blue is nice.", {"temperature": 0.7}), smol_tokenizer)
    [batch] = pack_sequences([sequence], [1.0])
    with torch.no_grad():
        ours = trainer.token_logprobs(batch)
        reference = _own_logprobs(trainer, sequence, 0.7)
        untempered = _own_logprobs(trainer, sequence, 1.0)
    assert float((ours - reference).abs().max()) <= 1e-4
    assert float((untempered - reference).abs().max()) > 0.05  # what training at T = 1 would have used

    # the gradient: the GRPO loss through the trainer equals autograd through the model's own tempered forward
    sampler = reference.detach() + 0.01 * torch.arange(len(reference)) % 0.05  # a sampler a little off, so ratios vary
    batch.old_logprobs_N = sampler.float()
    batch.advantages_N = torch.full_like(batch.advantages_N, 0.7)
    config = StepConfig(max_mismatch_kl=None)

    def gradient(logprobs: torch.Tensor) -> list[torch.Tensor]:
        trainer.model.zero_grad(set_to_none=True)
        out = policy_loss(logprobs, batch.old_logprobs_N, batch.advantages_N, batch.weights_N, loss_fn=config.loss_fn)
        out.loss.backward()
        return [p.grad.clone() for p in trainer.params]

    ours_grad = gradient(trainer.forward_token_logprobs(batch)[0])
    reference_grad = gradient(_own_logprobs(trainer, sequence, 0.7))
    trainer.model.zero_grad(set_to_none=True)
    flat = torch.cat([g.flatten() for g in reference_grad])
    difference = torch.cat([(a - b).flatten() for a, b in zip(ours_grad, reference_grad)])
    assert float(flat.norm()) > 0 and float(difference.norm() / flat.norm()) <= 1e-4


@pytest.mark.parametrize("filters", [{"top_p": 0.9}, {"top_k": 20}])
def test_top_p_and_top_k_turns_train_on_the_filtered_distribution(trainer, smol_tokenizer, filters):
    sampling = {"temperature": 0.8, **filters}
    [sequence] = tokenize_trajectory(_turn(smol_tokenizer, "Red.", sampling), smol_tokenizer)
    [batch] = pack_sequences([sequence], [1.0])
    with torch.no_grad():
        ours = trainer.token_logprobs(batch)
        reference = _own_logprobs(trainer, sequence, 0.8, filters.get("top_k", 0), filters.get("top_p", 1.0))
        unfiltered = _own_logprobs(trainer, sequence, 0.8)
    finite = torch.isfinite(reference)
    assert bool(finite.any()) and torch.equal(finite, torch.isfinite(ours))
    assert float((ours[finite] - reference[finite]).abs().max()) <= 1e-4
    assert float((unfiltered[finite] - reference[finite]).abs().max()) > 1e-3  # the filter renormalised something


def test_greedy_turns_are_context_not_trained_and_unknown_sampling_is_counted(smol_tokenizer):
    stats = TokenizeStats()
    greedy = tokenize_trajectory(_turn(smol_tokenizer, "Green.", {"temperature": 0.0}), smol_tokenizer, stats=stats)
    assert greedy == [] and stats.dropped_tokens["greedy"] > 0  # nothing left to train in that trajectory
    tokenize_trajectory(_turn(smol_tokenizer, "Green.", None), smol_tokenizer, stats=stats)
    assert stats.metrics()["turns_without_sampling"] == 1.0
