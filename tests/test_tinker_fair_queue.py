"""The Tinker service's compute thread serves tenants in turn, each tenant's work in order."""

import threading
import time

import pytest
from tracerl.tinker.fair_queue import FairQueue, QueueFullError


def test_a_flooding_tenant_does_not_starve_the_next():
    queue = FairQueue()
    finished: list[str] = []
    gate = threading.Event()
    first = queue.submit("alice", gate.wait)  # holds the thread while alice queues 50 more
    alice = [queue.submit("alice", lambda i=i: finished.append(f"alice-{i}") or time.sleep(0.001)) for i in range(50)]
    bob = queue.submit("bob", lambda: finished.append("bob"))
    gate.set()
    bob.result(timeout=30)
    for future in [first, *alice]:
        future.result(timeout=30)
    queue.close()
    assert finished.index("bob") < finished.index("alice-9")  # by order: bob ran after at most one of alice's
    assert finished.index("bob") <= 1
    assert [f for f in finished if f.startswith("alice")] == [f"alice-{i}" for i in range(50)]  # alice's in order


def test_the_quota_refuses_more_queued_work_but_not_a_forced_one():
    queue = FairQueue(max_queued_per_tenant=2)
    gate = threading.Event()
    queue.submit("alice", gate.wait)
    time.sleep(0.05)  # running, no longer queued
    queue.submit("alice", lambda: 1)
    queue.submit("alice", lambda: 2)
    with pytest.raises(QueueFullError, match="2 operations"):
        queue.submit("alice", lambda: 3)
    assert queue.submit("bob", lambda: 4) is not None  # another tenant's quota is its own
    forced = queue.submit("alice", lambda: 5, force=True)
    gate.set()
    assert forced.result(timeout=10) == 5
    queue.close()


def test_close_cancels_what_waits_and_an_error_reaches_its_caller():
    queue = FairQueue()
    gate = threading.Event()
    running = queue.submit("alice", gate.wait)
    failing = queue.submit("bob", lambda: 1 / 0)
    waiting = queue.submit("alice", lambda: 1)
    threading.Timer(0.2, gate.set).start()
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=10)
    queue.close()
    assert running.result(timeout=1) is True
    assert waiting.done()
