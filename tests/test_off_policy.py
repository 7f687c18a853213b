"""Off-policy correction of turns an older policy sampled (``grpo.policy_loss``, ``policy_lag_BT``).

Fresh tokens (lag 0) get the synchronous loss bit for bit; stale ones get decoupled PPO with
the trainer's own weights as the proximal policy, i.e. a truncated importance weight
``min(π_trainer / π_sampler, cap)`` on ``A · ∇logπ``.  The lag travels from the served model
name on each sampled turn (``Choice.model``) through tokenization and packing.
"""

from __future__ import annotations

import math

import pytest
import torch

import tracerl
from tracerl.errors import ConfigError
from tracerl.train.grpo import LossFn, policy_loss
from tracerl.train.local_backend import PolicyLags
from tracerl.train.packing import pack_sequences
from tracerl.train.tokenization import tokenize_history
from tracerl.validation import check_off_policy_cap


def _batch(seed: int = 0, n: int = 12):
    g = torch.Generator().manual_seed(seed)
    new = (torch.rand(1, n, generator=g) * -3 - 0.1).requires_grad_(True)
    old = new.detach() + torch.randn(1, n, generator=g) * 0.8  # some ratios far outside PPO's clip
    advantages = torch.randn(1, n, generator=g)
    weights = torch.ones(1, n)
    return new, old, advantages, weights


@pytest.mark.parametrize("loss_fn", list(LossFn))
def test_at_lag_zero_the_loss_and_gradient_are_the_synchronous_ones(loss_fn):
    new, old, advantages, weights = _batch()
    sync = policy_loss(new, old, advantages, weights, loss_fn=loss_fn)
    (grad_sync,) = torch.autograd.grad(sync.loss, new)
    lagged = policy_loss(new, old, advantages, weights, loss_fn=loss_fn, policy_lag_BT=torch.zeros(1, 12, dtype=torch.long))
    (grad_lagged,) = torch.autograd.grad(lagged.loss, new)
    assert torch.equal(sync.loss, lagged.loss) and torch.equal(grad_sync, grad_lagged)
    assert lagged.stale_tokens == 0.0 and lagged.ratio_sum == sync.ratio_sum and lagged.clipped == sync.clipped


@pytest.mark.parametrize("loss_fn", list(LossFn))
def test_stale_tokens_get_a_truncated_importance_weight_and_keep_their_gradient(loss_fn):
    new, old, advantages, weights = _batch(1)
    lag = torch.tensor([[0] * 6 + [1] * 6])
    out = policy_loss(new, old, advantages, weights, loss_fn=loss_fn, policy_lag_BT=lag, off_policy_cap=2.0)
    (grad,) = torch.autograd.grad(out.loss, new)
    fresh = policy_loss(new, old, advantages, weights, loss_fn=loss_fn)
    (grad_fresh,) = torch.autograd.grad(fresh.loss, new)
    assert torch.allclose(grad[:, :6], grad_fresh[:, :6])  # fresh tokens: untouched
    behaviour = torch.exp(new.detach() - old)[:, 6:]
    expected = -(behaviour.clamp(max=2.0) * advantages[:, 6:]) / 12  # w · A · ∇logπ, over the step's tokens
    assert torch.allclose(grad[:, 6:], expected, atol=1e-6)
    assert (grad[:, 6:] != 0).all()  # none zeroed by a clip to the sampler
    assert out.stale_tokens == 6.0
    assert math.isclose(out.off_policy_ratio_max, float(behaviour.max()), rel_tol=1e-6)
    assert out.off_policy_truncated == float((behaviour > 2.0).sum()) > 0


def test_no_cap_means_no_correction_and_a_cap_below_one_is_refused():
    new, old, advantages, weights = _batch(2)
    lag = torch.ones(1, 12, dtype=torch.long)
    off = policy_loss(new, old, advantages, weights, loss_fn="ppo", policy_lag_BT=lag, off_policy_cap=None)
    plain = policy_loss(new, old, advantages, weights, loss_fn="ppo")
    assert torch.equal(off.loss, plain.loss) and off.stale_tokens == 0.0
    for bad in (0.5, float("inf"), "2"):
        with pytest.raises(ConfigError, match="off_policy_cap"):
            check_off_policy_cap(bad)
    check_off_policy_cap(None)


def test_the_served_name_of_each_turn_becomes_its_lag_through_tokenization_and_packing():
    model = tracerl.TrainableModel("agent", "tests", "smollm2-135m")
    assert model.policy_step("agent@3") == 3
    assert [model.policy_step(name) for name in ("other@3", "agent", "agent@x", None, "smollm2-135m")] == [None] * 5

    def turn(ids: list[int], served: str | None) -> tracerl.Choice:
        return tracerl.Choice(
            message={"role": "assistant", "content": "x"}, token_ids=ids, logprobs=[-1.0] * len(ids),
            prompt_token_ids=[1, 2] if ids == [5, 6] else [1, 2, 5, 6, 7], model=served,
        )  # fmt: skip

    history = tracerl.Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "a"}, turn([5, 6], "agent@1"), {"role": "user", "content": "b"}, turn([8, 9], "agent@3"),
        ]
    )  # fmt: skip
    lags = PolicyLags(model, trained_from=3)
    (sequence,) = tokenize_history(history, tokenizer=None, policy_lag=lags)  # type: ignore[arg-type]  # ids are given
    assert sequence.token_ids == [1, 2, 5, 6, 7, 8, 9]
    assert sequence.policy_lags == [0, 0, 2, 2, 0, 0, 0]
    assert lags.metrics() == {"stale_turns": 1.0, "policy_lag_max": 2.0}
    (batch,) = pack_sequences([sequence], [1.0], max_tokens=64, pad_token_id=0)
    assert batch.policy_lag_N is not None and batch.policy_lag_N.tolist() == [2, 2, 0, 0]
    fresh = PolicyLags(model, trained_from=1)
    (on_policy,) = tokenize_history(history, tokenizer=None, policy_lag=fresh)  # type: ignore[arg-type]
    assert on_policy.policy_lags is None  # a newer policy than the trained one (a straggler's future) is not "stale"


def test_a_choice_from_the_openai_sdk_carries_the_served_name():
    from openai.types.chat import ChatCompletion

    completion = ChatCompletion.model_validate(
        {
            "id": "c", "object": "chat.completion", "created": 0, "model": "agent@4",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}],
        }
    )  # fmt: skip
    assert tracerl.Choice.from_openai(completion.choices[0], completion).model == "agent@4"
