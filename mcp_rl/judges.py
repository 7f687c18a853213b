"""Judges for MCP•RL that need no LLM: rewards checked in code.

:class:`ExpectedAnswerJudge` is a :class:`tracerl.ruler.Judge` (``score_group``) whose
score for each trajectory comes from a function ``reward(task, trajectory)``; ``task`` is
the :class:`~tracerl.mcp_rl.Scenario` the trajectory attempted (its ``metadata`` holds
what the check needs, e.g. ``{"answer": "82"}``).  The default reward is
:func:`final_answer_matches`.  The judge is also an ``after_each`` for
``gather_trajectory_groups`` (``await judge(group)`` returns the scored copy), and
``train_mcp_agent(..., judge=judge)`` takes it in place of RULER.

:func:`as_after_each` turns any ``Judge`` into an ``after_each`` that drops a group the
judge cannot score (``JudgeError``) instead of failing the gather.
"""

from __future__ import annotations

import inspect
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Union

from tracerl.errors import JudgeError
from tracerl.ruler import TrajectoryScore, apply_scores
from tracerl.ruler.group import group_name
from tracerl.types import Trajectory, TrajectoryGroup

from .scenarios import Scenario

logger = logging.getLogger("tracerl.mcp_rl")


@dataclass(frozen=True)
class Reward:
    """What a reward function may return instead of a bare number."""

    score: float
    explanation: str = ""
    metrics: Mapping[str, float] = field(default_factory=dict)
    """Extra per-trajectory numbers (e.g. ``{"tool_call_ok": 1.0}``), written to ``trajectory.metrics``."""


RewardValue = Union[float, int, tuple, Reward]
RewardFn = Callable[[Scenario, Trajectory], Union[RewardValue, Awaitable[RewardValue]]]


@dataclass(frozen=True)
class VerifiedScore(TrajectoryScore):
    """A :class:`TrajectoryScore` from a reward function, with the function's extra metrics."""

    metrics: Mapping[str, float] = field(default_factory=dict)


def task_of(trajectory: Trajectory, group: TrajectoryGroup | None = None) -> Scenario:
    """The scenario a trajectory attempted, from its metadata (``run_mcp_agent`` writes
    ``task`` and ``scenario_metadata``), else from the group's ``task`` / ``scenario``."""
    meta = trajectory.metadata
    group_meta = group.metadata if group is not None else {}
    if isinstance(group_meta.get("scenario"), dict) and "task" not in meta:
        return Scenario.from_json(group_meta["scenario"])
    task = meta.get("task", group_meta.get("task", ""))
    return Scenario(task=str(task if task is not None else ""), metadata=dict(meta.get("scenario_metadata") or {}))


def final_answer(trajectory: Trajectory) -> str:
    """The text of the last assistant message ('' when the agent never answered in words)."""
    for message in reversed(trajectory.messages()):
        if message.get("role") == "assistant":
            return "" if message.get("tool_calls") else str(message.get("content") or "")
    return ""


def mentions(text: str, expected: Any) -> bool:
    """``expected`` occurs in ``text`` as a whole token (``82`` matches "is 82." not "182")."""
    needle = re.escape(str(expected).strip())
    return bool(needle) and re.search(rf"(?<![\w.]){needle}(?![\w]|\.\d)", text, flags=re.IGNORECASE) is not None


def final_answer_matches(task: Scenario, trajectory: Trajectory) -> Reward:
    """1.0 when the final answer contains ``task.metadata["answer"]``, else 0.0."""
    if "answer" not in task.metadata:
        raise JudgeError(f"scenario {task.task!r} has no metadata['answer'] to check against")
    answer = final_answer(trajectory)
    ok = mentions(answer, task.metadata["answer"])
    return Reward(float(ok), f"final answer {'contains' if ok else 'lacks'} {task.metadata['answer']!r}: {answer[:80]!r}")


def as_reward(value: Any) -> Reward:
    """A reward function's result (number, ``(score, explanation)`` or :class:`Reward`) as a Reward."""
    if isinstance(value, Reward):
        reward = value
    elif isinstance(value, tuple) and len(value) == 2:
        reward = Reward(value[0], str(value[1]))
    else:
        reward = Reward(value)
    if isinstance(reward.score, bool) or not isinstance(reward.score, (int, float)) or not math.isfinite(reward.score):
        raise JudgeError(f"a reward must be a finite number, got {reward.score!r}")
    return Reward(float(reward.score), reward.explanation, dict(reward.metrics))


