"""Tinker's four losses against their definitions (sums over tokens) and against tracerl's GRPO where they coincide."""

import pytest
import torch
from tracerl.errors import ConfigError
from tracerl.tinker.losses import check_loss_fn, tinker_loss
from tracerl.train.grpo import policy_loss


def inputs(seed=0, n=12):
    g = torch.Generator().manual_seed(seed)
    return {
        "target_tokens": torch.randint(0, 100, (n,), generator=g),
        "weights": torch.rand(n, generator=g).round(),
        "logprobs": -torch.rand(n, generator=g) * 3,
        "advantages": torch.randn(n, generator=g),
    }, -torch.rand(n, generator=g) * 3


def grad_of(loss_fn, logprobs, values, config=None):
    logprobs = logprobs.clone().requires_grad_(True)
    loss = tinker_loss(loss_fn, logprobs, values, config)
    loss.backward()
    return loss.detach(), logprobs.grad


def test_cross_entropy_is_the_weighted_sum_of_negative_logprobs():
    values, lp = inputs()
    loss, grad = grad_of("cross_entropy", lp, values)
    assert torch.allclose(loss, -(lp * values["weights"]).sum())
    assert torch.allclose(grad, -values["weights"])


def test_importance_sampling_is_minus_ratio_times_advantage_summed():
    values, lp = inputs(1)
    loss, grad = grad_of("importance_sampling", lp, values)
    ratio = torch.exp(lp - values["logprobs"])
    assert torch.allclose(loss, -(ratio * values["advantages"]).sum())
    assert torch.allclose(grad, -ratio * values["advantages"])  # d/dlp of exp(lp - lp_s)·A


@pytest.mark.parametrize("config", [None, {"clip_low_threshold": 0.9, "clip_high_threshold": "1.1"}])
def test_ppo_is_the_clipped_surrogate_summed(config):
    values, lp = inputs(2)
    low, high = (0.8, 1.2) if config is None else (0.9, 1.1)
    loss, grad = grad_of("ppo", lp, values, config)
    ratio, a = torch.exp(lp - values["logprobs"]), values["advantages"]
    assert torch.allclose(loss, -torch.minimum(ratio * a, ratio.clamp(low, high) * a).sum())
    unclipped = (ratio * a) <= (ratio.clamp(low, high) * a)
    assert torch.allclose(grad, torch.where(unclipped, -ratio * a, torch.zeros_like(a)))


def test_cispo_keeps_every_tokens_gradient_with_a_stopped_clipped_ratio():
    values, lp = inputs(3)
    loss, grad = grad_of("cispo", lp, values)
    clipped = torch.exp(lp - values["logprobs"]).clamp(0.8, 1.2)
    assert torch.allclose(loss, -(clipped * lp * values["advantages"]).sum())
    assert torch.allclose(grad, -clipped * values["advantages"])


@pytest.mark.parametrize("loss_fn", ["ppo", "cispo"])
def test_ppo_and_cispo_equal_tracerl_grpo_as_a_sum(loss_fn):
    """tracerl's GRPO normalizes by trained tokens: times the token count it is Tinker's sum."""
    values, lp = inputs(4)
    n = lp.numel()
    grpo = policy_loss(lp, values["logprobs"], values["advantages"], torch.ones(n), loss_fn=loss_fn, epsilon=0.2, epsilon_high=0.2, off_policy_cap=None)
    assert torch.allclose(tinker_loss(loss_fn, lp, values), grpo.loss * n)


def test_bad_loss_settings_are_clear_errors():
    with pytest.raises(ConfigError, match="unknown loss_fn 'dpo'"):
        check_loss_fn("dpo", None)
    with pytest.raises(ConfigError, match="takes"):
        check_loss_fn("ppo", {"clip_ratio": 0.2})
    with pytest.raises(ConfigError, match="clip_low_threshold <= 1"):
        check_loss_fn("ppo", {"clip_low_threshold": 1.5})
    with pytest.raises(ConfigError, match="must be a number"):
        check_loss_fn("cispo", {"clip_high_threshold": "wide"})
    with pytest.raises(ConfigError, match="no loss_fn_config"):
        check_loss_fn("cross_entropy", {"clip_low_threshold": 0.8})
