"""Numbers are checked where they enter and again where they are used (DESIGN §5.8).

Rewards, metrics, sampler logprobs, token ids and hyperparameters decide what a GRPO step
does, and one bad value is enough to spoil it: a NaN reward turns every advantage of its
group into NaN, a NaN learning rate turns the adapter into NaN, an id outside the vocabulary
poisons a GPU process at the embedding.  So the pydantic types check their fields at
construction *and* assignment (with these functions), and ``backend.train`` / ``model.log``
check everything again (:func:`tracerl.types.check_groups`), because a dict or list can still be changed
in place (``t.metrics["x"] = nan``) after it was validated.

The module imports no torch: a bad argument fails before any model is loaded, and the
light client side (``TrainableModel``, capture) can use it.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

from .errors import ConfigError, TrajectoryError

LOSS_FNS = ("cispo", "ppo")
IMPORTANCE_LEVELS = ("token", "sequence")
ON_NON_FINITE = ("raise", "skip")
LORA_KEYS = {"r", "alpha", "dropout", "target_modules", "lora_alpha", "lora_dropout"}


def is_number(value: Any) -> bool:
    """A real number that is not a bool (``True`` as a learning rate is a mistake, not 1.0)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# -- field checks (used by the pydantic types) ----------------------------------------------------
def _prefix(what: str) -> str:
    return f"{what}: " if what else ""


def finite_reward(value: Any, what: str = "reward") -> float:
    """``value`` as a float, or :class:`TrajectoryError` when it is not a finite number."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TrajectoryError(f"{what} must be a finite number, got {value!r}") from None
    if isinstance(value, str) or not math.isfinite(number):
        raise TrajectoryError(f"{what} must be a finite number, got {value!r}")
    return number


def check_metrics(metrics: Mapping[str, Any], what: str = "metrics") -> None:
    """Every value a bool or a finite number (a NaN metric would poison ``history.jsonl``'s means)."""
    for key, value in metrics.items():
        if isinstance(value, bool):
            continue
        if not is_number(value) or not math.isfinite(value):
            raise TrajectoryError(f"{what}[{key!r}] must be a finite number or a bool, got {value!r}")


def check_logprobs(logprobs: Sequence[Any] | None, what: str = "") -> None:
    """Every sampler logprob finite (one sum is the fast path; the scan only runs to name the culprit)."""
    if not logprobs:
        return
    try:
        if math.isfinite(sum(logprobs)):
            return
    except TypeError:
        pass
    for position, value in enumerate(logprobs):
        if not is_number(value) or not math.isfinite(value):
            raise TrajectoryError(f"{_prefix(what)}the sampler logprob at position {position} is {value!r}; logprobs must be finite")


def check_token_advantages(values: Sequence[Any] | None, token_ids: Sequence[int] | None, what: str = "") -> None:
    """Per-token advantages finite and (when ``token_ids`` is known) one per completion token."""
    if values is None:
        return
    for position, value in enumerate(values):
        if not is_number(value) or not math.isfinite(value):
            raise TrajectoryError(f"{_prefix(what)}the token advantage at position {position} is {value!r}; advantages must be finite")
    if token_ids is not None and len(values) != len(token_ids):
        raise TrajectoryError(f"{_prefix(what)}{len(values)} token advantages for {len(token_ids)} completion tokens; they must match")


def check_token_ids(ids: Sequence[int] | None, what: str = "", vocab_size: int | None = None) -> None:
    """Every id in ``[0, vocab_size)`` (``vocab_size=None``: only ``>= 0``)."""
    if not ids:
        return
    try:  # one C-level pass (two with a bound): capture builds a Choice per model call
        in_range = min(ids) >= 0 and (vocab_size is None or max(ids) < vocab_size)
    except TypeError:
        in_range = False
    if in_range:
        return
    bound = f"[0, {vocab_size})" if vocab_size is not None else "[0, ...)"
    for position, value in enumerate(ids):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (vocab_size is not None and value >= vocab_size):
            raise TrajectoryError(
                f"{_prefix(what)}token id {value!r} at position {position} is outside the vocabulary {bound}"
                + (" of the model's embedding" if vocab_size is not None else "")
            )


# -- hyperparameters ------------------------------------------------------------------------------
def _positive(name: str, value: Any, *, allow_zero: bool = False) -> None:
    if not is_number(value) or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name} must be a finite number {bound}, got {value!r}")


