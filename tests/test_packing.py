"""Prefix-sharing packing gives exactly the logprobs of unpacked rows."""

from __future__ import annotations

import pytest
import torch

from tracerl.train.grpo import policy_loss
from tracerl.train.packing import pack_sequences
from tracerl.train.tokenization import TrainingSequence
from tracerl.train.trainer import LoRASettings, LoRATrainer


@pytest.fixture(scope="module")
def tiny_trainer(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(config).save_pretrained(path)
    trainer = LoRATrainer(path, lora=LoRASettings(r=4, alpha=8))
    with torch.no_grad():  # non-zero LoRA B so the adapter matters too
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return trainer


def seq(ids, trained_from, group, traj, adv=1.0):
    weights = [0.0] * trained_from + [1.0] * (len(ids) - trained_from)
    return TrainingSequence(ids, weights, [-1.0] * len(ids), traj, group, adv)


def sequences():
    prompt = [1, 2, 3, 4, 5, 6]
    return [
        seq(prompt + [10, 11, 12], 6, 0, 0),
        seq(prompt + [20, 21], 6, 0, 1, -1.0),
        seq(prompt + [30, 31, 32, 33, 2, 3, 34], 6, 0, 2),  # multi-turn: context tokens inside the suffix
        seq([7, 8, 9, 40, 41], 3, 1, 3),
        seq([7, 8, 9, 50], 3, 1, 4, -1.0),
        seq([9, 9, 60, 61], 2, 2, 5),
    ]


def test_shared_prefix_rows_are_smaller(tiny_trainer):
    shared = pack_sequences(sequences(), [1.0] * 6)
    plain = pack_sequences(sequences(), [1.0] * 6, share_prefix=False)
    assert sum(mb.num_tokens for mb in shared) == 6 + 3 + 2 + 7 + 3 + 2 + 1 + 4
    assert sum(mb.num_tokens for mb in plain) == sum(len(s.token_ids) for s in sequences())
    assert sum(mb.num_trained for mb in shared) == sum(mb.num_trained for mb in plain) == 3 + 2 + 7 + 2 + 1 + 2


@pytest.mark.parametrize("max_tokens", [4096, 12])
def test_packed_logprobs_equal_unpacked(tiny_trainer, max_tokens):
    seqs = sequences()
    shared = pack_sequences(seqs, [1.0] * len(seqs), max_tokens=max_tokens)
    plain = pack_sequences(seqs, [1.0] * len(seqs), share_prefix=False)

    def by_sequence(batches):
        out = {}
        for mb in batches:
            lp = tiny_trainer.token_logprobs(mb)
            for s in mb.sequence_ids_N.unique().tolist():
                out[s] = lp[mb.sequence_ids_N == s]
        return out

    a, b = by_sequence(shared), by_sequence(plain)
    assert a.keys() == b.keys() == set(range(len(seqs)))
    for s in a:
        assert torch.allclose(a[s], b[s], atol=1e-5), s
    # and against a plain causal forward of each sequence on its own
    model = tiny_trainer.model
    with torch.no_grad():
        for s, sq in enumerate(seqs):
            logits = model(input_ids=torch.tensor([sq.token_ids])).logits[0]
            ref = torch.log_softmax(logits, -1)
            trained = [t for t in range(1, len(sq.token_ids)) if sq.weights[t] > 0]
            expected = torch.stack([ref[t - 1, sq.token_ids[t]] for t in trained])
            assert torch.allclose(a[s], expected, atol=1e-5)


def test_sequence_level_ratio_groups_by_sequence_id():
    lp = torch.tensor([-1.0, -2.0, -0.5, -0.5], requires_grad=True)
    old = torch.tensor([-1.5, -2.0, -0.5, -1.0])
    ids = torch.tensor([0, 0, 1, 1])
    out = policy_loss(lp, old, torch.ones(4), torch.ones(4), loss_fn="ppo", epsilon=10, importance_level="sequence", sequence_ids_BT=ids)
    import math

    assert out.ratio_max == pytest.approx(math.exp(0.25), rel=1e-5)
    assert out.ratio_sum == pytest.approx(2 * math.exp(0.25) + 2 * math.exp(0.25), rel=1e-5)


def test_a_step_on_packed_batches_runs(tiny_trainer):
    from tracerl.train.trainer import StepConfig

    seqs = sequences()
    metrics = tiny_trainer.step(pack_sequences(seqs, [1.0] * len(seqs), max_tokens=12), StepConfig(learning_rate=1e-3, loss_fn="ppo", max_mismatch_kl=None))
    assert metrics["trained_tokens"] == 17 and metrics["grad_norm"] > 0 and metrics["num_micro_batches"] > 1
    assert metrics["sampler_trainer_prob_corr"] == metrics["sampler_trainer_prob_corr"]
