"""One trainer per model: an exclusive lock on the run directory, held while a backend uses it.

Without it a second process on the same model cleans the first one's in-flight temp
checkpoint away and both write the same step numbers.  The lock is ``fcntl.flock`` on
``run.lock`` in the run directory: the kernel drops it when the holding process dies
(SIGKILL included), so a lock left by a dead process is recovered by the next
``acquire`` with no stale-lock guessing, and a pid reused by an unrelated process cannot
keep it.  The file holds the holder's pid, host and start time, for the error message.
It is never deleted (deleting a lock file lets two processes lock two different files).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import RunLockedError

__all__ = ["RunLock"]


class RunLock:
    """``acquire()`` or raise :class:`RunLockedError` at once; ``release()`` (idempotent)."""

    def __init__(self, path: Path, what: str) -> None:
        """``path``: the lock file; ``what``: how the error names the locked thing (e.g. ``model p/m``)."""
        self.path = path
        self.what = what
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        if self._fd is not None:
            return
        import fcntl  # POSIX; imported here so that `import tracerl` works everywhere

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by servers we start
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise self._locked_error(holder) from None
        except BaseException:
            os.close(fd)
            raise
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "program": os.path.basename(sys.argv[0]) if sys.argv else ""}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        import fcntl

        fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _locked_error(self, holder: dict[str, Any]) -> RunLockedError:
        pid, host = holder.get("pid"), holder.get("host")
        since = holder.get("since")
        when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else ""
        program = holder.get("program")
        who = f"pid {pid} on host {host}{when}" + (f" ({program})" if program else "")
        if pid == os.getpid() and host == socket.gethostname():
            who += ", this process: another backend here still holds it (close it first)"
        return RunLockedError(
            f"{self.what} is in use by {who}: one trainer per model. Stop that process, "
            f"or use another model name or data directory (lock file {self.path}).",
            path=self.path,
            pid=pid if isinstance(pid, int) else None,
            host=host if isinstance(host, str) else None,
        )


def _read_holder(fd: int) -> dict[str, Any]:
    """The holder's pid/host/since, or {} while it is still writing them."""
    try:
        value = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
