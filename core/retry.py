"""``@retry``: re-run a flaky sync or async function with exponential backoff."""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def retry(
    max_attempts: int = 3,
    delay: float = 0.25,
    backoff_factor: float = 2.0,
    exceptions: tuple[type[BaseException], ...] = (Exception,),
    on_retry: Callable[[BaseException, int], Any] | None = None,
) -> Callable[[F], F]:
    """Retry on ``exceptions`` up to ``max_attempts`` times; the last error is re-raised."""
    if max_attempts < 1:
        raise ValueError("max_attempts must be >= 1")

    def decorate(fn: F) -> F:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                wait = delay
                for attempt in range(1, max_attempts + 1):
                    try:
                        return await fn(*args, **kwargs)
                    except exceptions as error:
                        if attempt == max_attempts:
                            raise
                        if on_retry is not None:
                            result = on_retry(error, attempt)
                            if inspect.isawaitable(result):
                                await result
                        await asyncio.sleep(wait)
                        wait *= backoff_factor

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
            wait = delay
            for attempt in range(1, max_attempts + 1):
                try:
                    return fn(*args, **kwargs)
                except exceptions as error:
                    if attempt == max_attempts:
                        raise
                    if on_retry is not None:
                        on_retry(error, attempt)
                    time.sleep(wait)
                    wait *= backoff_factor

        return sync_wrapper  # type: ignore[return-value]

    return decorate
