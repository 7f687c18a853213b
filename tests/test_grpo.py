"""GRPO math against hand-computed references, plus invariance properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tracerl.train.grpo import (
    LossFn,
    equal_trajectory_weights,
    group_advantages,
    policy_loss,
    probability_correlation,
)

rewards_st = st.lists(st.floats(-10, 10, allow_nan=False), min_size=2, max_size=8)


def test_advantages_hand_computed():
    adv, ok = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert ok
    # mean 0.5, population std 0.5 -> ±1 (up to the 1e-6 epsilon)
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], rel=1e-5)
    unscaled, _ = group_advantages([3.0, 1.0], scale_rewards=False)
    assert unscaled == [1.0, -1.0]


@pytest.mark.parametrize("rewards", [[0.5, 0.5, 0.5], [1.0], [2.0, 2.0 + 1e-14]])
def test_zero_variance_groups_are_skipped(rewards):
    adv, ok = group_advantages(rewards)
    assert not ok and adv == [0.0] * len(rewards)


@given(rewards_st, st.floats(-100, 100, allow_nan=False))
@settings(max_examples=60, deadline=None)
def test_reward_shift_leaves_advantages_unchanged(rewards, shift):
    a, ok_a = group_advantages(rewards)
    b, ok_b = group_advantages([r + shift for r in rewards])
    if ok_a and ok_b:
        assert b == pytest.approx(a, abs=1e-5)


@given(rewards_st)
@settings(max_examples=60, deadline=None)
def test_duplicating_a_group_leaves_advantages_unchanged(rewards):
    a, ok = group_advantages(rewards)
    b, _ = group_advantages(rewards + rewards)
    if ok:
        assert b[: len(rewards)] == pytest.approx(a, abs=1e-9)


def test_equal_trajectory_weights():
    w = equal_trajectory_weights([2, 6, 0])
    # each trajectory's tokens sum to the same total, mean weight over tokens is 1
    assert 2 * w[0] == pytest.approx(6 * w[1])
    assert (2 * w[0] + 6 * w[1]) / 8 == pytest.approx(1.0)
    assert w[2] == 0.0


def _inputs():
    new = torch.tensor([[-1.0, -0.5, -2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.2, -0.5, -1.0, float("nan")]])
    adv = torch.tensor([[1.0, 1.0, -1.0, 0.0]])
    w = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    return new, old, adv, w


def test_ppo_loss_hand_computed():
    new, old, adv, w = _inputs()
    out = policy_loss(new, old, adv, w, loss_fn="ppo", epsilon=0.2)
    r = [math.exp(0.2), 1.0, math.exp(-1.0)]
    # token 0: A=+1, ratio 1.2214 > 1.2 -> clipped to 1.2; token 1: ratio 1; token 2: A=-1, ratio .368 < .8:
    # -min(r*A, clip*A) = -min(-.368, -.8) = .8
    expected = (-1.2 + -1.0 + 0.8) / 3
    assert out.loss.detach().item() == pytest.approx(expected, rel=1e-5)
    assert out.clipped == 2 and out.tokens == 3
    assert out.ratio_max == pytest.approx(r[0], rel=1e-5)
    out.loss.backward()
    # clipped tokens get no gradient; the unclipped one gets -A*ratio/3
    assert new.grad[0].tolist() == pytest.approx([0.0, -1.0 / 3, 0.0, 0.0], abs=1e-6)


def test_cispo_loss_hand_computed():
    new, old, adv, w = _inputs()
    out = policy_loss(new, old, adv, w, loss_fn="cispo", epsilon=0.1, epsilon_high=0.1)
    clip = [1.1, 1.0, 0.9]  # ratios 1.2214, 1, 0.368 clipped to [0.9, 1.1]
    expected = (-clip[0] * 1 * -1.0 + -clip[1] * 1 * -0.5 + -clip[2] * -1 * -2.0) / 3
    assert out.loss.detach().item() == pytest.approx(expected, rel=1e-5)
    out.loss.backward()
    # gradient flows through every trained token: d/dℓ = -sg(clip)·A / N
    assert new.grad[0].tolist() == pytest.approx([-1.1 / 3, -1.0 / 3, 0.9 / 3, 0.0], abs=1e-6)


def test_sequence_level_ratio_uses_mean_log_ratio():
    new, old, adv, w = _inputs()
    out = policy_loss(new, old, adv, w, loss_fn="ppo", epsilon=10.0, importance_level="sequence")
    seq_ratio = math.exp((0.2 + 0.0 - 1.0) / 3)
    assert out.ratio_max == pytest.approx(seq_ratio, rel=1e-5)
    expected = (-seq_ratio - seq_ratio + seq_ratio) / 3
    assert out.loss.detach().item() == pytest.approx(expected, rel=1e-5)


def test_missing_old_logprobs_mean_ratio_one():
    new = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.full((1, 2), float("nan"))
    out = policy_loss(new, old, torch.ones(1, 2), torch.ones(1, 2), loss_fn="ppo")
    assert out.ratio_max == pytest.approx(1.0)
    assert out.loss.detach().item() == pytest.approx(-1.0)


def test_kl_penalty_is_k3_estimator():
    new = torch.tensor([[-1.0]], requires_grad=True)
    ref = torch.tensor([[-1.5]])
    out = policy_loss(new, new.detach(), torch.zeros(1, 1), torch.ones(1, 1), loss_fn="ppo", ref_logprobs_BT=ref, kl_penalty_coef=0.5)
    d = -0.5
    assert out.loss.detach().item() == pytest.approx(0.5 * (math.exp(d) - d - 1))


def test_normalizer_makes_micro_batches_add_up():
    torch.manual_seed(0)
    new = torch.randn(4, 5)
    old = new + 0.05 * torch.randn(4, 5)
    adv = torch.randn(4, 1).expand(4, 5)
    w = (torch.rand(4, 5) > 0.3).float()
    full = policy_loss(new, old, adv, w, loss_fn="ppo").loss
    n = float((w > 0).sum())
    parts = sum(policy_loss(new[i : i + 2], old[i : i + 2], adv[i : i + 2], w[i : i + 2], loss_fn="ppo", normalizer=n).loss for i in (0, 2))
    assert float(parts) == pytest.approx(float(full), rel=1e-6)


@given(st.lists(st.integers(1, 6), min_size=2, max_size=4), st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
def test_duplicating_every_trajectory_leaves_the_loss_unchanged(lengths, seed):
    """Equal trajectory weighting: a group and the same group twice give the same loss and gradient."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(len(lengths), generator=g).tolist()
    adv, ok = group_advantages(rewards)
    if not ok:
        return
    T = max(lengths)

    def loss_for(copies: int):
        rows = [i for i in range(len(lengths)) for _ in range(copies)]
        weights = equal_trajectory_weights([lengths[i] for i in rows])
        w = torch.zeros(len(rows), T)
        a = torch.zeros(len(rows), T)
        for r, i in enumerate(rows):
            w[r, : lengths[i]] = weights[r]
            a[r, :] = adv[i]
        base = torch.linspace(-2, -0.1, T)
        new = base.repeat(len(rows), 1).clone().requires_grad_(True)
        out = policy_loss(new, torch.full_like(new, float("nan")), a, w, loss_fn="cispo")
        return out.loss.detach().item()

    assert loss_for(2) == pytest.approx(loss_for(1), rel=1e-5, abs=1e-7)


