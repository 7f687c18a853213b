"""Rollouts as Ray tasks on the cluster's nodes, captured where they run.

By default rollouts run where ``gather_trajectory_groups`` runs.  ``RayRollouts().remote(fn)`` wraps
the user's rollout coroutine function so that each awaited call runs ``fn(*args, **kwargs)`` as one
Ray task (Ray places it; nothing here schedules), inside a ``tracerl.rollout`` scope opened on that
worker: capture's hooks record the model calls there, against the model's ``inference_base_url``
(a :class:`~tracerl.cluster.ray_replicas.RayReplicas` router, a vLLM server...), and the task returns
the :class:`~tracerl.Trajectory`.  The ART shape is unchanged::

    rollout_on_cluster = tracerl.cluster.RayRollouts(num_cpus=1).remote(rollout)
    groups = await tracerl.gather_trajectory_groups(
        tracerl.TrajectoryGroup(rollout_on_cluster(model, task) for _ in range(8)) for task in batch.items)

What comes back, and why:

* ``fn`` returns a ``Trajectory`` (ART style, built by hand): that one.  Anything else is taken as
  ``tracerl.trajectory`` takes it (a number is the reward) and the captured trajectory is returned.
* ``fn`` raises: the original exception is raised here (its remote traceback attached as a note),
  so the group records it under its own type; an infrastructure failure capture noticed on the
  worker (the inference server dropped the connection, even if ``fn`` swallowed it) is the typed
  :class:`~tracerl.errors.InfrastructureError` it is on one machine.
* Ray lost the task (its worker process died, its node left, it could not be placed):
  :class:`~tracerl.errors.RolloutWorkerError`, an infrastructure failure, never a trajectory.
  ``max_retries`` lets Ray re-run such a task instead (default 0: re-sampling is a new attempt).
* The call is cancelled (``rollout_timeout``): the task is cancelled too (``ray.cancel``).

Models among the arguments travel as :class:`ShippedModel`: the endpoint, key and the served name
*pinned when the rollout starts* (``name@step``), never the backend, which stays on this machine.
The group id travels too, so the router keeps a group's requests on one replica.  ``fn`` is pickled
by Ray (cloudpickle): define it in a module the workers can import (``runtime_env={"py_modules": ...}``)
or register that module with ``ray.cloudpickle.register_pickle_by_value``.  Needs ``tracerl[ray]``
and a running Ray (``ray.init()``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import signal
import threading
from typing import Any, Awaitable, Callable

from ..errors import ConfigError, InfrastructureError, RolloutWorkerError
from ..model import Model
from ..types import Trajectory, current_group_id, group_scope

RolloutFn = Callable[..., Awaitable[Any]]


class ShippedModel(Model):
    """What a rollout on another node sees of a model: its endpoint and served name, no backend.

    The name is pinned when the rollout starts (a trainable model's ``name@step`` of that moment),
    as a rollout on this machine would read it; ``trainable`` is kept, so capture asks the server
    for token ids and logprobs."""

    def __init__(self, model: Model) -> None:
        super().__init__(
            model.name,
            model.project,
            inference_base_url=model.inference_base_url,
            inference_api_key=model.inference_api_key,
            inference_model_name=model.get_inference_name(),
            inference_timeout=model.inference_timeout,
        )
        self.trainable = model.trainable
        self.base_model: str | None = getattr(model, "base_model", None)


def _shipped(value: Any) -> Any:
    return ShippedModel(value) if isinstance(value, Model) and not isinstance(value, ShippedModel) else value


async def _captured(fn: RolloutFn, args: tuple[Any, ...], kwargs: dict[str, Any], group: str | None) -> Trajectory:
    """On the worker: run ``fn`` in a rollout scope of the caller's group; return its trajectory."""
    from tracerl.integrations.rollout import Rollout

    group_scope(group)  # the router's group affinity header and the rollout's group, as at home
    model = next((v for v in (*args, *kwargs.values()) if isinstance(v, Model)), None)
    async with Rollout(model, group=group, name=getattr(fn, "__name__", None)) as scope:
        result = await fn(*args, **kwargs)
        if not isinstance(result, Trajectory):
            scope._take_result(result)
    if isinstance(result, Trajectory):
        return result
    assert scope.trajectory is not None
    return scope.trajectory


async def _cancellable(rollout: Awaitable[Trajectory]) -> Trajectory:
    """Await ``rollout``; ``ray.cancel`` (which interrupts the worker's main thread as a SIGINT would)
    cancels it, so its ``async with`` blocks unwind (an interrupt alone would wait for the loop to wake)."""
    task = asyncio.current_task()
    assert task is not None
    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, task.cancel)
    except (ValueError, RuntimeError, NotImplementedError):  # not the main thread: Ray's interrupt as it is
        pass
    return await rollout