def _choice(name: str, value: Any, allowed: Iterable[str]) -> str:
    text = getattr(value, "value", value)  # the enums of tracerl.train.grpo are str enums
    if text not in tuple(allowed):
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return str(text)


def check_step_settings(
    *,
    learning_rate: Any,
    loss_fn: Any,
    epsilon: Any,
    epsilon_high: Any,
    importance_sampling_level: Any,
    kl_penalty_coef: Any,
    max_grad_norm: Any,
) -> None:
    """The optimizer and loss settings of one GRPO step; :class:`ConfigError` names the argument.

    ``epsilon`` sets the lower clip ``1 - epsilon`` of the importance ratio: for PPO it must
    stay positive (``0 < epsilon < 1``); CISPO allows ``epsilon = 1`` (no lower truncation, its
    default) but nothing beyond, where ``1 - epsilon`` would be negative and mean nothing.
    ``epsilon_high`` (upper clip ``1 + epsilon_high``) must be finite and positive.
    """
    _positive("learning_rate", learning_rate)
    _positive("max_grad_norm", max_grad_norm)
    _positive("kl_penalty_coef", kl_penalty_coef, allow_zero=True)
    loss = _choice("loss_fn", loss_fn, LOSS_FNS)
    _choice("importance_sampling_level", importance_sampling_level, IMPORTANCE_LEVELS)
    if epsilon is not None:
        _positive("epsilon", epsilon)
        if loss == "ppo" and epsilon >= 1:
            raise ConfigError(f"epsilon must be < 1 for loss_fn='ppo' (the ratio's lower clip is 1 - epsilon), got {epsilon!r}")
        if loss == "cispo" and epsilon > 1:
            raise ConfigError(f"epsilon must be <= 1 for loss_fn='cispo' (the ratio's lower clip is 1 - epsilon), got {epsilon!r}")
    if epsilon_high is not None:
        _positive("epsilon_high", epsilon_high)


DEFAULT_OFF_POLICY_CAP = 2.0
"""Cap of the importance weight ``π_trainer / π_sampler`` on turns an older policy sampled
(``backend.train(off_policy_cap=...)``, :func:`tracerl.train.grpo.policy_loss`)."""


TRAIN_OPTIONS = ("scale_rewards", "allow_retokenize", "on_non_finite")
"""``backend.train``'s keywords beyond the step's own (:class:`tracerl.train.step_config.StepConfig`'s):
how groups become sequences, and what a non-finite step does.  Their defaults: ``True``, ``False``, ``"raise"``."""


def check_train_arguments(*, scale_rewards: Any, allow_retokenize: Any, on_non_finite: Any, **step_settings: Any) -> None:
    """``backend.train``'s own keywords (:data:`TRAIN_OPTIONS`); given ``step_settings`` (the numbers of
    :func:`check_step_settings`, ``off_policy_cap``), those too.

    Every backend checks its keywords with this and :class:`~tracerl.train.step_config.StepConfig`,
    which checks all of the step's settings (the train–inference mismatch ones too), before anything
    is loaded or sent."""
    if step_settings:
        check_off_policy_cap(step_settings.pop("off_policy_cap", DEFAULT_OFF_POLICY_CAP))
        check_step_settings(**step_settings)
    for name, value in (("scale_rewards", scale_rewards), ("allow_retokenize", allow_retokenize)):
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be True or False, got {value!r}")
    _choice("on_non_finite", on_non_finite, ON_NON_FINITE)


def check_off_policy_cap(value: Any) -> None:
    """``off_policy_cap``: None (no correction) or a finite number >= 1 (a cap below 1 would
    shrink even turns the trainer finds likelier than the sampler did)."""
    if value is not None and (not is_number(value) or not math.isfinite(value) or value < 1):
        raise ConfigError(f"off_policy_cap must be None (no off-policy correction) or a finite number >= 1, got {value!r}")


SFT_SCHEDULES = ("constant", "linear", "cosine")
SFT_NORMALIZATIONS = ("token", "sequence")
SFT_ASSISTANT_TURNS = ("all", "last")


def _fraction(name: str, value: Any) -> None:
    if not is_number(value) or not math.isfinite(value) or not 0 <= value < 1:
        raise ConfigError(f"{name} must be a number in [0, 1), got {value!r}")


def _count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")


