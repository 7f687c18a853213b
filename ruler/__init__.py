"""RULER: a relative LLM judge for trajectory groups.

One judge call scores the N trajectories of a group relative to each other (GRPO only
uses within-group differences).  Beyond the reference design: shuffled, optionally
averaged orders (position bias), one corrective re-ask then a clear ``JudgeError``, an
on-disk content-hash cache, judge tokens/cost in the metrics, rubric versions.

``import tracerl.ruler`` is light: LiteLLM is imported on the first judge call.
"""

from __future__ import annotations

from .cache import RulerCache
from .client import JudgeEndpoint
from .group import DEFAULT_JUDGE_MODEL, RulerJudge, apply_scores, ruler_score_group
from .judge import ruler
from .rubric import DEFAULT_RUBRIC, DEFAULT_RUBRIC_VERSION, rubric_version
from .types import Judge, RulerScores, TrajectoryScore

__all__ = [
    "DEFAULT_JUDGE_MODEL",
    "DEFAULT_RUBRIC",
    "DEFAULT_RUBRIC_VERSION",
    "Judge",
    "JudgeEndpoint",
    "RulerCache",
    "RulerJudge",
    "RulerScores",
    "TrajectoryScore",
    "apply_scores",
    "rubric_version",
    "ruler",
    "ruler_score_group",
]
