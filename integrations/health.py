"""Capture must never break the agent: errors in tracerl's own code are swallowed,
counted by kind, and logged once per kind (with the traceback the first time).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

logger = logging.getLogger("tracerl.integrations")

_lock = threading.Lock()
_counts: Counter[str] = Counter()
_logged: set[str] = set()


def record_error(kind: str, error: BaseException | None = None) -> None:
    """Count one capture failure of ``kind``; log it the first time that kind happens."""
    try:
        with _lock:
            _counts[kind] += 1
            first = kind not in _logged
            _logged.add(kind)
        if first:
            logger.warning("tracerl capture error (%s): %r; the agent is unaffected, further %s errors are only counted",
                           kind, error, kind, exc_info=error)  # fmt: skip
    except Exception:  # noqa: BLE001 - the error path itself must not raise
        pass


class guard:
    """``with guard(kind):`` runs capture code; any exception is recorded instead of propagating.

    A class rather than a ``@contextmanager`` generator: it runs several times per model
    call, and a generator-based context manager costs ~3x as much to enter and leave.
    """

    __slots__ = ("kind",)

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, error: BaseException | None, tb: Any) -> bool:
        if exc_type is None or not issubclass(exc_type, Exception):
            return False  # nothing raised, or a cancellation / exit: let it go
        record_error(self.kind, error)  # noqa: by design
        return True


def error_counts() -> dict[str, int]:
    """Capture failures so far, by kind."""
    with _lock:
        return dict(_counts)


def reset_error_counts() -> None:
    """Forget counts and which kinds were logged (tests)."""
    with _lock:
        _counts.clear()
        _logged.clear()
