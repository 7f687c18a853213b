"""Tinker's four losses, as the Tinker API defines them: sums over tokens, never means.

``logprobs_T`` are the trainer's logprobs of each datum's ``target_tokens`` (with gradients);
the other inputs are the datum's ``loss_fn_inputs``.  The ratio ``r = exp(logπ − logπ_sampler)``
is clipped to ``[clip_low_threshold, clip_high_threshold]`` (``loss_fn_config``, default 0.8 and
1.2).  PPO and CISPO are the same functions tracerl's GRPO trains with
(:func:`tracerl.train.grpo.policy_loss`), called as a sum (normalizer 1, every token weighted
1, no off-policy correction): one definition of each loss in the code base.

- ``cross_entropy``: ``−Σ logπ(t) · weight(t)``
- ``importance_sampling``: ``−Σ r · A``
- ``ppo``: ``−Σ min(r · A, clip(r) · A)``
- ``cispo``: ``−Σ sg(clip(r)) · logπ · A``
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import ConfigError
from ..train.grpo import LOG_RATIO_CLAMP, LossFn, policy_loss

LOSS_INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
}
"""The ``loss_fn_inputs`` each loss reads (``target_tokens`` is what the logprobs are of)."""

DEFAULT_CLIP = (0.8, 1.2)
CLIP_KEYS = ("clip_low_threshold", "clip_high_threshold")


def clip_bounds(loss_fn: str, config: Mapping[str, Any] | None) -> tuple[float, float]:
    """The ratio bounds of ``loss_fn_config`` (numbers or numeric strings, as the SDK sends them)."""
    config = dict(config or {})
    unknown = set(config) - set(CLIP_KEYS)
    if unknown:
        raise ConfigError(f"loss_fn_config for {loss_fn!r} takes {list(CLIP_KEYS)}, not {sorted(unknown)}")
    bounds = []
    for key, default in zip(CLIP_KEYS, DEFAULT_CLIP):
        try:
            bounds.append(float(config.get(key, default)))
        except (TypeError, ValueError) as error:
            raise ConfigError(f"loss_fn_config[{key!r}] must be a number, got {config[key]!r}") from error
    low, high = bounds
    if not 0.0 <= low <= 1.0 <= high:
        raise ConfigError(f"need 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got {low} and {high}")
    return low, high


def check_loss_fn(loss_fn: str, config: Mapping[str, Any] | None) -> None:
    """A clear error before any work for an unknown loss or bad clip settings."""
    if loss_fn not in LOSS_INPUTS:
        raise ConfigError(f"unknown loss_fn {loss_fn!r}: this server offers {sorted(LOSS_INPUTS)}")
    if loss_fn == "cross_entropy":
        if config:
            raise ConfigError("cross_entropy takes no loss_fn_config")
    else:
        clip_bounds(loss_fn, config)


def tinker_loss(
    loss_fn: str, logprobs_T: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, Any] | None = None
) -> torch.Tensor:
    """The summed loss of one datum (a scalar with gradients through ``logprobs_T``)."""
    check_loss_fn(loss_fn, config)
    if loss_fn == "cross_entropy":
        return -(logprobs_T * inputs["weights"]).sum()
    sampler_T, advantages_T = inputs["logprobs"], inputs["advantages"]
    if loss_fn == "importance_sampling":
        ratio_T = torch.exp((logprobs_T - sampler_T).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        return -(ratio_T * advantages_T).sum()
    low, high = clip_bounds(loss_fn, config)
    return policy_loss(
        logprobs_T,
        sampler_T,
        advantages_T,
        torch.ones_like(logprobs_T),
        loss_fn=LossFn(loss_fn),
        epsilon=1.0 - low,
        epsilon_high=high - 1.0,
        normalizer=1.0,
        off_policy_cap=None,
    ).loss
