"""One policy per request across a hot-swap of served weights.

Reloading merged weights in place (``VLLMServer.reload_weights``) used to pause vLLM with
``mode=keep``: requests in flight resumed on the new weights, so one answer could hold tokens
of two policies.  The gate is a readers-writer lock between requests and swaps:

- a request enters (shared) before it is sent and leaves when its answer is back; it reads
  the policy name at entry, and no swap can start while it is inside, so that name is the
  policy of every one of its tokens;
- a swap waits for the requests inside to finish, holds new ones at the door, swaps, names the
  new policy and lets them in.  Writers go first: a stream of new requests cannot starve a swap.

The proxy runs on its own thread's event loop and the backend on another, so the lock is a
``threading.Condition``; requests wait for it on a worker thread only while a swap is on.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import AsyncIterator, Callable, TypeVar

T = TypeVar("T")


class PolicyGate:
    def __init__(self, policy: str | None = None) -> None:
        self.policy = policy
        """The policy the weights are now (``agent@4``); None until one is named."""
        self._changed = threading.Condition()
        self._inside = 0
        self._swapping = False

    # -- requests -------------------------------------------------------------------
    def _try_enter(self) -> tuple[bool, str | None]:
        with self._changed:
            if self._swapping:
                return False, None
            self._inside += 1
            return True, self.policy

    def _enter(self) -> str | None:
        with self._changed:
            while self._swapping:
                self._changed.wait()
            self._inside += 1
            return self.policy

    def _leave(self) -> None:
        with self._changed:
            self._inside -= 1
            self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def request(self) -> AsyncIterator[str | None]:
        """Hold the weights for one request; yields the policy that will answer it."""
        entered, policy = self._try_enter()  # never blocks the event loop
        if not entered:
            policy = await _on_thread(self._enter, undo=lambda _: self._leave())
        try:
            yield policy
        finally:
            self._leave()

    # -- swaps ----------------------------------------------------------------------
    def _begin(self) -> None:
        with self._changed:
            while self._swapping:  # one swap at a time
                self._changed.wait()
            self._swapping = True
            while self._inside:
                self._changed.wait()

    def _end(self, policy: str | None) -> None:
        with self._changed:
            if policy is not None:
                self.policy = policy
            self._swapping = False
            self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def swap(self, policy: str | None = None) -> AsyncIterator[None]:
        """Wait for the requests inside to finish, hold new ones, and on success name ``policy``."""
        await _on_thread(self._begin, undo=lambda _: self._end(None))
        try:
            yield
        except BaseException:
            self._end(None)  # the swap failed: the old name stays
            raise
        self._end(policy)


async def _on_thread(wait: Callable[[], T], *, undo: Callable[[T], None]) -> T:
    """``wait()`` on a worker thread; if the caller is cancelled meanwhile, ``undo`` what it took once it returns."""
    future = asyncio.ensure_future(asyncio.to_thread(wait))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(lambda done: undo(done.result()) if not done.cancelled() and done.exception() is None else None)
        raise
