"""Shared capacity served fairly: each tenant's work in order, the tenants served in turn.

:class:`FairQueue` is the one compute thread training shares.  A tenant that queues 50 training
operations does not make the next tenant wait for all 50: the thread takes one operation from
each tenant with work, round-robin, so another tenant's next operation starts after at most one
operation of each other tenant (fairness by order, not by a timer).  Within a tenant,
operations run in the order they were submitted.

:class:`FairGate` is the same rule for work that runs on the event loop (sampling): at most
``slots`` holders at once, a freed slot goes to the waiting tenant holding the fewest (then the
one served least recently), and each tenant may have at most ``max_queued_per_tenant`` requests
admitted or waiting (more: 429).  Slots cannot be taken back from a running request, so a tenant
alone may fill them all, but while several tenants sample (each entered within ``active_s``) each
holds at most its share, ``slots // active tenants`` (at least one): a burst of long requests then
waits in its own tenant's queue instead of holding every slot when the others come back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any


class QueueFullError(RuntimeError):
    """A tenant has as many operations queued as it may, or a table of its is full (answered 429 with
    ``Retry-After: retry_after`` seconds: the SDK waits that long and resubmits)."""

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class FairQueue:
    def __init__(self, *, max_queued_per_tenant: int = 256, name: str = "tracerl-tinker") -> None:
        self.max_queued = max_queued_per_tenant
        self.queues: dict[str, deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]] = {}
        self.turns: deque[str] = deque()  # tenants with queued work, next first
        self.changed = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._work, name=name, daemon=True)
        self.thread.start()

    def submit(self, tenant: str, work: Callable[[], Any], *, force: bool = False) -> concurrent.futures.Future[Any]:
        """Queue ``work`` for ``tenant``; ``force`` skips the quota (an operation already accepted
        in a sequence must not be refused when its turn comes)."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self.changed:
            if self.closed:
                raise RuntimeError("the server is shutting down")
            queue = self.queues.setdefault(tenant, deque())
            if not force and len(queue) >= self.max_queued:
                raise QueueFullError(f"{len(queue)} operations of this tenant are queued already (the most allowed): wait for some to finish")
            queue.append((work, future))
            if tenant not in self.turns:
                self.turns.append(tenant)
            self.changed.notify()
        return future

    def queued(self, tenant: str) -> int:
        with self.changed:
            return len(self.queues.get(tenant, ()))

    def close(self) -> None:
        """Stop after the running operation; queued ones are cancelled."""
        with self.changed:
            self.closed = True
            for queue in self.queues.values():
                for _, future in queue:
                    future.cancel()
                queue.clear()
            self.changed.notify()
        self.thread.join(timeout=600)

    def _work(self) -> None:
        while True:
            with self.changed:
                while not self.turns and not self.closed:
                    self.changed.wait()
                if self.closed:
                    return
                tenant = self.turns.popleft()
                queue = self.queues[tenant]
                work, future = queue.popleft()
                if queue:
                    self.turns.append(tenant)  # its next operation waits for the other tenants' turns
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(work())
                except BaseException as error:  # noqa: BLE001 - the caller's future carries it
                    future.set_exception(error)


class FairGate:
    """At most ``slots`` requests hold the gate at once; a freed slot goes to the waiting tenant that
    holds the fewest slots, among those the one admitted least recently (round-robin), each
    tenant's requests in the order they came.  Event-loop only.

    ``enter`` reserves a place (or raises :class:`QueueFullError` when the tenant already has
    ``max_queued_per_tenant`` requests admitted or waiting) and returns a future that is done when
    the request holds a slot; every ``enter`` is paired with one ``leave``, admitted or not."""

    def __init__(self, *, slots: int, max_queued_per_tenant: int, active_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        if slots < 1 or max_queued_per_tenant < 1:
            raise ValueError(f"slots and max_queued_per_tenant must be >= 1, got {slots} and {max_queued_per_tenant}")
        self.slots, self.max_queued, self.active_s, self.clock = slots, max_queued_per_tenant, active_s, clock
        self.entered_at: dict[str, float] = {}  # when each tenant last asked for a slot
        self.waiting: dict[str, deque[asyncio.Future[None]]] = {}
        self.holding: dict[str, int] = {}  # admitted requests per tenant
        self.admitted_at: dict[str, int] = {}  # the admission count when each tenant last got a slot
        self.admissions = 0
        self.busy = 0

    def pending(self, tenant: str) -> int:
        """The tenant's requests admitted or waiting."""
        return self.holding.get(tenant, 0) + len(self.waiting.get(tenant, ()))

    def share(self) -> int:
        """Slots one tenant may hold now: all of them alone, else an even share of the tenants active within ``active_s``."""
        now = self.clock()
        for tenant, at in list(self.entered_at.items()):
            if now - at > self.active_s and not self.pending(tenant):
                del self.entered_at[tenant]
        return max(1, self.slots // max(1, len(self.entered_at)))

    def enter(self, tenant: str) -> asyncio.Future[None]:
        self.entered_at[tenant] = self.clock()
        if self.pending(tenant) >= self.max_queued:
            raise QueueFullError(f"{self.pending(tenant)} sampling requests of yours are running or waiting (the most allowed): wait for some to finish")
        ticket: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(tenant, deque()).append(ticket)
        self._admit()
        return ticket

    def leave(self, tenant: str, ticket: asyncio.Future[None]) -> None:
        if ticket.done() and not ticket.cancelled():
            self.busy -= 1
            self.holding[tenant] -= 1
            if not self.holding[tenant]:
                del self.holding[tenant]
        else:  # left before its turn (its caller gave up)
            ticket.cancel()
            queue = self.waiting.get(tenant)
            if queue is not None and ticket in queue:
                queue.remove(ticket)
                if not queue:
                    del self.waiting[tenant]
        self._admit()

    def _admit(self) -> None:
        share = self.share()
        while self.busy < self.slots:
            eligible = [t for t in self.waiting if self.holding.get(t, 0) < share]
            if not eligible:
                return
            tenant = min(eligible, key=lambda t: (self.holding.get(t, 0), self.admitted_at.get(t, -1)))
            queue = self.waiting[tenant]
            ticket = queue.popleft()
            if not queue:
                del self.waiting[tenant]
            if ticket.cancelled():  # its caller gave up; its leave() finds it gone
                continue
            self.busy += 1
            self.holding[tenant] = self.holding.get(tenant, 0) + 1
            self.admissions += 1
            self.admitted_at[tenant] = self.admissions
            ticket.set_result(None)
