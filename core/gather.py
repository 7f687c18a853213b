"""Run many rollouts concurrently, tolerate failures, show live progress.

Failed rollouts are values (``group.exceptions``), counted against ``max_exceptions``:
an exception raised by the rollout (e.g. an :class:`~tracerl.errors.InfrastructureError`
when the MCP server or the inference server failed under it) and a rollout that ran past
``rollout_timeout`` (cancelled, so the MCP sessions and stdio servers it opened are
closed, and recorded as a :class:`~tracerl.errors.RolloutTimeoutError`).
"""

from __future__ import annotations

import asyncio
import inspect
import statistics
import time
from contextvars import ContextVar
from typing import Any, Awaitable, Callable, Iterable, TypeVar

from . import errors
from .errors import RolloutTimeoutError, TooManyExceptionsError
from .types import ExceptionRecord, Trajectory, TrajectoryGroup, group_scope

AfterEach = Callable[[TrajectoryGroup], Awaitable[Any] | Any]
T = TypeVar("T")

_rollout_timeout: ContextVar[float | None] = ContextVar("tracerl_rollout_timeout", default=None)
"""The enclosing gather's ``rollout_timeout``, for groups built by ``tracerl.trajectory_group``."""


async def bounded(awaitable: Awaitable[T], timeout: float | None = None) -> T:
    """Await one rollout for at most ``timeout`` seconds (default: the enclosing gather's).

    Past the limit the rollout is cancelled where it waits (its ``async with`` blocks
    unwind: MCP sessions close, stdio servers stop) and :class:`RolloutTimeoutError` is
    raised, chained to the cancellation (its traceback shows where the rollout was stuck).
    """
    if timeout is None:
        timeout = _rollout_timeout.get()
    if timeout is None:
        return await awaitable
    limit = asyncio.timeout(timeout)
    try:
        async with limit:
            return await awaitable
    except Exception as error:  # a cancellation from outside (BaseException) passes through
        if not limit.expired():
            raise  # the rollout's own error (a model or MCP call's timeout included), not ours
        # ours: asyncio's TimeoutError, or what the cancelled rollout's cleanup raised instead
        raise RolloutTimeoutError(
            f"the rollout ran past rollout_timeout={timeout:g} s and was cancelled "
            "(knob: gather_trajectory_groups(..., rollout_timeout=...))"
        ) from error


class GatheredGroups(list):
    """A plain list of groups plus ``metrics`` about the gather (dropped groups, failures, wall time).

    ``metrics["seconds"]`` is the gather's wall time; ``LocalBackend.train`` given these groups
    reports it as ``rollout_seconds`` beside its own train / save / hot-load split, so every
    step's row says where its time went without the loop timing anything itself.
    """

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
        self.timeouts = 0
        self.infrastructure = 0

    def add(self, trajectories: list[Trajectory], records: list[ExceptionRecord]) -> None:
        n_exceptions = len(records)
        self.exceptions += n_exceptions
        for record in records:
            kind = getattr(errors, record.type, None)
            self.timeouts += int(kind is RolloutTimeoutError)
            self.infrastructure += int(isinstance(kind, type) and issubclass(kind, errors.InfrastructureError))
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
            if self.timeouts:
                postfix["timeouts"] = self.timeouts
            if self.infrastructure:
                postfix["infra"] = self.infrastructure
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(len(trajectories) + n_exceptions)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def _run_all(coroutines: Iterable[Awaitable[T]]) -> list[T]:
    """``asyncio.gather``, except that when one fails (too many exceptions, a cancellation)
    the others are cancelled and awaited, so no rollout keeps running (or keeps an MCP
    server alive) after the gather has returned."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


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
    rollout_timeout: float | None = None,
) -> GatheredGroups:
    """Run every group's rollouts concurrently and return the finished groups.

    ``max_exceptions``: how many failed rollouts are tolerated (an int, or a fraction of
    all rollouts); past that a :class:`TooManyExceptionsError` is raised.  ``after_each``
    (e.g. RULER) may return a group, a list of groups, or ``None`` to drop the group.
    ``rollout_timeout``: seconds after which a rollout still running is cancelled and
    recorded in its group's exceptions as a :class:`RolloutTimeoutError` (default: no
    limit; every model and MCP call has its own timeout).  It bounds each awaitable of a
    ``TrajectoryGroup(rollouts)`` and each attempt of a ``tracerl.trajectory_group``.
    """
    started = time.monotonic()
    groups = list(groups)
    total = sum(len(g._pending) + len(g.trajectories) if isinstance(g, TrajectoryGroup) else 1 for g in groups)
    progress = _Progress(total, pbar_desc)
    budget = _exception_budget(max_exceptions, total)
    dropped = 0

    async def finish(item: Awaitable[TrajectoryGroup] | TrajectoryGroup) -> list[TrajectoryGroup]:
        nonlocal dropped
        group_scope()  # this task's rollouts are one group (one Langfuse session); its own context
        if isinstance(item, TrajectoryGroup) and rollout_timeout is not None:
            item._pending = [bounded(a, rollout_timeout) for a in item._pending]
        group = await item if inspect.isawaitable(item) else item
        progress.add(group.trajectories, group.exceptions)
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

    token = _rollout_timeout.set(rollout_timeout)
    try:
        results = await _run_all(finish(g) for g in groups)
    finally:
        _rollout_timeout.reset(token)
        progress.close()
    out = GatheredGroups(g for batch in results for g in batch)
    out.metrics = {
        "groups_dropped": float(dropped),
        "exceptions": float(progress.exceptions),
        "rollout_timeouts": float(progress.timeouts),
        "infrastructure_exceptions": float(progress.infrastructure),
        "reward": statistics.fmean(progress.rewards) if progress.rewards else float("nan"),
        "seconds": time.monotonic() - started,
    }
    return out


async def gather_trajectories(
    trajectories: Iterable[Awaitable[Trajectory]],
    *,
    pbar_desc: str | None = "gather",
    max_exceptions: int | float = 0,
    rollout_timeout: float | None = None,
) -> list[Trajectory | ExceptionRecord]:
    """The flat version: run rollouts concurrently; failures (a rollout past
    ``rollout_timeout`` included) come back as :class:`ExceptionRecord`."""
    items = list(trajectories)
    progress = _Progress(len(items), pbar_desc)
    budget = _exception_budget(max_exceptions, len(items))

    async def one(item: Awaitable[Trajectory]) -> Trajectory | ExceptionRecord:
        try:
            t = await bounded(item, rollout_timeout)
        except Exception as error:  # noqa: BLE001 - failures are values here
            record = ExceptionRecord.from_exception(error)
            progress.add([], [record])
            if progress.exceptions > budget:
                raise TooManyExceptionsError(
                    f"{progress.exceptions} rollouts failed (max_exceptions={max_exceptions})"
                ) from error
            return record
        progress.add([t], [])
        return t

    try:
        return await _run_all(one(i) for i in items)
    finally:
        progress.close()
