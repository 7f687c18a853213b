"""Which rollout the calling code runs in (a context variable, so every task and thread sees its own).

Its own module, with no imports of the package: the hooks, the wire watcher and the fault log
ask it on every call, and the rollout module imports them.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

current: ContextVar[Any] = ContextVar("tracerl_rollout", default=None)
"""The current ``Rollout``, None outside every rollout (set and reset by ``rollout.Rollout``)."""


def current_rollout() -> Any:
    """The rollout the calling code runs in, if any (a ``tracerl.integrations.rollout.Rollout``)."""
    return current.get()
