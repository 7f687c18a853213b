"""RULER on trajectory groups: :class:`RulerJudge` (the default ``Judge``) and ``ruler_score_group``.

Scoring a group writes, on a copy of each trajectory: ``reward`` = the judge's score,
``metrics["ruler_score"]`` (same value), ``metrics["independent_reward"]`` (the reward
it had before, e.g. a verifiable one), ``metrics["ruler_order_spread"]`` (with several
orders), ``metadata["ruler"]`` (score, explanation, rubric version, judge, per-order
scores) and one line in ``logs``.  The judging metrics (requests, tokens, cost, cache
hits, spread) go into the group's ``metrics``, so ``model.log`` averages them into
``history.jsonl`` as ``{split}/group_ruler_…``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from tracerl.errors import JudgeError
from tracerl.types import TrajectoryGroup

from .judge import candidate_from, judge_candidates
from .rubric import DEFAULT_RUBRIC
from .types import RulerScores, TrajectoryScore

logger = logging.getLogger("tracerl.ruler")

DEFAULT_JUDGE_MODEL = "openai/o3"

on_scores_applied: list[Callable[[TrajectoryGroup], None]] = []
"""Called with each group :func:`apply_scores` returns (``tracerl.integrations.export_scores`` registers here)."""


def group_name(group: TrajectoryGroup) -> str | None:
    for key in ("name", "task", "task_id", "scenario_id", "id"):
        value = group.metadata.get(key)
        if isinstance(value, (str, int)) and str(value):
            return str(value)
    return None


def apply_scores(group: TrajectoryGroup, scores: Sequence[TrajectoryScore]) -> TrajectoryGroup:
    """A copy of ``group`` with the scores as rewards (see the module docstring for what is written)."""
    if [s.trajectory_id for s in scores] != [t.id for t in group.trajectories]:
        raise JudgeError(
            f"scores do not match the group's trajectories: got ids {[s.trajectory_id for s in scores]}, "
            f"expected {[t.id for t in group.trajectories]}"
        )
    scored = []
    for trajectory, score in zip(group.trajectories, scores):
        copy = trajectory.model_copy(deep=True)
        copy.metrics["independent_reward"] = trajectory.reward
        copy.metrics["ruler_score"] = score.score
        if len(score.scores_by_order) > 1:
            copy.metrics["ruler_order_spread"] = score.order_spread
        copy.reward = score.score
        copy.metadata["ruler"] = {
            "score": score.score,
            "explanation": score.explanation,
            "rubric_version": score.rubric_version,
            "judge": score.judge,
            "scores_by_order": list(score.scores_by_order),
        }
        if getattr(scores, "judge_trace_id", None):
            copy.metadata["ruler"]["judge_trace_id"] = scores.judge_trace_id
        copy.logs.append(f"RULER {score.score:.3f} by {score.judge} ({score.rubric_version}): {score.explanation}")
        scored.append(copy)
    metrics = dict(group.metrics)
    metrics.update(getattr(scores, "metrics", {}))
    result = TrajectoryGroup(
        scored, exceptions=list(group.exceptions), metadata=dict(group.metadata), metrics=metrics, logs=list(group.logs)
    )
    for hook in on_scores_applied:
        try:
            hook(result)
        except Exception:  # noqa: BLE001 - exporting scores must never break judging
            logger.warning("a score hook failed", exc_info=True)
    return result


class RulerJudge:
    """The default :class:`~tracerl.ruler.Judge`; also usable directly as ``after_each``.

    ``await judge.score_group(group)`` returns the scores; ``await judge(group)`` returns
    the scored copy of the group (or ``None`` when judging failed and
    ``swallow_exceptions`` is set, which ``gather_trajectory_groups`` counts as dropped).
    """

    def __init__(
        self,
        judge_model: Any = DEFAULT_JUDGE_MODEL,
        *,
        rubric: str = DEFAULT_RUBRIC,
        extra_litellm_params: dict[str, Any] | None = None,
        debug: bool = False,
        num_orders: int = 1,
        cache: Any = True,
        seed: int | None = None,
        swallow_exceptions: bool = False,
    ) -> None:
        self.judge_model = judge_model
        self.rubric = rubric
        self.extra_litellm_params = extra_litellm_params
        self.debug = debug
        self.num_orders = num_orders
        self.cache = cache
        self.seed = seed
        self.swallow_exceptions = swallow_exceptions

    async def score_group(self, group: TrajectoryGroup) -> RulerScores:
        """One score per trajectory (``trajectory_id == trajectory.id``); raises ``JudgeError``.

        The judge call is traced as an evaluator (``tracerl.integrations.export.evaluations``).
        """
        from tracerl.integrations.export.evaluations import judge_observation

        with judge_observation(group) as record:
            scores = await judge_candidates(
                [candidate_from(t) for t in group.trajectories],
                [t.id for t in group.trajectories],
                self.judge_model,
                rubric=self.rubric,
                extra_litellm_params=self.extra_litellm_params,
                debug=self.debug,
                num_orders=self.num_orders,
                cache=self.cache,
                seed=self.seed,
                group_name=group_name(group),
            )
            scores.judge_trace_id = record(scores)
        return scores

    async def __call__(self, group: TrajectoryGroup) -> TrajectoryGroup | None:
        if not group.trajectories:
            return group  # every rollout failed: nothing to judge, the exceptions stay recorded
        try:
            return apply_scores(group, await self.score_group(group))
        except JudgeError as error:
            if not self.swallow_exceptions:
                raise
            logger.warning("RULER dropped a group: %s", error)
            return None

    def __repr__(self) -> str:
        return f"RulerJudge({self.judge_model!r}, num_orders={self.num_orders}, cache={self.cache!r})"


async def ruler_score_group(
    group: TrajectoryGroup,
    judge_model: Any = DEFAULT_JUDGE_MODEL,
    *,
    rubric: str = DEFAULT_RUBRIC,
    extra_litellm_params: dict[str, Any] | None = None,
    debug: bool = False,
    swallow_exceptions: bool = False,
    num_orders: int = 1,
    cache: Any = True,
    seed: int | None = None,
) -> TrajectoryGroup | None:
    """Score a group with RULER and return a scored copy (the judge score becomes ``reward``).

    Works as ``after_each`` in :func:`tracerl.gather_trajectory_groups` (bind the judge
    with ``functools.partial`` or use :class:`RulerJudge`).  With ``swallow_exceptions``
    a group the judge cannot score is dropped (``None``) instead of raising ``JudgeError``.
    """
    judge = RulerJudge(
        judge_model,
        rubric=rubric,
        extra_litellm_params=extra_litellm_params,
        debug=debug,
        num_orders=num_orders,
        cache=cache,
        seed=seed,
        swallow_exceptions=swallow_exceptions,
    )
    return await judge(group)
