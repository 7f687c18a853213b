"""The pipelined loop: rollouts keep running on the current policy while the next step trains.

The synchronous loop (gather a batch, ``backend.train``, repeat) leaves the trainer idle while
rollouts wait on tools, and the rollouts idle while the trainer runs.  Here group rollouts run
as background tasks and the trainer takes a batch as soon as ``groups_per_step`` fresh groups
are ready.  What keeps it honest:

- **Version tags.** Every sampled turn names the policy that sampled it (``Choice.model``,
  ``name@step``, as the server answered).  A group's version is its oldest turn's.
- **Bounded staleness.** A group trained from checkpoint ``s`` that an older policy ``v``
  sampled is ``s - v`` steps stale; past ``max_staleness`` it is dropped and counted
  (``groups_dropped_stale``).  Pacing keeps drops rare: while a step trains, at most
  ``groups_per_step * max_staleness`` groups are in flight, otherwise one batch more — so
  ``max_staleness=0`` is the synchronous loop.
- **Off-policy correction.** ``backend.train`` weights stale turns by a truncated importance
  ratio (:func:`tracerl.train.grpo.policy_loss`); its diagnostics land in the step's row.
- **Checkpoint retention** (:mod:`tracerl.loops.retention`) never deletes the served
  checkpoint, the one training starts from, or one an in-flight group samples from.
- **Policy leases.** Each group holds its start step's policy served while it runs (where the
  backend can: ``LocalBackend.policy_lease``), so an agent that pinned the name finishes.
- **Resume.** Each step's row records how many scenarios had been started
  (``train/scenario_offset``); a rerun after a kill continues from there and from the newest
  complete checkpoint.  The groups in flight at the kill are not trained; none is trained twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Iterator, Literal

from ..errors import ConfigError
from ..gather import gather_trajectory_groups
from ..model import Backend, TrainableModel
from ..train.step_config import StepConfig
from ..types import Trajectory, TrajectoryGroup
from ..validation import TRAIN_OPTIONS, check_train_arguments
from .retention import RetentionPolicy, apply_retention

log = logging.getLogger("tracerl.pipeline")

RolloutFn = Callable[[TrainableModel, Any, Any], Awaitable[TrajectoryGroup] | TrajectoryGroup]
"""``rollout_fn(model, scenario, config)``: one group of rollouts of one scenario (ART's signature)."""
EvalFn = Callable[[TrainableModel, int], Awaitable[Iterable[TrajectoryGroup | Trajectory]]]
"""``eval_fn(model, step)``: held-out groups or trajectories, logged with split ``val``."""

OFFSET_METRIC = "scenario_offset"


@dataclass
class _Ready:
    group: TrajectoryGroup
    started_at: int
    """The step the group started on: its version when no turn names one."""
    scenario: int


@dataclass
class PipelineReport:
    """What a :meth:`PipelineTrainer.train` call did."""

    steps: list[int] = field(default_factory=list)
    groups_trained: int = 0
    groups_dropped_stale: int = 0
    deleted_checkpoints: list[int] = field(default_factory=list)
    seconds: float = 0.0
    train_seconds: float = 0.0
    """Time inside ``backend.train``: the trainer's utilisation is ``train_seconds / seconds``."""


class PipelineTrainer:
    """Overlap rollouts and training with bounded staleness; same rollout functions, same ``backend.train``.

    ``rollout_fn(model, scenario, config)`` returns (or is a coroutine returning) a
    :class:`~tracerl.TrajectoryGroup`, possibly of pending rollouts as with
    ``TrajectoryGroup(rollout(...) for _ in range(n))``; its failed rollouts count against
    ``max_exceptions`` (a fraction or a number per group) as in :func:`~tracerl.gather_trajectory_groups`.
    The step settings (``learning_rate`` to ``on_non_finite``) are ``backend.train``'s, with its
    defaults and checks (:class:`~tracerl.train.step_config.StepConfig`; docs/training.md, "What
    backend.train does"): a bad one fails here, before any rollout.  Each step passes the ones that
    differ from the defaults to ``backend.train``.  ``train_kwargs``: the same settings as a dict (a
    setting given both ways is a ``TypeError``) and any keyword a backend of your own takes besides;
    one ``backend.train`` does not take is a ``TypeError`` here.  ``eval_fn`` runs at the start and every ``eval_every_n_steps``;
    ``stop()``, checked after each step and its eval, ends the run early (a held-out target reached).
    ``pbar_desc``: the step bar's label (None: no bar).
    """

    def __init__(
        self,
        model: TrainableModel,
        backend: Backend,
        rollout_fn: RolloutFn,
        scenarios: Iterable[Any],
        config: Any = None,
        eval_fn: EvalFn | None = None,
        *,
        groups_per_step: int = 2,
        max_steps: int,
        max_staleness: int = 1,
        learning_rate: float = StepConfig.learning_rate,
        loss_fn: Literal["cispo", "ppo"] = StepConfig.loss_fn,
        epsilon: float | None = StepConfig.epsilon,
        epsilon_high: float | None = StepConfig.epsilon_high,
        importance_sampling_level: Literal["token", "sequence"] = StepConfig.importance_level,
        kl_penalty_coef: float = StepConfig.kl_penalty_coef,
        max_grad_norm: float = StepConfig.max_grad_norm,
        off_policy_cap: float | None = StepConfig.off_policy_cap,
        max_mismatch_kl: float | None = StepConfig.max_mismatch_kl,
        mismatch_correction: Literal["none", "tis", "mis"] = StepConfig.mismatch_correction,
        mismatch_cap: float = StepConfig.mismatch_cap,
        scale_rewards: bool = True,
        allow_retokenize: bool = False,
        on_non_finite: Literal["raise", "skip"] = "raise",
        train_kwargs: dict[str, Any] | None = None,
        eval_every_n_steps: int = 0,
        checkpoint_retention: RetentionPolicy | None = None,
        max_exceptions: int | float = 0.25,
        rollout_timeout: float | None = None,
        stop: Callable[[], bool] | None = None,
        pbar_desc: str | None = "pipeline",
    ) -> None:
        for name, value, least in (("groups_per_step", groups_per_step, 1), ("max_steps", max_steps, 0),
                                   ("max_staleness", max_staleness, 0), ("eval_every_n_steps", eval_every_n_steps, 0)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"{name} must be an integer >= {least}, got {value!r}")
        self.model, self.backend, self.rollout_fn, self.config, self.eval_fn = model, backend, rollout_fn, config, eval_fn
        self.scenarios = scenarios
        self.groups_per_step, self.max_steps, self.max_staleness = groups_per_step, max_steps, max_staleness
        given = dict(
            learning_rate=learning_rate, loss_fn=loss_fn, epsilon=epsilon, epsilon_high=epsilon_high,
            importance_sampling_level=importance_sampling_level, kl_penalty_coef=kl_penalty_coef, max_grad_norm=max_grad_norm,
            off_policy_cap=off_policy_cap, max_mismatch_kl=max_mismatch_kl, mismatch_correction=mismatch_correction,
            mismatch_cap=mismatch_cap, scale_rewards=scale_rewards, allow_retokenize=allow_retokenize, on_non_finite=on_non_finite,
        )  # fmt: skip
        self.train_kwargs = _train_keywords(given, dict(train_kwargs or {}))
        inspect.signature(backend.train).bind(model, [], **self.train_kwargs)  # a keyword the backend does not take: TypeError now
        expect_staleness = getattr(backend, "expect_staleness", None)  # LocalBackend: vLLM's LoRA slots for every policy served
        if expect_staleness is not None:
            expect_staleness(model, max_staleness)
        self.eval_every_n_steps = eval_every_n_steps
        self.checkpoint_retention = checkpoint_retention
        self.max_exceptions, self.rollout_timeout = max_exceptions, rollout_timeout
        self.stop = stop
        self.pbar_desc = pbar_desc
        self._ready: list[_Ready] = []
        self._running: dict[asyncio.Task[_Ready], int] = {}  # task -> the step it started on
        self._failed: list[BaseException] = []  # a group whose rollouts failed past max_exceptions
        self._arrived = asyncio.Event()
        self._training = False
        self._scenarios_started = 0

    # -- the loop -------------------------------------------------------------------
    async def train(self) -> PipelineReport:
        """Run until ``max_steps`` (counted from step 0, so a resumed run ends at the same step) or the scenarios run out."""
        started = time.monotonic()
        report = PipelineReport()
        step = await self.model.get_step()
        offset = _resumed_offset(self.model.history())
        scenarios = _skip(iter(self.scenarios), offset)
        await self._evaluate(step, at_start=True)
        bar = _step_bar(self.max_steps, step, self.pbar_desc)
        try:
            while step < self.max_steps:
                self._start_groups(scenarios, step)
                batch, dropped, waited = await self._next_batch(step, scenarios)
                report.groups_dropped_stale += dropped
                if not batch:
                    log.info("pipeline: the scenarios ran out at step %d", step)
                    break
                staleness = [step - self._version(item) for item in batch]
                self._training = True
                self._start_groups(scenarios, step)  # what may overlap this step starts now
                training = time.monotonic()
                try:
                    result = await self.backend.train(self.model, [item.group for item in batch], **self.train_kwargs)
                finally:
                    self._training = False
                report.train_seconds += time.monotonic() - training
                step = result.step
                offset = self._scenarios_started
                metrics = {
                    **result.metrics,
                    "staleness_mean": statistics.fmean(staleness),
                    "staleness_max": float(max(staleness)),
                    "groups_dropped_stale": float(dropped),
                    "trainer_wait_seconds": waited,
                    "groups_in_flight": float(len(self._running)),
                    OFFSET_METRIC: float(offset),
                }
                row = await self.model.log([item.group for item in batch], split="train", metrics=metrics, step=step)
                report.steps.append(step)
                report.groups_trained += len(batch)
                if bar is not None:
                    bar.set_postfix(
                        {"reward": f"{row.get('train/reward', float('nan')):.3f}", "staleness": f"{metrics['staleness_mean']:.2f}",
                         "mismatch KL": f"{metrics.get('mismatch_kl', float('nan')):.1e}",
                         "dropped": report.groups_dropped_stale, "in flight": len(self._running)}, refresh=False,
                    )  # fmt: skip
                    bar.update(step - bar.n)
                if self.checkpoint_retention is not None:
                    report.deleted_checkpoints += await apply_retention(
                        self.model, self.backend, self.checkpoint_retention, protected=self._in_use(step)
                    )
                await self._evaluate(step)
                if self.stop is not None and self.stop():
                    log.info("pipeline: stop() is true at step %d", step)
                    break
        finally:
            if bar is not None:
                bar.close()
            await self._stop()
        report.seconds = time.monotonic() - started
        return report

    # -- rollouts -------------------------------------------------------------------
    def _capacity(self) -> int:
        """Groups that may be in flight or waiting: one batch more than training may lag behind."""
        return self.groups_per_step * (self.max_staleness + (0 if self._training else 1))

    def _start_groups(self, scenarios: Iterator[tuple[int, Any]], step: int) -> None:
        while len(self._running) + len(self._ready) < self._capacity():
            nxt = next(scenarios, None)
            if nxt is None:
                return
            index, scenario = nxt
            self._scenarios_started = index + 1
            task = asyncio.create_task(self._one_group(index, scenario, step))
            self._running[task] = step
            task.add_done_callback(self._finished)

    async def _one_group(self, index: int, scenario: Any, step: int) -> _Ready:
        async with self._lease(step):
            group = self.rollout_fn(self.model, scenario, self.config)
            if inspect.isawaitable(group):
                group = await group
            if not isinstance(group, TrajectoryGroup):
                raise ConfigError(f"rollout_fn must return a tracerl.TrajectoryGroup, got {type(group).__name__}")
            (done,) = await gather_trajectory_groups(
                [group], pbar_desc=None, max_exceptions=self.max_exceptions, rollout_timeout=self.rollout_timeout
            )
        return _Ready(done, step, index)

    def _lease(self, step: int) -> contextlib.AbstractAsyncContextManager[Any]:
        """Keep ``name@step`` served while a group that started on it runs (``LocalBackend.policy_lease``):
        an agent that pinned the name at the start gets that policy on its last turn, however many steps
        trained meanwhile, and its group is then dropped as stale rather than failed."""
        lease = getattr(self.backend, "policy_lease", None)
        return lease(self.model, step) if lease is not None else contextlib.nullcontext()

    def _finished(self, task: asyncio.Task[_Ready]) -> None:
        self._running.pop(task, None)
        if task.cancelled():
            return
        if task.exception() is not None:
            self._failed.append(task.exception())  # type: ignore[arg-type]
        else:
            self._ready.append(task.result())
        self._arrived.set()

    async def _next_batch(self, step: int, scenarios: Iterator[tuple[int, Any]]) -> tuple[list[_Ready], int, float]:
        """The oldest ``groups_per_step`` ready groups within ``max_staleness`` of ``step``; the stale
        ones met on the way are dropped.  Returns (batch, dropped, seconds waited)."""
        waited = time.monotonic()
        batch: list[_Ready] = []
        dropped = 0
        while len(batch) < self.groups_per_step:
            if self._failed:
                raise self._failed.pop(0)  # rollouts failed past max_exceptions, or rollout_fn raised: stop, as a gather does
            while self._ready and len(batch) < self.groups_per_step:
                item = self._ready.pop(0)
                if step - self._version(item) > self.max_staleness:
                    dropped += 1
                    log.info("pipeline: dropped a group %d steps stale (max_staleness=%d)", step - self._version(item), self.max_staleness)
                else:
                    batch.append(item)
            self._start_groups(scenarios, step)
            if len(batch) == self.groups_per_step or (not self._running and not self._ready):
                break
            self._arrived.clear()
            await self._arrived.wait()
        return batch, dropped, time.monotonic() - waited

    def _version(self, item: _Ready) -> int:
        """The step of the oldest policy that sampled a turn of the group (its start step if none says)."""
        steps = [
            s
            for t in item.group.trajectories
            for choice in t.sampled_turns()
            if (s := self.model.policy_step(choice.model)) is not None
        ]
        return min(steps, default=item.started_at)

    def _in_use(self, step: int) -> set[int]:
        """Checkpoints retention must keep: the served one and its predecessor (stragglers), and every in-flight version."""
        return {step, step - 1, *self._running.values(), *(self._version(item) for item in self._ready)}

    async def _stop(self) -> None:
        tasks = list(self._running)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._running.clear()

    async def _evaluate(self, step: int, *, at_start: bool = False) -> None:
        if self.eval_fn is None:
            return
        due = at_start or (self.eval_every_n_steps and step % self.eval_every_n_steps == 0) or step == self.max_steps
        if not due or any(row.get("step") == step and "val/reward" in row for row in self.model.history()):
            return
        await self.model.log(list(await self.eval_fn(self.model, step)), split="val", step=step)


def _step_bar(total: int, done: int, desc: str | None) -> Any:
    """A tqdm bar of steps (None without ``desc``): reward, staleness, train–inference mismatch, groups dropped and in flight after each."""
    if desc is None:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=min(done, total), desc=desc, unit="step", dynamic_ncols=True)


