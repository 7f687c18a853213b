"""Which checkpoints a run keeps: retention policies, applied only to what is safe to delete.

A policy sees the checkpoints that may go (never the served one, the one training starts
from, or one an in-flight rollout still samples from) with the metrics logged at their step,
and returns the steps to delete.  ``keep_recent_and_top`` is ART's policy of the same name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..errors import ConfigError


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    metrics: dict[str, float] = field(default_factory=dict)
    """Every metric ``history.jsonl`` holds for this step (``val/reward``, ``train/loss``, ...)."""


@dataclass(frozen=True)
class RetentionContext:
    current_step: int
    checkpoints: list[CheckpointInfo]
    """Only the checkpoints that may be deleted, oldest first."""


RetentionPolicy = Callable[[RetentionContext], Iterable[int]]
"""Returns the steps (among ``context.checkpoints``) to delete."""


def keep_recent_and_top(*, recent: int = 2, top: int = 1, metric: str = "val/reward") -> RetentionPolicy:
    """Delete every deletable checkpoint except the ``recent`` newest and the ``top`` best by ``metric``.

    A checkpoint without ``metric`` logged at its step is never among the best (evaluate
    every few steps and the best evaluated one stays)."""
    for name, value in (("recent", recent), ("top", top)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")

    def policy(context: RetentionContext) -> set[int]:
        steps = sorted(c.step for c in context.checkpoints)
        keep = set(steps[-recent:]) if recent else set()
        scored = sorted(
            (c for c in context.checkpoints if isinstance(c.metrics.get(metric), (int, float))),
            key=lambda c: (c.metrics[metric], c.step),
            reverse=True,
        )
        keep.update(c.step for c in scored[:top])
        return set(steps) - keep

    return policy


def metrics_by_step(history: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Every numeric metric of ``history.jsonl``, merged per step (splits write separate rows)."""
    merged: dict[int, dict[str, float]] = {}
    for row in history:
        step = row.get("step")
        if isinstance(step, int):
            merged.setdefault(step, {}).update(
                {k: float(v) for k, v in row.items() if "/" in k and isinstance(v, (int, float)) and not isinstance(v, bool)}
            )
    return merged


async def apply_retention(model: Any, backend: Any, policy: RetentionPolicy, *, protected: set[int]) -> list[int]:
    """Run ``policy`` on ``model``'s deletable checkpoints and delete what it names; returns the deleted steps.

    ``protected`` (the served step, the step training starts from, the steps in-flight
    rollouts sample from) are neither shown to the policy nor deleted, whatever it returns."""
    steps = await backend.list_checkpoints(model)
    metrics = metrics_by_step(model.history())
    current = max(steps, default=0)
    protected = protected | {current}
    eligible = [CheckpointInfo(step, metrics.get(step, {})) for step in steps if step not in protected]
    doomed = set(policy(RetentionContext(current, eligible))) & {c.step for c in eligible}
    if not doomed:
        return []
    return await backend.delete_checkpoints(model, keep=sorted(set(steps) - doomed))
