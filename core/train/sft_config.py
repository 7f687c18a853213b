"""SFT settings and learning-rate schedules (no torch: the client side and the CLI import it).

Names follow OpenPipe ART where ART has them, so ART code ports by renaming the import:
``SFTConfig`` (ART: ``TrainSFTConfig``, also exported under that name) with
``learning_rate`` (a float, or one value per batch) and ``batch_size`` (an int or
``"auto"``), ``assistant_turns`` (``"all"`` / ``"last"``); ART's schedule helper
:func:`create_lr_schedule` with the same ``method`` names (``"constant"``, ``"linear"``,
``"cosine"``), ``warmup_steps`` and ``min_lr``.  The rest (epochs, warm-up ratio, held-out
fraction, normalisation) are fields here because one ``train_sft`` call runs the whole
schedule; ART spreads them over ``create_sft_dataset_iterator``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from ..validation import check_sft_settings

ScheduleType = Literal["constant", "linear", "cosine"]
Normalization = Literal["token", "sequence"]
AUTO_BATCH_SIZE = 2
"""What ``batch_size="auto"`` means (ART's LocalBackend default for SFT)."""


@dataclass(frozen=True)
class SFTConfig:
    """How one ``backend.train_sft`` call trains: every number is checked here (``ConfigError`` names it).

    One call is one checkpoint step (``name@step+1``) made of ``epochs × ceil(n / batch_size)``
    optimizer steps (ART: "checkpoint step != gradient step").
    """

    learning_rate: float | list[float] = 5e-5
    """Peak learning rate of the schedule, or one learning rate per optimizer step (ART's list form:
    its length must equal the number of optimizer steps, and ``schedule_type`` is then ignored)."""
    batch_size: int | Literal["auto"] = "auto"
    """Examples per optimizer step (``"auto"``: 2)."""
    epochs: int = 1
    schedule_type: ScheduleType = "constant"
    """``constant``, ``linear`` (to ``min_lr`` at the last step) or ``cosine`` (half a cosine to ``min_lr``)."""
    warmup_ratio: float = 0.0
    """Fraction of the optimizer steps spent ramping linearly up to ``learning_rate`` (in [0, 1))."""
    min_lr: float = 0.0
    normalization: Normalization = "token"
    """``token``: the loss is the mean over every trained token of the batch (long examples weigh more,
    as in TRL and ART).  ``sequence``: each example's mean token loss, averaged over the batch's
    examples (every example weighs the same whatever its length, as GRPO weighs trajectories)."""
    max_grad_norm: float = 1.0
    val_fraction: float = 0.0
    """Fraction of the examples held out (chosen with ``seed``) for the validation loss (in [0, 1))."""
    assistant_turns: Literal["all", "last"] = "all"
    """Which assistant turns of each example are trained (ART's field); the others are context."""
    shuffle: bool = True
    seed: int = 42
    """Shuffles each epoch with ``seed + epoch`` (ART's convention) and picks the held-out split."""
    show_progress: bool = True
    """A tqdm bar over the optimizer steps with the running loss."""

    def __post_init__(self) -> None:
        if isinstance(self.learning_rate, tuple):
            object.__setattr__(self, "learning_rate", list(self.learning_rate))
        check_sft_settings(
            learning_rate=self.learning_rate,
            batch_size=self.batch_size,
            epochs=self.epochs,
            schedule_type=self.schedule_type,
            warmup_ratio=self.warmup_ratio,
            min_lr=self.min_lr,
            normalization=self.normalization,
            max_grad_norm=self.max_grad_norm,
            val_fraction=self.val_fraction,
            assistant_turns=self.assistant_turns,
            shuffle=self.shuffle,
            seed=self.seed,
            show_progress=self.show_progress,
        )

    @property
    def resolved_batch_size(self) -> int:
        return AUTO_BATCH_SIZE if self.batch_size == "auto" else int(self.batch_size)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (what ``RemoteBackend.train_sft`` sends)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "SFTConfig":
        """The inverse of :meth:`to_dict`; an unknown key is a ``TypeError`` like an unknown keyword."""
        return cls(**dict(data or {}))

    @classmethod
    def coerce(cls, config: "SFTConfig | dict[str, Any] | None") -> "SFTConfig":
        """What every backend's ``train_sft(config=...)`` accepts: None (defaults), a dict, or an SFTConfig."""
        if config is None:
            return cls()
        if isinstance(config, dict):
            return cls.from_dict(config)
        if not isinstance(config, cls):
            from ..errors import ConfigError

            raise ConfigError(f"config must be an SFTConfig (or its dict), got {type(config).__name__}")
        return config

    def schedule(self, total_steps: int) -> list[float]:
        """The learning rate of each of ``total_steps`` optimizer steps."""
        if isinstance(self.learning_rate, list):
            if len(self.learning_rate) != total_steps:
                from ..errors import ConfigError

                raise ConfigError(
                    f"learning_rate is a list of {len(self.learning_rate)} values but this call takes {total_steps} "
                    "optimizer steps (epochs x ceil(training examples / batch_size)); give one value per step"
                )
            return [float(lr) for lr in self.learning_rate]
        warmup = int(total_steps * self.warmup_ratio)
        return create_lr_schedule(total_steps, float(self.learning_rate), self.schedule_type, warmup, self.min_lr)


TrainSFTConfig = SFTConfig
"""ART's name for the same settings."""


def create_lr_schedule(
    total_steps: int,
    peak_lr: float,
    method: ScheduleType = "linear",
    warmup_steps: int = 0,
    min_lr: float = 0.0,
) -> list[float]:
    """One learning rate per step: linear warm-up from ``min_lr`` to ``peak_lr`` over ``warmup_steps``
    (the first step already above ``min_lr``), then ``method`` from ``peak_lr`` down to ``min_lr`` at
    the last step (ART's ``create_lr_schedule``, same arguments and values)."""
    if method not in ("constant", "linear", "cosine"):
        from ..errors import ConfigError

        raise ConfigError(f"schedule method must be 'constant', 'linear' or 'cosine', got {method!r}")
    if total_steps <= 0:
        return []
    warmup_steps = max(0, min(int(warmup_steps), total_steps))
    decay_steps = total_steps - warmup_steps
    rates = []
    for step in range(total_steps):
        if step < warmup_steps:
            rates.append(min_lr + (peak_lr - min_lr) * (step + 1) / warmup_steps)
            continue
        progress = (step - warmup_steps) / (decay_steps - 1) if decay_steps > 1 else 0.0
        if method == "cosine":
            rates.append(min_lr + (peak_lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress)))
        elif method == "linear":
            rates.append(peak_lr - (peak_lr - min_lr) * progress)
        else:
            rates.append(peak_lr)
    return rates
