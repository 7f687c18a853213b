"""Trajectories with nothing to train on: ``backend.train`` names them and says why.

Only sampled turns (:class:`~tracerl.types.Choice`) carry a gradient.  A trajectory without
one is almost always a set-up mistake, not a policy outcome: its rollout captured no model
call (capture off, a client tracerl has no hook for, a thread without the copied context),
or it was built by hand from plain message dicts.  Training on a batch of them used to
advance the step with the adapter unchanged and no word; now a call where no trajectory has
a sampled turn raises :class:`~tracerl.errors.TrajectoryError` naming them with the likely
cause, and a call where only some lack one logs a warning naming those and counts them
(``metrics["trajectories_without_sampled_turns"]``).  Only groups whose rewards differ are
looked at: a group of equal rewards trains nothing whatever it holds, and a step made only
of such groups advances unchanged as documented.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from ..errors import TrajectoryError
from ..types import Trajectory
from ..validation import describe_trajectory

log = logging.getLogger("tracerl.train")

NAMED = 5
"""Trajectories named in one message; the rest are counted."""


def why_not_sampled(trajectory: Trajectory) -> str:
    """The likely cause of a trajectory having no sampled turn (read from what capture left in it)."""
    messages = [m for h in trajectory.histories() for m in h.messages_and_choices]
    captured = "capture_model_calls" in trajectory.metrics
    warned = next((line for line in trajectory.logs if line.startswith("tracerl: ")), None)
    if warned is not None:
        return warned.removeprefix("tracerl: ")
    if captured and not messages:
        return (
            "its rollout captured no model call: the model was called through a client tracerl has no hook for, "
            "on a thread that did not copy the context, or not at all"
        )
    if any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages):
        return (
            "its assistant turns are plain message dicts, not sampled turns: wrap what the model sampled in "
            "tracerl.Choice (Choice.from_openai(choice, completion) from a model served by tracerl carries the exact "
            "token ids; a Choice without them trains with allow_retokenize=True)"
        )
    if not messages:
        return "it is empty"
    return "it holds no assistant turn"


def check_sampled_turns(groups: Sequence[Any]) -> int:
    """Raise when no trajectory of ``groups`` has a sampled turn; else warn about those without one.

    Returns how many trajectories have none.
    """
    missing: list[tuple[str, str]] = []
    total = 0
    for g, group in enumerate(groups):
        if not _rewards_differ(group):
            continue
        for i, trajectory in enumerate(getattr(group, "trajectories", ())):  # other types: check_groups names them
            total += 1
            if isinstance(trajectory, Trajectory) and not trajectory.sampled_turns():
                missing.append((describe_trajectory(g, group, i, trajectory), why_not_sampled(trajectory)))
    if not missing:
        return 0
    named = "; ".join(f"{where}: {why}" for where, why in missing[:NAMED])
    more = f"; and {len(missing) - NAMED} more" if len(missing) > NAMED else ""
    if len(missing) == total:
        raise TrajectoryError(
            f"nothing to train on: none of the {total} trajectories has a sampled turn (a tracerl.Choice, what the "
            f"model generated). {named}{more}"
        )
    log.warning("%d of %d trajectories have no sampled turn and train nothing: %s%s", len(missing), total, named, more)
    return len(missing)


def _rewards_differ(group: Any) -> bool:
    """Whether GRPO would train on ``group`` (equal rewards give every member a zero advantage)."""
    rewards = {getattr(t, "reward", None) for t in getattr(group, "trajectories", ())}
    return len(rewards) > 1
