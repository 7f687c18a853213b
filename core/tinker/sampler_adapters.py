"""The sampler adapters the inference engine holds: capped per tenant and in all, the least recently used evicted.

Weights saved for sampling stay on disk; the engine loads an adapter when a request needs it
(:meth:`SamplerAdapters.use`) and keeps it while it is among the recently used.  Loading one
more than a cap allows first unloads the least recently used adapter that no request is using:
the tenant's own when the tenant is at its cap, anyone's when the engine is at the global cap.
An adapter in use is never unloaded; a request that needs room while every candidate is in use
waits for one to be released (a poll may wait, never fails), and an evicted adapter loads again
from its folder the next time it is asked for.

:meth:`SamplerAdapters.drop` retires an adapter for good (an unnamed save superseded, its
sampling session ended, its checkpoint deleted): once no request holds a reference
(:meth:`ref` … :meth:`unref`, taken when a sampling request is accepted) it is unloaded and its
``cleanup`` (deleting the folder) runs.  Event-loop only; the engine's load and unload run in a
worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("tracerl.tinker")


@dataclass
class _Loaded:
    tenant: str
    folder: Path
    pins: int = 0  # requests using it in the engine now
    stale: bool = False  # its folder was saved again: reload before the next use


class SamplerAdapters:
    """``load(name, folder)`` / ``unload(name)``: the engine's (blocking; run in a thread)."""

    def __init__(
        self, load: Callable[[str, Path], None], unload: Callable[[str], None], *, max_total: int, max_per_tenant: int
    ) -> None:  # fmt: skip
        if max_total < 1 or max_per_tenant < 1:
            raise ValueError(f"the sampler adapter caps must be >= 1, got {max_total} in all and {max_per_tenant} per tenant")
        self._load, self._unload = load, unload
        self.max_total, self.max_per_tenant = max_total, max_per_tenant
        self.loaded: OrderedDict[str, _Loaded] = OrderedDict()  # least recently used first
        self.refs: Counter[str] = Counter()  # accepted requests that will use the adapter
        self.doomed: dict[str, tuple[Callable[[], Any] | None, asyncio.Event]] = {}
        self.changed = asyncio.Condition()
        self.peak = 0  # the most loaded at once, ever
        self.loads = 0
        self.evictions = 0
        self.tasks: set[asyncio.Task[None]] = set()  # drops under way (referenced until done)

    def count(self, tenant: str | None = None) -> int:
        """Adapters loaded now (``tenant``'s only, when given)."""
        if tenant is None:
            return len(self.loaded)
        return sum(1 for entry in self.loaded.values() if entry.tenant == tenant)

    def ref(self, name: str) -> None:
        self.refs[name] += 1

    def unref(self, name: str) -> None:
        self.refs[name] -= 1
        if self.refs[name] <= 0:
            del self.refs[name]
            if name in self.doomed:
                self._start_drop(name)

    def is_dropped(self, name: str) -> bool:
        return name in self.doomed

    def stale(self, name: str) -> None:
        """``name``'s folder holds new weights: the next use loads them (in place)."""
        entry = self.loaded.get(name)
        if entry is not None:
            entry.stale = True

    @contextlib.asynccontextmanager
    async def use(self, name: str, tenant: str, folder: Path) -> AsyncIterator[None]:
        """``name`` loaded (from ``folder``) and not evicted while the block runs."""
        await self._acquire(name, tenant, folder)
        try:
            yield
        finally:
            async with self.changed:
                self.loaded[name].pins -= 1
                self.changed.notify_all()

    async def _acquire(self, name: str, tenant: str, folder: Path) -> None:
        async with self.changed:
            while True:
                if name in self.doomed:
                    raise LookupError(f"the sampler weights {name.partition('@')[2]!r} were dropped")
                entry = self.loaded.get(name)
                if entry is not None:
                    self.loaded.move_to_end(name)
                    if entry.stale:
                        entry.stale = False
                        await asyncio.to_thread(self._load, name, entry.folder)  # replaced in place
                        self.loads += 1
                    entry.pins += 1
                    return
                victim = self._victim(tenant)
                if victim == "":
                    await self.changed.wait()  # every candidate is in use: one is released soon
                elif victim is not None:
                    await self._evict(victim)
                    self.evictions += 1
                else:
                    await asyncio.to_thread(self._load, name, folder)
                    self.loads += 1
                    self.loaded[name] = _Loaded(tenant, folder, pins=1)
                    self.peak = max(self.peak, len(self.loaded))
                    return

    def _victim(self, tenant: str) -> str | None:
        """What to unload before loading one more for ``tenant``: None (room enough), "" (wait)."""
        if self.count(tenant) >= self.max_per_tenant:
            candidates = [name for name, entry in self.loaded.items() if entry.tenant == tenant]
        elif len(self.loaded) >= self.max_total:
            candidates = list(self.loaded)
        else:
            return None
        for name in candidates:  # least recently used first
            if self.loaded[name].pins == 0:
                return name
        return ""

    async def _evict(self, name: str) -> None:
        del self.loaded[name]  # counted out before the engine lets it go: the count never lags the engine
        await asyncio.to_thread(self._unload, name)

    async def drop(self, name: str, cleanup: Callable[[], Any] | None = None) -> None:
        """Retire ``name``: unloaded and ``cleanup()`` run (in a thread) once no request refers to it;
        returns when that is done."""
        if name not in self.doomed:
            self.doomed[name] = (cleanup, asyncio.Event())
            if not self.refs.get(name):
                self._start_drop(name)
        pending = self.doomed.get(name)
        if pending is not None:
            await pending[1].wait()

    def _start_drop(self, name: str) -> None:
        task = asyncio.ensure_future(self._finish_drop(name))
        self.tasks.add(task)

        def done(task: asyncio.Task[None]) -> None:
            self.tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:
                log.error("dropping the sampler adapter %s failed", name, exc_info=task.exception())

        task.add_done_callback(done)

    async def _finish_drop(self, name: str) -> None:
        cleanup, done = self.doomed[name]
        try:
            async with self.changed:
                await self.changed.wait_for(lambda: name not in self.loaded or self.loaded[name].pins == 0)
                if name in self.loaded:
                    await self._evict(name)
            if cleanup is not None:
                await asyncio.to_thread(cleanup)
        finally:
            del self.doomed[name]
            done.set()
