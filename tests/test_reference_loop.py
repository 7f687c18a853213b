"""The reference loop as an oracle: the real training path computes the plain GRPO loss.

``backend.train`` (advantages, tokenization, equal trajectory weights, prefix-sharing packing
split over several micro-batches, chunked logprobs, ``LoRATrainer.step``) must give the same
loss and the same LoRA gradients as :func:`tracerl.train.reference_loop.reference_loss`, which pads
every trajectory into its own row and takes the full logits.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import tracerl
from tracerl.train.reference_loop import completion_logprobs, group_advantages, main, reference_loss
from tracerl.train.tokenization import render_ids

pytestmark = pytest.mark.real_model

# (question, [(completion, reward), ...]); the last group has no reward variance and must be skipped
GROUPS = [
    (
        "What is the capital of France?",
        [("Paris.", 1.0), ("London is the capital of France.", 0.0), ("It is Paris, its largest city.", 0.7), ("Lyon", 0.2)],
    ),
    ("What is 2 + 3?", [("5", 1.0), ("2 + 3 = 5.", 0.5), ("six", 0.0)]),
    ("Say hi.", [("hi", 0.5), ("Hello there!", 0.5)]),
]
MICRO_BATCH_TOKENS = 64  # small: the first group's shared-prefix row overflows into several micro-batches


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smol_tokenizer):
    """A registered model whose LoRA has random (non-zero) B matrices, and a batch of groups.

    The optimizer's ``step`` is replaced by a snapshot of the gradients: the weights stay fixed,
    and what the trainer would apply can be compared with the reference.
    """
    backend = tracerl.LocalBackend(inference=None, micro_batch_tokens=MICRO_BATCH_TOKENS)
    model = tracerl.TrainableModel("oracle", "tests", "smollm2-135m", base_path=tmp_path_factory.mktemp("runs"))
    torch.manual_seed(0)  # the LoRA A matrices' initialisation
    asyncio.run(model.register(backend))
    trainer = backend._trainer(backend._state(model))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    captured: list[list[torch.Tensor]] = []
    trainer.optimizer.step = lambda *a, **k: captured.append([p.grad.detach().clone() for p in trainer.params])

    tok = smol_tokenizer
    rows = []  # (prompt ids, completion ids, old logprobs, reward, group index)
    for g, (question, members) in enumerate(GROUPS):
        prompt = render_ids(tok, [{"role": "user", "content": question}], None, add_generation_prompt=True)
        for text, reward in members:
            rows.append((prompt, tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id], reward, g))
    # the "sampler" logprobs: the current policy's, shifted by up to ±2 nats so that ratios spread
    # far enough to be clipped on both sides (PPO's 1 ± 0.2 and CISPO's [0, 5])
    with torch.no_grad():
        current = completion_logprobs(trainer.model, [r[0] for r in rows], [r[1] for r in rows])
    old = [(lp + torch.empty(lp.shape).uniform_(-2.0, 2.0, generator=generator)).tolist() for lp in current]

    groups = []
    for g, (question, _) in enumerate(GROUPS):
        trajectories = []
        for (prompt, completion, reward, gi), old_lp in zip(rows, old):
            if gi != g:
                continue
            choice = tracerl.Choice(
                message={"role": "assistant", "content": tok.decode(completion, skip_special_tokens=True)},
                token_ids=completion,
                prompt_token_ids=prompt,
                logprobs=old_lp,
            )
            trajectories.append(tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": question}, choice], reward=reward))
        groups.append(tracerl.TrajectoryGroup(trajectories))
    yield backend, model, trainer, captured, rows, old, groups
    asyncio.run(backend.close())


def reference_batch(rows, old):
    """The reference's own view of the batch: advantages per group, skipped groups left out."""
    batch = []
    for g in range(len(GROUPS)):
        members = [(r, lp) for r, lp in zip(rows, old) if r[3] == g]
        advantages = group_advantages([r[2] for r, _ in members])
        if advantages is not None:
            batch += [(r[0], r[1], lp, a) for (r, lp), a in zip(members, advantages)]
    return [list(column) for column in zip(*batch)]


@pytest.mark.parametrize("loss_fn", ["ppo", "cispo"])
def test_trainer_loss_and_lora_gradients_equal_the_reference(setup, loss_fn):
    backend, model, trainer, captured, rows, old, groups = setup
    prompts, completions, old_B, advantages_B = reference_batch(rows, old)
    assert len(prompts) == 7  # the zero-variance group is skipped

    trainer.model.zero_grad(set_to_none=True)
    expected_loss = reference_loss(trainer.model, prompts, completions, old_B, advantages_B, loss_fn=loss_fn)
    expected_loss.backward()
    expected_grads = [p.grad.detach().clone() for p in trainer.params]
    trainer.model.zero_grad(set_to_none=True)

    captured.clear()
    # clipping a no-op; the sampler logprobs are shifted on purpose, so the mismatch is measured, not refused
    result = asyncio.run(backend.train(model, groups, loss_fn=loss_fn, max_grad_norm=1e9, max_mismatch_kl=None))
    m = result.metrics
    assert m["num_groups_trainable"] == 2 and m["num_micro_batches"] >= 2
    assert m["trained_tokens"] == sum(len(c) for c in completions)
    assert 0 < m["clipped_fraction"] < 1, "the batch should exercise the clipped and the unclipped branch"
    assert len(captured) == 1
    actual_grads = captured[0]

    assert m["loss"] == pytest.approx(float(expected_loss.detach()), rel=1e-4, abs=1e-6)
    # in float64: torch's fp32 norm of these 2.4M numbers is itself off by ~3e-4
    expected_flat = torch.cat([g.flatten() for g in expected_grads]).double()
    actual_flat = torch.cat([g.flatten() for g in actual_grads]).double()
    assert float(expected_flat.norm()) > 0
    relative_error = float((actual_flat - expected_flat).norm() / expected_flat.norm())
    assert relative_error < 1e-4, f"LoRA gradients differ from the reference: relative error {relative_error:.2e}"
    for name, e, a in zip([n for n, p in trainer.model.named_parameters() if p.requires_grad], expected_grads, actual_grads):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4 * float(e.abs().max()) + 1e-12, msg=lambda s, n=name: f"{n}: {s}")
    assert m["grad_norm"] == pytest.approx(float(expected_flat.norm()), rel=1e-4)


def test_the_reference_loop_runs_and_prints_rewards(capsys):
    rewards = main(["--steps", "2", "--groups-per-step", "1", "--group-size", "4", "--max-new-tokens", "6"])
    out = capsys.readouterr().out
    assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards)
    assert "step 1/2  reward" in out and "step 2/2  reward" in out
