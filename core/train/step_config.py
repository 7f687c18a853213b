"""The settings of one GRPO step, defined once for every backend.

``LocalBackend.train``, ``TinkerBackend.train``, ``RemoteBackend.train`` (through the server's
``LocalBackend``) and :class:`~tracerl.PipelineTrainer` all take these keywords, with these
defaults and this validation: the same groups train the same way whichever backend runs them.
No torch here: a bad setting fails before any model is loaded, on the light client side too.

Train–inference mismatch.  Before the update, each step compares the trainer's logprob of every
trained token sampled by the current policy with the logprob the sampler recorded: the k3
estimate of KL(sampler ‖ trainer), the mean and largest |Δ logprob| and the fraction of tokens
whose ratio ``π_trainer / π_sampler`` leaves ``[1 / mismatch_cap, mismatch_cap]``
(:func:`tracerl.train.mismatch.mismatch_stats`).  A step whose KL exceeds
``max_mismatch_kl`` fails with :class:`~tracerl.errors.MismatchError` naming the likely causes,
since a trainer that computes another distribution than the sampler's trains off-policy without
knowing it.  The default limit (0.01) is ten times what bf16 serving against a bf16 trainer is
reported to reach on dense models (~1e-3), and far below what a wrong window, template, dtype or
adapter gives (0.1 and more).  ``max_mismatch_kl=None`` only measures.

``mismatch_correction``: what the loss does with the mismatch it measured.  ``"none"`` (default)
takes the ratio to the sampler's logprobs as the policy ratio, as GRPO/PPO define it: CISPO's and
PPO's clips already bound it, and the check above stops steps whose mismatch is not small.
``"tis"`` (truncated importance sampling, as verl's rollout correction) takes the clipped ratio
to the trainer's own pre-update logprobs and weights each token by ``min(π_trainer / π_sampler,
mismatch_cap)``; ``"mis"`` (masked) drops the tokens whose ratio leaves the band instead.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from ..errors import ConfigError
from ..validation import DEFAULT_OFF_POLICY_CAP, check_off_policy_cap, check_step_settings, is_number

DEFAULT_MAX_MISMATCH_KL = 0.01
DEFAULT_MISMATCH_CAP = 2.0
MISMATCH_CORRECTIONS = ("none", "tis", "mis")


@dataclass(frozen=True)
class StepConfig:
    """One GRPO step's loss and optimizer settings (``backend.train``'s keywords of the same names;
    ``importance_level`` is its ``importance_sampling_level``)."""

    learning_rate: float = 5e-6
    loss_fn: str = "cispo"
    epsilon: float | None = None
    epsilon_high: float | None = None
    importance_level: str = "token"
    kl_penalty_coef: float = 0.0
    max_grad_norm: float = 0.1
    off_policy_cap: float | None = DEFAULT_OFF_POLICY_CAP
    """Truncated importance weight on turns an older policy sampled (:func:`~tracerl.train.grpo.policy_loss`)."""
    max_mismatch_kl: float | None = DEFAULT_MAX_MISMATCH_KL
    """Largest train–inference mismatch (k3 KL over the current policy's tokens) a step accepts; None: measure only."""
    mismatch_correction: str = "none"
    """``"none"``, ``"tis"`` or ``"mis"`` (module docstring)."""
    mismatch_cap: float = DEFAULT_MISMATCH_CAP
    """The ratio band ``[1/cap, cap]`` of the mismatch metrics, and TIS's cap / MIS's band."""

    def __post_init__(self) -> None:
        loss_fn = getattr(self.loss_fn, "value", self.loss_fn)  # tracerl.train.grpo's str enums are welcome
        level = getattr(self.importance_level, "value", self.importance_level)
        check_off_policy_cap(self.off_policy_cap)
        check_step_settings(
            learning_rate=self.learning_rate,
            loss_fn=loss_fn,
            epsilon=self.epsilon,
            epsilon_high=self.epsilon_high,
            importance_sampling_level=level,
            kl_penalty_coef=self.kl_penalty_coef,
            max_grad_norm=self.max_grad_norm,
        )
        check_mismatch_settings(self.max_mismatch_kl, self.mismatch_correction, self.mismatch_cap)
        object.__setattr__(self, "loss_fn", str(loss_fn))
        object.__setattr__(self, "importance_level", str(level))

    @classmethod
    def from_train_kwargs(cls, **kwargs: Any) -> "StepConfig":
        """From ``backend.train``'s keywords (``importance_sampling_level`` for ``importance_level``)."""
        if "importance_sampling_level" in kwargs:
            kwargs["importance_level"] = kwargs.pop("importance_sampling_level")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unexpected step settings: {', '.join(unknown)}")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def loss_kwargs(self) -> dict[str, Any]:
        """What :func:`tracerl.train.grpo.policy_loss` takes from these settings: every backend's
        loss call passes exactly this (``LoRATrainer`` and ``TinkerBackend``'s ``StepLoss``)."""
        return {
            "loss_fn": self.loss_fn, "epsilon": self.epsilon, "epsilon_high": self.epsilon_high,
            "importance_level": self.importance_level, "kl_penalty_coef": self.kl_penalty_coef,
            "off_policy_cap": self.off_policy_cap, "mismatch_correction": self.mismatch_correction,
            "mismatch_cap": self.mismatch_cap,
        }  # fmt: skip


def check_mismatch_settings(max_mismatch_kl: Any, mismatch_correction: Any, mismatch_cap: Any) -> None:
    """``max_mismatch_kl``: None or a number > 0; ``mismatch_correction``: one of the named ones;
    ``mismatch_cap``: a finite number > 1 (the band ``[1/cap, cap]`` must hold ratio 1)."""
    if max_mismatch_kl is not None and (not is_number(max_mismatch_kl) or not max_mismatch_kl > 0 or max_mismatch_kl == float("inf")):
        raise ConfigError(f"max_mismatch_kl must be None (measure only) or a finite number > 0, got {max_mismatch_kl!r}")
    if mismatch_correction not in MISMATCH_CORRECTIONS:
        raise ConfigError(f"mismatch_correction must be one of {', '.join(map(repr, MISMATCH_CORRECTIONS))}, got {mismatch_correction!r}")
    if not is_number(mismatch_cap) or not 1 < mismatch_cap < float("inf"):
        raise ConfigError(f"mismatch_cap must be a finite number > 1, got {mismatch_cap!r}")
