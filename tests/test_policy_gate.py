"""``PolicyGate``: a reload waits for the requests inside, holds new ones, and names the new policy.

The proxy and the backend run on different threads' event loops, as in ``VLLMServer``; the
real hot-swap under 16 streams is in ``test_serve_merged_real_model.py``.
"""

from __future__ import annotations

import asyncio
import threading

from tracerl.inference.policy_gate import PolicyGate


def _loop_on_thread() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return loop


def test_requests_and_a_swap_never_overlap_and_each_request_names_its_policy():
    gate = PolicyGate("agent@1")
    proxy = _loop_on_thread()  # the proxy's loop; the swap runs on this test's loop
    events: list[str] = []

    async def request(i: int, hold: float) -> str | None:
        async with gate.request() as policy:
            events.append(f"in {i} {policy}")
            await asyncio.sleep(hold)
            events.append(f"out {i} {policy}")
            return policy

    async def main() -> tuple[list[str | None], list[str | None]]:
        first = [asyncio.wrap_future(asyncio.run_coroutine_threadsafe(request(i, 0.3), proxy)) for i in range(8)]
        await asyncio.sleep(0.1)  # all eight are inside
        async with gate.swap("agent@2"):
            events.append("swap")
            later = [asyncio.wrap_future(asyncio.run_coroutine_threadsafe(request(8 + i, 0.0), proxy)) for i in range(8)]
            await asyncio.sleep(0.2)  # they wait at the door, without blocking the proxy's loop
            assert asyncio.run_coroutine_threadsafe(asyncio.sleep(0, "alive"), proxy).result(timeout=2) == "alive"
        return await asyncio.gather(*first), await asyncio.gather(*later)

    before, after = asyncio.run(main())
    proxy.call_soon_threadsafe(proxy.stop)
    assert before == ["agent@1"] * 8 and after == ["agent@2"] * 8
    swap = events.index("swap")
    assert all(e.startswith(("in", "out")) and e.endswith("agent@1") for e in events[:swap])  # all of the first finished first
    assert len(events[:swap]) == 16 and all(e.endswith("agent@2") for e in events[swap + 1 :])


def test_a_failed_swap_keeps_the_old_name_and_a_cancelled_waiter_leaves_nothing_held():
    gate = PolicyGate("agent@1")

    async def main() -> None:
        try:
            async with gate.swap("agent@2"):
                raise RuntimeError("reload failed")
        except RuntimeError:
            pass
        async with gate.request() as policy:
            assert policy == "agent@1"
        async with gate.swap("agent@2"):
            waiter = asyncio.create_task(_enter(gate))
            await asyncio.sleep(0.1)
            waiter.cancel()  # gave up at the door: once let in, it must leave at once
        await asyncio.sleep(0.1)
        async with asyncio.timeout(5):  # a swap would wait forever for a request still counted inside
            async with gate.swap("agent@3"):
                pass
        assert gate.policy == "agent@3"

    asyncio.run(main())


async def _enter(gate: PolicyGate) -> None:
    async with gate.request():
        pass