def _resumed_offset(history: list[dict[str, Any]]) -> int:
    """How many scenarios the run had started by its last logged step (0 for a new run)."""
    offsets = [row[f"train/{OFFSET_METRIC}"] for row in history if isinstance(row.get(f"train/{OFFSET_METRIC}"), (int, float))]
    return int(offsets[-1]) if offsets else 0


def _skip(scenarios: Iterator[Any], offset: int) -> Iterator[tuple[int, Any]]:
    """``(index, scenario)`` from ``offset`` on."""
    for index, scenario in enumerate(scenarios):
        if index >= offset:
            yield index, scenario


def _train_keywords(given: dict[str, Any], train_kwargs: dict[str, Any]) -> dict[str, Any]:
    """What each step passes to ``backend.train``: the settings that differ from their defaults (checked
    here), and ``train_kwargs``'s other keywords."""
    defaults = {name: param.default for name, param in inspect.signature(PipelineTrainer.__init__).parameters.items() if name in given}

    def is_default(name: str) -> bool:
        return type(given[name]) is type(defaults[name]) and given[name] == defaults[name]

    extra = {}
    for name, value in train_kwargs.items():
        if name not in given:
            extra[name] = value
        elif not is_default(name):
            raise TypeError(f"PipelineTrainer got {name!r} twice: as a keyword and in train_kwargs")
        else:
            given[name] = value
    check_train_arguments(**{name: given[name] for name in TRAIN_OPTIONS})
    StepConfig.from_train_kwargs(**{name: value for name, value in given.items() if name not in TRAIN_OPTIONS})
    return {**{name: value for name, value in given.items() if not is_default(name)}, **extra}
