"""One compute thread shared fairly: each tenant's operations in order, the tenants served in turn.

A tenant that queues 50 training operations does not make the next tenant wait for all 50:
the thread takes one operation from each tenant with work, round-robin, so another tenant's
next operation starts after at most one operation of each other tenant (fairness by order, not
by a timer).  Within a tenant, operations run in the order they were submitted.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable
from typing import Any


class QueueFullError(RuntimeError):
    """A tenant has as many operations queued as it may (answered 429: the SDK waits and resubmits)."""


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
