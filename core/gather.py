"""Run many rollouts concurrently, tolerate failures, show live progress."""

from __future__ import annotations

import asyncio
import inspect
import statistics
from typing import Any, Awaitable, Callable, Iterable

from .errors import TooManyExceptionsError
from .types import ExceptionRecord, Trajectory, TrajectoryGroup, group_scope

AfterEach = Callable[[TrajectoryGroup], Awaitable[Any] | Any]


class GatheredGroups(list):
    """A plain list of groups plus ``metrics`` about the gather (dropped groups, failures)."""

    metrics: dict[str, float]


class _Progress:
    """A tqdm bar whose postfix shows running means of reward and metrics."""

    def __init__(self, total: int, desc: str | None) -> None:
        self.bar = None
        if desc is not None and total:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="rollout", dynamic_ncols=True)
        self.rewards: list[float] = []
        self.metric_values: dict[str, list[float]] = {}
        self.exceptions = 0

    def add(self, trajectories: list[Trajectory], n_exceptions: int) -> None:
        self.exceptions += n_exceptions
        for t in trajectories:
            self.rewards.append(t.reward)
            for key, value in t.metrics.items():
                if isinstance(value, (int, float)):
                    self.metric_values.setdefault(key, []).append(float(value))
        if self.bar is not None:
            postfix: dict[str, Any] = {}
            if self.rewards:
                postfix["reward"] = f"{statistics.fmean(self.rewards):.3f}"
            for key, values in list(self.metric_values.items())[:4]:
                postfix[key] = f"{statistics.fmean(values):.3g}"
            if self.exceptions:
                postfix["exceptions"] = self.exceptions
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(len(trajectories) + n_exceptions)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _exception_budget(max_exceptions: int | float, total: int) -> float:
    if isinstance(max_exceptions, float) and 0 <= max_exceptions < 1:
        return max_exceptions * total
    return float(max_exceptions)


async def gather_trajectory_groups(
    groups: Iterable[Awaitable[TrajectoryGroup] | TrajectoryGroup],
    *,
    pbar_desc: str | None = "gather",
    max_exceptions: int | float = 0,
    after_each: AfterEach | None = None,
) -> GatheredGroups:
    """Run every group's rollouts concurrently and return the finished groups.

    ``max_exceptions``: how many failed rollouts are tolerated (an int, or a fraction of
    all rollouts); past that a :class:`TooManyExceptionsError` is raised.  ``after_each``
    (e.g. RULER) may return a group, a list of groups, or ``None`` to drop the group.
    """
    groups = list(groups)
    total = sum(len(g._pending) + len(g.trajectories) if isinstance(g, TrajectoryGroup) else 1 for g in groups)
    progress = _Progress(total, pbar_desc)
    budget = _exception_budget(max_exceptions, total)
    dropped = 0

    async def finish(item: Awaitable[TrajectoryGroup] | TrajectoryGroup) -> list[TrajectoryGroup]:
        nonlocal dropped
        group_scope()  # this task's rollouts are one group (one Langfuse session); its own context
        group = await item if inspect.isawaitable(item) else item
        progress.add(group.trajectories, len(group.exceptions))
        if progress.exceptions > budget:
            last = group.exceptions[-1] if group.exceptions else None
            raise TooManyExceptionsError(
                f"{progress.exceptions} rollouts failed (max_exceptions={max_exceptions}); last: "
                + (f"{last.type}: {last.message}\n{last.traceback}" if last else "n/a")
            )
        if after_each is None:
            return [group]
        result = after_each(group)
        if inspect.isawaitable(result):
            result = await result
        if result is None:
            dropped += 1
            return []
        return list(result) if isinstance(result, list) else [result]

    try:
        results = await asyncio.gather(*(finish(g) for g in groups))
    finally:
        progress.close()
    out = GatheredGroups(g for batch in results for g in batch)
    out.metrics = {
        "groups_dropped": float(dropped),
        "exceptions": float(progress.exceptions),
        "reward": statistics.fmean(progress.rewards) if progress.rewards else float("nan"),
    }
    return out


async def gather_trajectories(
    trajectories: Iterable[Awaitable[Trajectory]],
    *,
    pbar_desc: str | None = "gather",
    max_exceptions: int | float = 0,
) -> list[Trajectory | ExceptionRecord]:
    """The flat version: run rollouts concurrently; failures come back as :class:`ExceptionRecord`."""
    items = list(trajectories)
    progress = _Progress(len(items), pbar_desc)
    budget = _exception_budget(max_exceptions, len(items))

    async def one(item: Awaitable[Trajectory]) -> Trajectory | ExceptionRecord:
        try:
            t = await item
        except Exception as error:  # noqa: BLE001 - failures are values here
            progress.add([], 1)
            if progress.exceptions > budget:
                raise TooManyExceptionsError(
                    f"{progress.exceptions} rollouts failed (max_exceptions={max_exceptions})"
                ) from error
            return ExceptionRecord.from_exception(error)
        progress.add([t], 0)
        return t

    try:
        return list(await asyncio.gather(*(one(i) for i in items)))
    finally:
        progress.close()
