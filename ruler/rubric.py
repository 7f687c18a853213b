"""The judge's instructions: the default rubric, the system prompt, and rubric versions.

A score is only comparable with scores made under the same instructions, so every
score carries a version string: ``DEFAULT_RUBRIC_VERSION`` for the shipped rubric, or
``custom-<hash>`` (a hash of the rubric text) for a user's own.
"""

from __future__ import annotations

import hashlib

PROMPT_VERSION = "1"
"""Version of the system prompt and the rendering around the rubric (bump when they change)."""

DEFAULT_RUBRIC = """\
- A trajectory that achieves its goal must always score significantly higher than one that does not.
- Among trajectories that achieve the goal, a more efficient one (fewer steps, fewer wasted tool calls, \
less needless text) scores higher than a less efficient one.
- Score gaps should be proportional to quality gaps: similar trajectories get similar scores, \
and a clearly better one gets a clearly higher score.
- Give partial credit for progress towards the goal when no trajectory fully achieves it.
- Judge what the agent actually did (its messages, tool calls and the tool results it got), \
not what it claims to have done."""
"""The shipped rubric (ART's RULER guidance, worded for tracerl)."""

DEFAULT_RUBRIC_VERSION = f"tracerl-ruler-default-v1.p{PROMPT_VERSION}"

SYSTEM_PROMPT = """\
You are a careful judge of AI agents. You will see several trajectories, each an attempt \
by an agent at the same goal, possibly after a shared context. Compare them with each other \
and give each trajectory a score between 0 and 1 (inclusive), using this rubric:

{rubric}

Answer with a single JSON object and nothing else, of the form
{{"scores": [{{"trajectory_id": "<id>", "explanation": "<one or two sentences>", "score": <number in [0, 1]>}}, ...]}}
with exactly one entry for each trajectory id shown, in any order."""


def rubric_version(rubric: str) -> str:
    """A short, stable name for the instructions a score was made under."""
    if rubric.strip() == DEFAULT_RUBRIC.strip():
        return DEFAULT_RUBRIC_VERSION
    digest = hashlib.sha256(rubric.strip().encode()).hexdigest()[:12]
    return f"custom-{digest}.p{PROMPT_VERSION}"


def system_prompt(rubric: str) -> str:
    return SYSTEM_PROMPT.format(rubric=rubric.strip())
