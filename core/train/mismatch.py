"""Train–inference mismatch: how far the trainer's distribution is from the one the sampler sampled.

Measured on every step, before the update, over the trained tokens that the current policy sampled
(turns of an older policy differ by design and are corrected off-policy instead), from the
sampler's recorded logprob ``ℓ_s`` and the trainer's ``ℓ_t`` of each token:

- ``mismatch_kl``: the k3 estimate of KL(sampler ‖ trainer), ``mean(r − 1 − log r)`` with
  ``r = exp(ℓ_t − ℓ_s)`` (unbiased under the sampler's distribution, ≥ 0 per token);
- ``mismatch_abs_mean`` / ``mismatch_abs_max``: mean and largest ``|ℓ_t − ℓ_s|``;
- ``mismatch_out_of_band``: the fraction of tokens whose ``r`` leaves ``[1/cap, cap]``.

:func:`check_mismatch` turns a KL above the step's ``max_mismatch_kl`` into a
:class:`~tracerl.errors.MismatchError` that names the likely causes.
"""

from __future__ import annotations

import math

import torch

from ..errors import MismatchError

MISMATCH_KEYS = ("mismatch_kl", "mismatch_abs_mean", "mismatch_abs_max", "mismatch_out_of_band", "mismatch_tokens")
LIKELY_CAUSES = (
    "the served policy is not the trained one (an adapter not loaded or another step served, a merged model "
    "that lost the update); the trainer and the server use different dtypes or attention (a sliding window "
    "dropped, another attention kernel); the chat template or tokenizer differ; the turn was sampled with "
    "settings the trainer does not apply (temperature, top-p, top-k)"
)


SUM_KEYS = ("mismatch_kl_sum", "mismatch_abs_sum", "mismatch_abs_max", "mismatch_out_of_band_sum", "mismatch_tokens")
"""What a step adds up over micro-batches and data-parallel ranks (the ``_max`` one: the largest)."""


def mismatch_sums(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, cap: float) -> dict[str, float]:
    """The sums of :data:`SUM_KEYS` over the tokens where ``mask`` holds and the sampler's logprob is known."""
    trainer = trainer_logprobs.detach().double()
    sampler = sampler_logprobs.to(trainer.device).double()
    keep = mask.to(trainer.device) & ~torch.isnan(sampler)
    if not bool(keep.any()):
        return dict.fromkeys(SUM_KEYS, 0.0)
    delta = (trainer - sampler)[keep].clamp(-20.0, 20.0)
    ratio = delta.exp()
    return {
        "mismatch_kl_sum": float((ratio - 1.0 - delta).sum()),
        "mismatch_abs_sum": float(delta.abs().sum()),
        "mismatch_abs_max": float(delta.abs().max()),
        "mismatch_out_of_band_sum": float(((ratio > cap) | (ratio < 1.0 / cap)).sum()),
        "mismatch_tokens": float(keep.sum()),
    }


def add_sums(totals: dict[str, float], sums: dict[str, float]) -> None:
    for key in SUM_KEYS:
        totals[key] = max(totals.get(key, 0.0), sums[key]) if key.endswith("_max") else totals.get(key, 0.0) + sums[key]


def mismatch_metrics(totals: dict[str, float]) -> dict[str, float]:
    """The step's mismatch metrics from its sums; empty when no token had a sampler logprob to compare."""
    n = totals.get("mismatch_tokens", 0.0)
    if not n:
        return {}
    return {
        "mismatch_kl": totals["mismatch_kl_sum"] / n,
        "mismatch_abs_mean": totals["mismatch_abs_sum"] / n,
        "mismatch_abs_max": totals["mismatch_abs_max"],
        "mismatch_out_of_band": totals["mismatch_out_of_band_sum"] / n,
        "mismatch_tokens": n,
    }


def mismatch_stats(
    trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor | None = None, *, cap: float = 2.0
) -> dict[str, float]:
    """The mismatch metrics of one set of tokens (``mask``: which count; default all)."""
    keep = torch.ones_like(trainer_logprobs, dtype=torch.bool) if mask is None else mask
    return mismatch_metrics(mismatch_sums(trainer_logprobs, sampler_logprobs, keep, cap))


def check_mismatch(metrics: dict[str, float], max_mismatch_kl: float | None) -> None:
    """Raise :class:`MismatchError` when the step's ``mismatch_kl`` exceeds ``max_mismatch_kl``."""
    kl = metrics.get("mismatch_kl")
    if max_mismatch_kl is None or kl is None or not (kl > max_mismatch_kl or math.isnan(kl)):
        return
    raise MismatchError(
        f"the trainer's logprobs of the sampled tokens disagree with the sampler's: mismatch KL {kl:.4g} > "
        f"max_mismatch_kl={max_mismatch_kl:g} (mean |Δ logprob| {metrics.get('mismatch_abs_mean', float('nan')):.4g}, "
        f"max {metrics.get('mismatch_abs_max', float('nan')):.4g}, {100 * metrics.get('mismatch_out_of_band', 0.0):.1f}% of "
        f"{int(metrics.get('mismatch_tokens', 0))} tokens outside the ratio band); training on them would be off-policy. "
        f"Likely causes: {LIKELY_CAUSES}. Nothing was applied; max_mismatch_kl=None trains anyway "
        "(mismatch_correction='tis' or 'mis' then corrects it)",
        metrics={k: metrics[k] for k in MISMATCH_KEYS if k in metrics},
    )
