"""What a judge returns, and the ``Judge`` interface (DESIGN §4)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterable, Protocol, runtime_checkable

from tracerl.types import TrajectoryGroup

from .rubric import DEFAULT_RUBRIC_VERSION


@dataclass(frozen=True)
class TrajectoryScore:
    """The judge's verdict on one trajectory."""

    trajectory_id: str
    """``"1"``…``"N"`` in input order for :func:`ruler`; ``Trajectory.id`` for a group."""
    score: float
    """In [0, 1]; the mean over the orders the group was shown in."""
    explanation: str
    rubric_version: str = DEFAULT_RUBRIC_VERSION
    """Which instructions produced the score (scores under different versions do not compare)."""
    judge: str = ""
    """Which judge produced it (model, and endpoint where one was given)."""
    scores_by_order: tuple[float, ...] = ()
    """The score in each order shown (``num_orders`` values)."""

    @property
    def order_spread(self) -> float:
        """Population std of the score across orders (0 with one order): the judge's position noise."""
        return statistics.pstdev(self.scores_by_order) if len(self.scores_by_order) > 1 else 0.0


class RulerScores(list):
    """A plain ``list[TrajectoryScore]`` in input order, plus ``metrics`` about the judging.

    ``metrics`` keys (all numbers): ``ruler_judge_requests``, ``ruler_cache_hits``,
    ``ruler_corrective_retries``, ``ruler_judge_prompt_tokens``,
    ``ruler_judge_completion_tokens``, ``ruler_judge_cost_usd`` (only where the price
    is known), ``ruler_num_orders``, ``ruler_unique_trajectories``,
    ``ruler_order_spread`` (mean over trajectories) and ``ruler_order_spread_max``.
    """

    metrics: dict[str, float]
    judge_trace_id: str | None
    """The trace of the judge call (when exported), linked from each trace it scored."""

    def __init__(self, scores: Iterable[TrajectoryScore] = (), metrics: dict[str, float] | None = None) -> None:
        super().__init__(scores)
        self.metrics = dict(metrics or {})
        self.judge_trace_id = None


@runtime_checkable
class Judge(Protocol):
    """Scores the trajectories of a group relative to each other.

    ``score_group`` returns one :class:`TrajectoryScore` per trajectory, in the group's
    order, with ``trajectory_id == trajectory.id``; :func:`tracerl.ruler.apply_scores`
    writes them onto a copy of the group.  :class:`tracerl.ruler.RulerJudge` is the
    default implementation.
    """

    async def score_group(self, group: TrajectoryGroup) -> list[TrajectoryScore]: ...
