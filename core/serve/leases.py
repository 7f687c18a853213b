"""Policy leases held for ``RemoteBackend`` clients: ``LocalBackend.policy_lease`` over HTTP.

A client's ``PipelineTrainer`` leases the policy each group started on, so an agent that pinned
the name still finds it two steps later (:mod:`tracerl.train.served_policies`).  Each lease
here holds the backend's lease until the client releases it or it expires: a client killed
mid-group must not keep old adapters loaded forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

MAX_LEASE_SECONDS = 24 * 3600.0
DEFAULT_LEASE_SECONDS = 3600.0
MAX_LEASES = 10_000
"""Leases open at once, all models together: past it a new one is refused, not queued."""


@dataclass
class _Held:
    model: str
    stack: contextlib.AsyncExitStack
    expiry: asyncio.Task[None]


class HeldLeases:
    """The open leases by id, each holding ``backend.policy_lease(model, step)`` until released or expired."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._held: dict[str, _Held] = {}

    @property
    def supported(self) -> bool:
        return callable(getattr(self.backend, "policy_lease", None))

    @property
    def full(self) -> bool:
        return len(self._held) >= MAX_LEASES

    async def open(self, model: Any, step: int, seconds: float) -> str:
        """Hold ``name@step`` served for at most ``seconds``; returns the lease's id."""
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(self.backend.policy_lease(model, step))
        lease_id = secrets.token_urlsafe(12)
        self._held[lease_id] = _Held(model.name, stack, asyncio.create_task(self._expire(lease_id, seconds)))
        return lease_id

    async def _expire(self, lease_id: str, seconds: float) -> None:
        await asyncio.sleep(seconds)
        held = self._held.pop(lease_id, None)
        if held is not None:
            await held.stack.aclose()

    async def release(self, model: Any, lease_id: str) -> bool:
        """End a lease (its policy is retired now if it is two steps old and nothing else holds it);
        False when there is no such open lease on ``model``: released already, or expired."""
        held = self._held.get(lease_id)
        if held is None or held.model != model.name:
            return False
        del self._held[lease_id]
        held.expiry.cancel()
        await held.stack.aclose()
        return True

    async def close(self) -> None:
        for lease_id, held in list(self._held.items()):
            self._held.pop(lease_id, None)
            held.expiry.cancel()
            with contextlib.suppress(Exception):
                await held.stack.aclose()


def lease_seconds(value: Any) -> float:
    """A lease's lifetime as the client asked (default an hour, at most a day)."""
    if value is None:
        return DEFAULT_LEASE_SECONDS
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_LEASE_SECONDS:
        raise ConfigError(f"'seconds' must be a number in (0, {MAX_LEASE_SECONDS:.0f}], got {value!r}")
    return float(value)