def _run_in_worker(fn: RolloutFn, args: tuple[Any, ...], kwargs: dict[str, Any], group: str | None) -> Trajectory:
    """The Ray task's body (a sync function: Ray runs plain tasks; the rollout gets its own event loop)."""
    previous = signal.getsignal(signal.SIGINT)
    try:
        return asyncio.run(_cancellable(_captured(fn, args, kwargs, group)))
    finally:
        if threading.current_thread() is threading.main_thread() and previous is not None:
            signal.signal(signal.SIGINT, previous)  # Ray's own handler, for the worker's next task


def original_error(error: Any) -> BaseException:
    """The exception the rollout raised on the worker, with the worker's traceback as a note."""
    cause = getattr(error, "cause", None)
    if not isinstance(cause, Exception):
        return error  # not picklable on the worker: Ray's wrapper carries the type name and traceback
    cause.add_note(f"raised in a Ray task (pid {getattr(error, 'pid', '?')}, {getattr(error, 'ip', '?')}):\n"
                   f"{getattr(error, 'traceback_str', '')}")
    return cause


class RayRollouts:
    """Runs rollout functions as Ray tasks (see the module doc); ``remote(fn)`` gives the wrapped function."""

    def __init__(
        self,
        *,
        num_cpus: float = 1,
        num_gpus: float = 0,
        max_retries: int = 0,
        scheduling_strategy: Any = "SPREAD",
        runtime_env: dict[str, Any] | None = None,
    ) -> None:
        """``num_cpus``/``num_gpus``: what one rollout task reserves; ``scheduling_strategy``: Ray's
        (default ``"SPREAD"`` over the nodes); ``runtime_env``: Ray's (e.g. ``py_modules`` with the agent)."""
        if max_retries < 0:
            raise ConfigError(f"max_retries must be >= 0, got {max_retries}")
        self.options: dict[str, Any] = dict(num_cpus=num_cpus, num_gpus=num_gpus, max_retries=max_retries,
                                            scheduling_strategy=scheduling_strategy)
        if runtime_env:
            self.options["runtime_env"] = runtime_env
        self._task: Any = None

    def remote(self, fn: RolloutFn) -> Callable[..., Awaitable[Trajectory]]:
        """``fn`` (an ``async def`` rollout) as a function whose calls run on the cluster."""
        if not inspect.iscoroutinefunction(fn):
            raise ConfigError(f"RayRollouts.remote needs an async rollout function, got {fn!r}")

        @functools.wraps(fn)
        async def on_cluster(*args: Any, **kwargs: Any) -> Trajectory:
            return await self.run(fn, *args, **kwargs)

        return on_cluster

    async def run(self, fn: RolloutFn, *args: Any, **kwargs: Any) -> Trajectory:
        """Run one rollout ``fn(*args, **kwargs)`` as a Ray task and return its trajectory (see the module doc)."""
        import ray
        from ray.exceptions import RayError, RayTaskError

        if not ray.is_initialized():
            raise InfrastructureError("Ray is not running here: call ray.init() (or ray.init(address=...)) first")
        if self._task is None:
            self._task = ray.remote(_run_in_worker).options(**self.options)
        ref = self._task.remote(fn, tuple(_shipped(a) for a in args), {k: _shipped(v) for k, v in kwargs.items()},
                                current_group_id())
        try:
            return await ref
        except asyncio.CancelledError:
            ray.cancel(ref)  # the worker's event loop is interrupted: the rollout's async-with blocks unwind
            raise
        except RayTaskError as error:
            raise original_error(error) from None
        except RayError as error:  # WorkerCrashedError, NodeDiedError, ObjectLostError, TaskCancelledError...
            raise RolloutWorkerError(
                f"the Ray task running rollout {getattr(fn, '__name__', fn)!r} was lost: {type(error).__name__}: {error}"
            ) from error
