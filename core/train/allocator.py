"""The C allocator under the trainer: jemalloc when it can be had, and freed memory released between steps.

Why: a training step allocates and frees thousands of activation-sized tensors; PyTorch's CPU
tensors come straight from ``malloc``.  glibc's malloc keeps that freed memory and fragments
it, so a step's peak sits far above what the step holds.  jemalloc keeps the peak close to it,
and with its decay off while a step runs it is also the fastest of the allocators tried: pages
are reused, never re-faulted (``bench/allocator_step.py`` measures each allocator on the demo's
step; the figures are in ``bench/RESULTS.md``).

So tracerl prefers jemalloc with decay off while a step runs and purges it between steps
(:func:`release_freed_memory`), so the memory is back for the rollouts.  jemalloc must be
loaded before the process starts (``LD_PRELOAD``), which a library cannot do for a running
interpreter: scripts opt in with :func:`relaunch_with_jemalloc` as their first statement
(``examples/demo.py`` does), or run under
``LD_PRELOAD=$(python -m tracerl.train.allocator)``.  Where jemalloc is absent nothing changes except
that glibc's free memory is trimmed after each step (``malloc_trim``).

jemalloc comes from the system (Debian/Ubuntu ``libjemalloc2``: ``make demo`` installs it when
it runs as root with apt) or from Ray's wheel (``ray/core/libjemalloc.so``); ``$TRACERL_JEMALLOC``
names another copy, or ``off`` to never use one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import sys
from pathlib import Path
from typing import Literal

ENV_JEMALLOC = "TRACERL_JEMALLOC"
RELAUNCHED = "TRACERL_JEMALLOC_RELAUNCHED"
"""Set in the environment of a process that was relaunched (or must not relaunch)."""
_ALL_ARENAS = 4096  # jemalloc's MALLCTL_ARENAS_ALL
_SYSTEM_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
    "/usr/lib/libjemalloc.so.2",
    "/usr/local/lib/libjemalloc.so.2",
)


def find_jemalloc() -> Path | None:
    """A loadable jemalloc: ``$TRACERL_JEMALLOC``, the system's, then Ray's bundled copy; None if none (or ``off``)."""
    override = os.environ.get(ENV_JEMALLOC, "").strip()
    if override.lower() in ("off", "0", "false", "no"):
        return None
    if override:
        return Path(override) if Path(override).is_file() else None
    for candidate in _SYSTEM_PATHS:
        if Path(candidate).is_file():
            return Path(candidate)
    name = ctypes.util.find_library("jemalloc")  # elsewhere in the loader's cache: a soname LD_PRELOAD resolves itself
    if name:
        return Path(name)
    spec = importlib.util.find_spec("ray")  # not imported: finding the package costs nothing
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            bundled = Path(location) / "core" / "libjemalloc.so"
            if bundled.is_file():
                return bundled
    return None


def active_allocator() -> Literal["jemalloc", "glibc", "other"]:
    """Which ``malloc`` this process runs on (jemalloc exports ``mallctl``, glibc ``malloc_trim``)."""
    process = ctypes.CDLL(None)
    if hasattr(process, "mallctl"):
        return "jemalloc"
    if hasattr(process, "malloc_trim"):
        return "glibc"
    return "other"


def _mallctl_write_ssize(name: str, value: int) -> bool:
    process = ctypes.CDLL(None)
    new = ctypes.c_ssize_t(value)
    return process.mallctl(name.encode(), None, None, ctypes.byref(new), ctypes.c_size_t(ctypes.sizeof(new))) == 0


def hold_freed_memory() -> bool:
    """On jemalloc: keep freed pages for reuse instead of returning them on a timer (decay off).

    Returned pages are faulted in again by the next allocation; inside a training step that
    re-faulting cost 30% of the step.  :func:`release_freed_memory` returns them between steps.
    Returns whether the setting took (False on any other allocator)."""
    if active_allocator() != "jemalloc":
        return False
    process = ctypes.CDLL(None)
    narenas = ctypes.c_uint(0)
    size = ctypes.c_size_t(ctypes.sizeof(narenas))
    if process.mallctl(b"arenas.narenas", ctypes.byref(narenas), ctypes.byref(size), None, ctypes.c_size_t(0)) != 0:
        return False
    ok = all(_mallctl_write_ssize(f"arenas.{kind}_decay_ms", -1) for kind in ("dirty", "muzzy"))  # arenas made later
    for index in range(narenas.value):
        for kind in ("dirty", "muzzy"):
            _mallctl_write_ssize(f"arena.{index}.{kind}_decay_ms", -1)  # an arena not yet created refuses: harmless
    return ok


def release_freed_memory() -> None:
    """Give the allocator's free pages back to the system (between training steps: cheap, ~ms)."""
    allocator = active_allocator()
    process = ctypes.CDLL(None)
    if allocator == "jemalloc":
        process.mallctl(f"arena.{_ALL_ARENAS}.purge".encode(), None, None, None, ctypes.c_size_t(0))
    elif allocator == "glibc":
        process.malloc_trim(ctypes.c_size_t(0))


def relaunch_with_jemalloc() -> None:
    """Re-execute this script with jemalloc preloaded, if one is found and it is not loaded yet.

    Call it as the first statement of a script's ``if __name__ == "__main__":`` block, before
    anything heavy is imported or started: the process image is replaced (same pid, same
    arguments, same environment plus ``LD_PRELOAD``).  It runs at most once (a marker in the
    environment), and does nothing where jemalloc is absent or ``$TRACERL_JEMALLOC=off``.
    Child processes inherit ``LD_PRELOAD`` (vLLM's processes run on it too: measured the same
    decode speed and ~0.1 GB less memory)."""
    if os.environ.get(RELAUNCHED) or active_allocator() == "jemalloc":
        return
    library = find_jemalloc()
    if library is None:
        return
    env = dict(os.environ)
    env[RELAUNCHED] = "1"
    env["LD_PRELOAD"] = ":".join(p for p in (str(library), env.get("LD_PRELOAD", "")) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def describe() -> str:
    """One line for a run's log: which allocator the trainer runs on, and how to get jemalloc if missing."""
    allocator = active_allocator()
    if allocator == "jemalloc":
        return "allocator: jemalloc (freed memory kept during a step, released after it)"
    hint = "" if find_jemalloc() else " (install libjemalloc2, e.g. `apt-get install libjemalloc2`, for ~0.9 GB less peak memory per step)"
    return f"allocator: {allocator}, trimmed after each step{hint}"


if __name__ == "__main__":  # `LD_PRELOAD=$(python -m tracerl.train.allocator) python my_script.py`
    found = find_jemalloc()
    if found is None:
        sys.exit("no jemalloc found (install libjemalloc2, or set TRACERL_JEMALLOC to its path)")
    print(found)
