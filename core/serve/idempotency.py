"""Idempotent ``train`` for ``tracerl serve``: a retried call gets the first call's answer.

A client whose ``train`` call timed out, or whose connection dropped, cannot know whether the
step ran; retrying blindly would train twice and leave the server a step ahead of the client.
So :class:`~tracerl.RemoteBackend` sends one ``Idempotency-Key`` per ``train`` call and the same
key on its retries, and the server keeps, per model, the outcome of its recent keys:

- a key seen before whose step finished: its answer again, no training;
- a key whose step is still running: the retry waits for that step and gets its answer;
- a key seen with a *different* body: refused (a client bug, not a retry);
- a step that failed: forgotten, so a later retry runs it again (nothing was trained).

The training itself runs as a task of its own, so a client that goes away does not cancel a
step half-way.  Memory is bounded: ``per_model`` keys per model, oldest dropped first.  The
table lives in memory: after a server restart a retry trains again.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from ..errors import ConfigError

IDEMPOTENCY_HEADER = "Idempotency-Key"
DEFAULT_KEYS_PER_MODEL = 64
MAX_KEY_LENGTH = 200


@dataclass
class _Entry:
    digest: str
    task: "asyncio.Task[dict[str, Any]]"


class TrainResults:
    """Recent train outcomes by (model, key); see the module docstring."""

    def __init__(self, per_model: int = DEFAULT_KEYS_PER_MODEL) -> None:
        self.per_model = per_model
        self._entries: dict[str, OrderedDict[str, _Entry]] = {}
        self.replayed = 0
        """How many calls were answered from an earlier call with the same key (finished or running)."""

    async def run(self, model: str, key: str | None, body: bytes, train: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """``await train()`` once per ``key`` (every call without a key trains)."""
        if key is None:
            return await train()
        if not key or len(key) > MAX_KEY_LENGTH:
            raise ConfigError(f"{IDEMPOTENCY_HEADER} must be 1 to {MAX_KEY_LENGTH} characters")
        digest = hashlib.sha256(body).hexdigest()
        entries = self._entries.setdefault(model, OrderedDict())
        entry = entries.get(key)
        if entry is not None:
            if entry.digest != digest:
                raise ConfigError(f"{IDEMPOTENCY_HEADER} {key!r} was already used for a different train request")
            self.replayed += 1
            return await asyncio.shield(entry.task)
        task = asyncio.create_task(train())
        entries[key] = _Entry(digest, task)
        while len(entries) > self.per_model:
            entries.popitem(last=False)
        task.add_done_callback(lambda done: self._forget_failure(model, key, done))
        return await asyncio.shield(task)

    def _forget_failure(self, model: str, key: str, task: "asyncio.Task[dict[str, Any]]") -> None:
        if task.cancelled() or task.exception() is not None:
            entries = self._entries.get(model, {})
            if key in entries and entries[key].task is task:
                del entries[key]