def test_chunked_logprobs_match_full_softmax_and_gradients():
    """The forward route's chunks (each recomputed in backward) give the full softmax's logprobs,
    entropies and gradients, through the model's output module and its temperature."""
    from types import SimpleNamespace

    from tracerl.train.forward import PolicyForward, Sampling

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    model = SimpleNamespace(config=SimpleNamespace(), get_output_embeddings=lambda: head)
    forward = PolicyForward(model, implementation="sdpa", device="cpu", dtype=torch.float32, chunk_size=3)
    hidden = torch.randn(14, 16, requires_grad=True)
    targets = torch.randint(0, 50, (14,))
    temperature = torch.full((14,), 0.7)
    lp, ent = forward.logprobs_of(hidden, targets, Sampling(temperature))
    logits = head(hidden) / 0.7
    ref = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    assert torch.allclose(lp, ref, atol=1e-5)
    p = torch.softmax(logits, -1)
    assert torch.allclose(ent, -(p * torch.log_softmax(logits, -1)).sum(-1), atol=1e-4)
    lp.sum().backward()
    g_chunked = hidden.grad.clone()
    hidden.grad = None
    ref.sum().backward()
    assert torch.allclose(g_chunked, hidden.grad, atol=1e-5)


def test_probability_correlation():
    a = torch.tensor([-0.1, -1.0, -3.0, float("nan")])
    assert probability_correlation(a, a) == pytest.approx(1.0)
    assert probability_correlation(a, torch.tensor([-3.0, -1.0, -0.1, 0.0])) < 0


def test_loss_fn_values():
    assert LossFn("cispo") is LossFn.CISPO
    with pytest.raises(ValueError):
        LossFn("grpo-magic")


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_mismatch_correction_weights_fresh_tokens_by_their_sampler_ratio(correction):
    """TIS: each fresh token's term to the trainer's own pre-update policy, weighted by
    min(π_trainer / π_sampler, cap); MIS: weighted by that ratio inside [1/cap, cap], dropped outside."""
    logprobs = torch.tensor([-1.0, -2.0, -0.5, -3.0], requires_grad=True)
    sampler = torch.tensor([-1.1, -0.5, -0.5, float("nan")])  # ratios e^0.1, e^-1.5 (out of band), 1, unknown
    advantages = torch.tensor([1.0, -1.0, 0.5, 2.0])
    weights = torch.ones(4)
    out = policy_loss(logprobs, sampler, advantages, weights, loss_fn="cispo", mismatch_correction=correction, mismatch_cap=2.0)
    ratio = torch.exp(logprobs.detach() - torch.tensor([-1.1, -0.5, -0.5, -3.0]))
    if correction == "tis":
        weight = ratio.clamp(max=2.0)
    else:
        weight = torch.where((ratio <= 2.0) & (ratio >= 0.5), ratio, torch.zeros_like(ratio))
        assert out.mismatch_masked == 1.0
    expected = (-advantages * logprobs.detach() * weight).sum() / 4
    assert float(out.loss) == pytest.approx(float(expected), rel=1e-6)
    out.loss.backward()
    assert torch.allclose(logprobs.grad, -advantages * weight / 4)
    assert out.clipped == 0.0  # the clipped ratio is to the proximal policy: 1