def check_sft_settings(
    *,
    learning_rate: Any,
    batch_size: Any,
    epochs: Any,
    schedule_type: Any,
    warmup_ratio: Any,
    min_lr: Any,
    normalization: Any,
    max_grad_norm: Any,
    val_fraction: Any,
    assistant_turns: Any,
    shuffle: Any,
    seed: Any,
    show_progress: Any,
) -> None:
    """The numbers of an ``SFTConfig``, checked as GRPO's are (:class:`ConfigError` names the field).

    ``learning_rate`` is a finite number > 0 or a non-empty list of them (one per optimizer
    step); ``min_lr`` finite, >= 0 and not above the peak; fractions in [0, 1).
    """
    if isinstance(learning_rate, (list, tuple)):
        if not learning_rate:
            raise ConfigError("learning_rate must be a number or a non-empty list of numbers, got []")
        for index, value in enumerate(learning_rate):
            _positive(f"learning_rate[{index}]", value)
    else:
        _positive("learning_rate", learning_rate)
    if batch_size != "auto":
        _count("batch_size", batch_size)
    _count("epochs", epochs)
    _choice("schedule_type", schedule_type, SFT_SCHEDULES)
    _fraction("warmup_ratio", warmup_ratio)
    _positive("min_lr", min_lr, allow_zero=True)
    if is_number(learning_rate) and min_lr > learning_rate:
        raise ConfigError(f"min_lr ({min_lr!r}) must not exceed learning_rate ({learning_rate!r})")
    _choice("normalization", normalization, SFT_NORMALIZATIONS)
    _positive("max_grad_norm", max_grad_norm)
    _fraction("val_fraction", val_fraction)
    _choice("assistant_turns", assistant_turns, SFT_ASSISTANT_TURNS)
    for name, value in (("shuffle", shuffle), ("show_progress", show_progress)):
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be True or False, got {value!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got {seed!r}")


def check_lora_settings(r: Any = None, alpha: Any = None, dropout: Any = None, target_modules: Any = None) -> None:
    """LoRA rank >= 1, alpha > 0, dropout in [0, 1), at least one target module (``None``: not given)."""
    if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
        raise ConfigError(f"lora_config['r'] (the LoRA rank) must be an integer >= 1, got {r!r}")
    if alpha is not None and (not is_number(alpha) or not math.isfinite(alpha) or alpha <= 0):
        raise ConfigError(f"lora_config['alpha'] must be a finite number > 0, got {alpha!r}")
    if dropout is not None and (not is_number(dropout) or not 0 <= dropout < 1):
        raise ConfigError(f"lora_config['dropout'] must be a number in [0, 1), got {dropout!r}")
    if target_modules is not None and (
        not isinstance(target_modules, (list, tuple)) or not target_modules or not all(isinstance(m, str) and m for m in target_modules)
    ):
        raise ConfigError(f"lora_config['target_modules'] must be a non-empty list of module names, got {target_modules!r}")


def lora_values(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The keys given in ``lora_config``, checked, ART's ``lora_alpha`` / ``lora_dropout`` read as
    ``alpha`` / ``dropout``.  An unknown key is a ``TypeError``, like an unknown keyword argument."""
    config = dict(config or {})
    unknown = set(config) - LORA_KEYS
    if unknown:
        raise TypeError(f"unknown lora_config keys: {sorted(unknown)}")
    values: dict[str, Any] = {}
    for key, spellings in (("r", ("r",)), ("alpha", ("alpha", "lora_alpha")), ("dropout", ("dropout", "lora_dropout"))):
        given = [config[name] for name in spellings if name in config]
        if given:
            values[key] = given[0]
    if "target_modules" in config:
        values["target_modules"] = config["target_modules"]
    if isinstance(values.get("r"), float) and values["r"].is_integer():
        values["r"] = int(values["r"])  # 8.0 is rank 8
    check_lora_settings(**values)
    return values


# -- everything again, where it is used -----------------------------------------------------------
def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_group(index: int, group: Any) -> str:
    """``"group 2 (task 'Name a fruit.')"``: the task from the group's metadata or its trajectories'."""
    metadata = getattr(group, "metadata", None) or {}
    task = metadata.get("task") if isinstance(metadata, dict) else None
    if task is None:
        task = next((t.metadata["task"] for t in getattr(group, "trajectories", []) if "task" in (t.metadata or {})), None)
    return f"group {index}" + (f" (task {_short(task)})" if task is not None else "")


def describe_trajectory(group_index: int, group: Any, index: int, trajectory: Any) -> str:
    """``"group 2 (task ...), trajectory 1 (id 3f2a...)"``: how errors name a trajectory."""
    return f"{describe_group(group_index, group)}, trajectory {index} (id {getattr(trajectory, 'id', '?')})"