class ExpectedAnswerJudge:
    """A verifiable :class:`~tracerl.ruler.Judge`: ``reward(task, trajectory)`` scores each trajectory.

    ``reward`` returns a number, ``(number, explanation)`` or a :class:`Reward` (sync or
    async); it must not modify the trajectory.  Scoring writes, on a copy of each
    trajectory: ``reward``, ``metrics["verified_reward"]``, ``metrics["independent_reward"]``
    (the reward before), the function's extra metrics, ``metadata["judge"]`` and a log
    line.  A failing reward function raises ``JudgeError`` naming the group (with
    ``swallow_exceptions``, ``await judge(group)`` drops the group instead).
    """

    def __init__(self, reward: RewardFn = final_answer_matches, *, name: str = "expected-answer", swallow_exceptions: bool = False) -> None:
        self.reward = reward
        self.name = name
        self.swallow_exceptions = swallow_exceptions

    async def score_group(self, group: TrajectoryGroup) -> list[TrajectoryScore]:
        return [await self._score(group, t) for t in group.trajectories]

    async def _score(self, group: TrajectoryGroup, trajectory: Trajectory) -> VerifiedScore:
        try:
            value = self.reward(task_of(trajectory, group), trajectory)
            reward = as_reward(await value if inspect.isawaitable(value) else value)
        except Exception as error:  # noqa: BLE001 - named and re-raised as the judge's failure
            where = f"group {group_name(group)!r}" if group_name(group) else "a group"
            raise JudgeError(f"{self.name}: the reward function failed on {where}: {type(error).__name__}: {error}") from error
        return VerifiedScore(trajectory.id, reward.score, reward.explanation, rubric_version=f"verifiable:{self.name}", judge=self.name, metrics=reward.metrics)

    def apply_scores(self, group: TrajectoryGroup, scores: list[TrajectoryScore]) -> TrajectoryGroup:
        """A copy of ``group`` with the scores as rewards (see the class docstring)."""
        if [s.trajectory_id for s in scores] != [t.id for t in group.trajectories]:
            raise JudgeError("scores do not match the group's trajectories")
        scored = []
        for trajectory, score in zip(group.trajectories, scores):
            copy = trajectory.model_copy(deep=True)
            copy.metrics.update(getattr(score, "metrics", {}))
            copy.metrics.update(independent_reward=trajectory.reward, verified_reward=score.score)
            copy.reward = score.score
            copy.metadata["judge"] = {"judge": score.judge, "score": score.score, "explanation": score.explanation}
            copy.logs.append(f"{score.judge} {score.score:.3f}: {score.explanation}")
            scored.append(copy)
        return TrajectoryGroup(
            scored, exceptions=list(group.exceptions), metadata=dict(group.metadata), metrics=dict(group.metrics), logs=list(group.logs)
        )

    async def __call__(self, group: TrajectoryGroup) -> TrajectoryGroup | None:
        return await as_after_each(self, swallow_exceptions=self.swallow_exceptions)(group)

    def __repr__(self) -> str:
        return f"ExpectedAnswerJudge({getattr(self.reward, '__name__', self.reward)!r}, name={self.name!r})"


def as_after_each(judge: Any, *, swallow_exceptions: bool = True) -> Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup | None]]:
    """An ``after_each`` for ``gather_trajectory_groups`` from any ``Judge``.

    Scores the group with ``judge.score_group`` and writes the scores with the judge's own
    ``apply_scores`` when it has one (else RULER's).  A ``JudgeError`` drops the group
    (``None``) when ``swallow_exceptions``, else propagates.  A group whose every rollout
    failed is passed through unjudged.
    """
    apply: Callable[..., TrajectoryGroup] = getattr(judge, "apply_scores", None) or apply_scores

    async def after_each(group: TrajectoryGroup) -> TrajectoryGroup | None:
        if not group.trajectories:
            return group
        try:
            return apply(group, await judge.score_group(group))
        except JudgeError as error:
            if not swallow_exceptions:
                raise
            logger.warning("judge %r dropped a group: %s", judge, error)
            return None

    return after_each
