"""GRPO as pure math: advantages, token weights, losses. No I/O, no model (the logprobs come from
:mod:`tracerl.train.forward`).

Shape suffixes: ``_G`` members of a group, ``_B`` rows of a batch, ``_T`` tokens,
``_H`` hidden size, ``_V`` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Sequence

import torch

from ..validation import DEFAULT_OFF_POLICY_CAP

LOG_RATIO_CLAMP = 20.0
ZERO_VARIANCE_TOL = 1e-12


class LossFn(str, Enum):
    """Policy-gradient loss variants."""

    PPO = "ppo"
    """PPO clip: ``-min(ρA, clip(ρ, 1-ε, 1+ε_high) A)``."""
    CISPO = "cispo"
    """CISPO: ``-sg(clip(ρ, 1-ε, 1+ε_high)) · A · logπ`` — every token keeps a gradient."""


class ImportanceLevel(str, Enum):
    TOKEN = "token"
    SEQUENCE = "sequence"
    """GSPO: one ratio per row, ``exp(mean over its trained tokens of (ℓ_new − ℓ_old))``."""


DEFAULT_EPSILON = {LossFn.PPO: (0.2, 0.2), LossFn.CISPO: (1.0, 4.0)}


def group_advantages(rewards_G: Sequence[float], *, scale_rewards: bool = True, std_eps: float = 1e-6) -> tuple[list[float], bool]:
    """Mean-centred (and std-scaled) advantages of one group, and whether the group is trainable.

    A group whose rewards are all equal (within ``ZERO_VARIANCE_TOL``) or that has a single
    member carries no signal: its advantages are zero and it is reported untrainable.
    """
    rewards = torch.tensor(list(rewards_G), dtype=torch.float64)
    if rewards.numel() < 2 or float(rewards.max() - rewards.min()) <= ZERO_VARIANCE_TOL:
        return [0.0] * rewards.numel(), False
    centred = rewards - rewards.mean()
    if scale_rewards:
        centred = centred / (rewards.std(unbiased=False) + std_eps)
    return centred.tolist(), True


def equal_trajectory_weights(trainable_tokens_per_trajectory: Sequence[int]) -> list[float]:
    """Per-token weight for each trajectory so every trajectory counts the same.

    Token weight ``∝ 1 / (trainable tokens of its trajectory)``, renormalised to mean 1
    over all trainable tokens of the batch; the loss is then ``Σ w·loss / N_tokens``,
    i.e. the mean over trajectories of each trajectory's mean token loss.
    """
    counts = [int(n) for n in trainable_tokens_per_trajectory]
    total_tokens = sum(counts)
    present = sum(1 for n in counts if n > 0)
    if total_tokens == 0:
        return [0.0] * len(counts)
    return [total_tokens / (present * n) if n > 0 else 0.0 for n in counts]


@dataclass
class LossOutput:
    loss: torch.Tensor
    """Sum over tokens of weighted loss divided by ``normalizer``: add micro-batches up as they come."""
    ratio_sum: float
    ratio_max: float
    clipped: float
    tokens: float
    kl_sum: float
    non_finite_BT: torch.Tensor | None = None
    """Trained tokens whose loss is NaN or infinite (to name the sequences behind a non-finite loss)."""
    stale_tokens: float = 0.0
    """Trained tokens an older policy sampled (``policy_lag_BT > 0``), corrected off-policy."""
    off_policy_ratio_sum: float = 0.0
    off_policy_ratio_max: float = 0.0
    off_policy_truncated: float = 0.0
    """Stale tokens whose importance weight ``π_trainer / π_sampler`` was above the cap."""
    mismatch_masked: float = 0.0
    """Fresh tokens dropped by ``mismatch_correction="mis"`` (ratio outside the band)."""


def policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    weights_BT: torch.Tensor,
    *,
    loss_fn: LossFn | str = LossFn.CISPO,
    epsilon: float | None = None,
    epsilon_high: float | None = None,
    importance_level: ImportanceLevel | str = ImportanceLevel.TOKEN,
    normalizer: float | None = None,
    ref_logprobs_BT: torch.Tensor | None = None,
    kl_penalty_coef: float = 0.0,
    sequence_ids_BT: torch.Tensor | None = None,
    policy_lag_BT: torch.Tensor | None = None,
    off_policy_cap: float | None = DEFAULT_OFF_POLICY_CAP,
    mismatch_correction: str = "none",
    mismatch_cap: float = 2.0,
) -> LossOutput:
    """The GRPO policy loss on trained tokens (``weights_BT > 0``).

    ``old_logprobs_BT`` holds the sampler's logprobs; NaN where unknown, in which case the
    ratio is 1 for that token.  ``normalizer`` is the number of trained tokens of the
    *whole* step (so micro-batch losses add up to the full-batch loss).  For sequence-level
    ratios, a sequence is a row, or the tokens sharing an id in ``sequence_ids_BT``.

    Off-policy correction (``policy_lag_BT``: how many steps older than the trained
    checkpoint the policy that sampled each token is).  Tokens with lag 0 get exactly the loss
    above.  A stale token gets decoupled PPO (Hilton et al. 2022; AReaL): the clipped ratio
    is taken to a *proximal* policy, the trainer's weights at the start of this step, and the
    whole term is weighted by ``min(π_proximal / π_sampler, off_policy_cap)``, a truncated
    importance weight.  Each ``backend.train`` call takes one optimizer step, so the proximal
    logprobs are this forward pass's own, detached: no extra forward pass, and the clipped
    ratio is 1 (the term's gradient is ``w · A · ∇logπ``).  Plain PPO/CISPO on a stale token
    would instead clip to the sampler: a ratio already outside ``[1-ε, 1+ε]`` after a step
    or two zeroes the token's gradient (PPO) or biases it (CISPO's truncation).
    ``off_policy_cap=None`` turns the correction off (stale tokens are treated as fresh).

    Train–inference mismatch on the fresh tokens (:mod:`tracerl.train.step_config`):
    ``mismatch_correction="tis"`` gives them the same decoupled loss, weighted by
    ``min(π_trainer / π_sampler, mismatch_cap)``; ``"mis"`` weights them by that ratio inside
    ``[1/mismatch_cap, mismatch_cap]`` and drops the others; ``"none"`` leaves them as above.
    """
    loss_fn = LossFn(loss_fn)
    level = ImportanceLevel(importance_level)
    default_low, default_high = DEFAULT_EPSILON[loss_fn]
    eps_low = default_low if epsilon is None else epsilon
    if epsilon_high is not None:
        eps_high = epsilon_high
    elif epsilon is not None and loss_fn is LossFn.PPO:
        eps_high = epsilon  # PPO's clip is symmetric unless told otherwise
    else:
        eps_high = default_high
    mask_BT = weights_BT > 0
    old = torch.where(torch.isnan(old_logprobs_BT), logprobs_BT.detach(), old_logprobs_BT)
    log_ratio = (logprobs_BT - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    stale_BT = None
    if policy_lag_BT is not None and off_policy_cap is not None:
        stale_BT = (policy_lag_BT > 0) & mask_BT
        if not bool(stale_BT.any()):
            stale_BT = None
    fresh_BT = None
    if mismatch_correction != "none":
        fresh_BT = mask_BT & ~torch.isnan(old_logprobs_BT)
        if stale_BT is not None:
            fresh_BT = fresh_BT & ~stale_BT
    decoupled_BT = stale_BT if fresh_BT is None else (fresh_BT if stale_BT is None else stale_BT | fresh_BT)
    if decoupled_BT is not None:
        log_ratio = torch.where(decoupled_BT, logprobs_BT - logprobs_BT.detach(), log_ratio)  # to the proximal policy
    if level is ImportanceLevel.SEQUENCE:
        log_ratio = _sequence_mean(log_ratio, mask_BT, sequence_ids_BT)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    if loss_fn is LossFn.PPO:
        per_token = -torch.minimum(ratio * advantages_BT, clipped_ratio * advantages_BT)
        is_clipped = ((advantages_BT > 0) & (ratio > 1.0 + eps_high)) | ((advantages_BT < 0) & (ratio < 1.0 - eps_low))
    else:
        per_token = -clipped_ratio.detach() * advantages_BT * logprobs_BT
        is_clipped = (ratio > 1.0 + eps_high) | (ratio < 1.0 - eps_low)
    off_policy = {}
    behaviour_ratio = torch.exp((logprobs_BT.detach() - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    mismatch_masked = 0.0
    if fresh_BT is not None:
        if mismatch_correction == "tis":
            fresh_weight = behaviour_ratio.clamp(max=mismatch_cap)
        else:
            in_band = (behaviour_ratio <= mismatch_cap) & (behaviour_ratio >= 1.0 / mismatch_cap)
            fresh_weight = torch.where(in_band, behaviour_ratio, torch.zeros_like(behaviour_ratio))
            mismatch_masked = float((fresh_BT & ~in_band).sum())
        per_token = per_token * torch.where(fresh_BT, fresh_weight, 1.0)
    if stale_BT is not None:
        per_token = per_token * torch.where(stale_BT, behaviour_ratio.clamp(max=off_policy_cap), 1.0)
        stale_ratio = behaviour_ratio[stale_BT]
        off_policy = dict(
            stale_tokens=float(stale_BT.sum()),
            off_policy_ratio_sum=float(stale_ratio.sum()),
            off_policy_ratio_max=float(stale_ratio.max()),
            off_policy_truncated=float((stale_ratio > off_policy_cap).sum()),
        )
    kl_sum = 0.0
    if ref_logprobs_BT is not None and kl_penalty_coef:
        # k3 estimator of KL(π || π_ref): exp(ref − new) − (ref − new) − 1  (≥ 0, unbiased)
        diff = ref_logprobs_BT - logprobs_BT
        kl = torch.exp(diff) - diff - 1.0
        per_token = per_token + kl_penalty_coef * kl
        kl_sum = float((kl.detach() * mask_BT).sum())
    n = float(mask_BT.sum()) if normalizer is None else float(normalizer)
    loss = (per_token * weights_BT).sum() / max(n, 1.0)
    masked_ratio = ratio.detach()[mask_BT]
    return LossOutput(
        loss=loss,
        ratio_sum=float(masked_ratio.sum()) if masked_ratio.numel() else 0.0,
        ratio_max=float(masked_ratio.max()) if masked_ratio.numel() else 0.0,
        clipped=float((is_clipped & mask_BT).sum()),
        tokens=float(mask_BT.sum()),
        kl_sum=kl_sum,
        non_finite_BT=~torch.isfinite(per_token.detach()) & mask_BT,
        mismatch_masked=mismatch_masked,
        **off_policy,
    )


def _sequence_mean(values: torch.Tensor, mask: torch.Tensor, sequence_ids: torch.Tensor | None) -> torch.Tensor:
    """Each token's value replaced by the mean over the trained tokens of its sequence."""
    if sequence_ids is None:
        counts = mask.sum(dim=-1, keepdim=True).clamp(min=1)
        return ((values * mask).sum(dim=-1, keepdim=True) / counts).expand_as(values)
    ids = sequence_ids.reshape(-1)
    flat, flat_mask = values.reshape(-1), mask.reshape(-1).to(values.dtype)
    size = int(ids.max()) + 1 if ids.numel() else 0
    sums = torch.zeros(size, dtype=values.dtype, device=values.device).index_add(0, ids, flat * flat_mask)
    counts = torch.zeros(size, dtype=values.dtype, device=values.device).index_add(0, ids, flat_mask).clamp(min=1)
    return (sums / counts)[ids].reshape(values.shape)


def probability_correlation(sampler_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor) -> float:
    """Pearson correlation of token probabilities (sampler vs trainer); NaN-safe, 1.0 if constant."""
    valid = ~(torch.isnan(sampler_logprobs) | torch.isnan(trainer_logprobs))
    a = sampler_logprobs[valid].double().exp()
    b = trainer_logprobs[valid].double().exp()
    if a.numel() < 2:
        return float("nan")
    a, b = a - a.mean(), b - b.mean()
    denom = float(a.norm() * b.norm())
    if denom == 0.0:
        return 1.0 if torch.allclose(sampler_logprobs[valid], trainer_logprobs[valid], atol=1e-4) else 0.0
    return float((a * b).sum()) / denom
