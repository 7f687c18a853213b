"""A rollout turns capture on by itself: the hooks of every installed library, no extra call.

The most likely first mistake is to wrap an agent in ``tracerl.rollout(...)`` and forget
``ti.instrument()``: the trajectory came back empty and nothing said why.  So entering a
rollout calls :func:`ensure_instrumented`: hooks whose library is already imported are
enabled at once; for a library that is installed but not imported yet (importing LiteLLM
costs seconds, and an agent that never uses it should not pay them) an import hook enables
its hook right after the library's own ``__init__`` ran, before user code can bind its
functions (``from litellm import acompletion`` gets the wrapped one).  After the first
rollout this is one flag check.

Opting out: ``tracerl.rollout(..., auto_instrument=False)`` for one rollout, or the
environment variable ``TRACERL_AUTO_INSTRUMENT=0`` for the process.  A hook the user turned
off with ``ti.uninstrument(...)`` stays off until ``ti.instrument(...)`` is called again.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
from typing import Any

from .health import guard

ENV = "TRACERL_AUTO_INSTRUMENT"

_lock = threading.RLock()  # enabling a hook may import a watched library on this thread
_settled = False
"""Every installed hook is on, waiting for its library's import, or turned off by the user."""
_opted_out: set[str] = set()
"""Hooks the user turned off with ``uninstrument``: auto-instrumentation leaves them off."""
_waiting: dict[str, str] = {}
"""Top-level module -> hook name, for installed libraries not imported yet."""

HOOKS = {
    "openai": ("openai", ".openai_hook"),
    "litellm": ("litellm", ".litellm_hook"),
    "langchain": ("langchain_core", ".langchain_hook"),
    "mcp": ("mcp", ".mcp_hook"),
    "anthropic": ("anthropic", ".anthropic_hook"),
}
"""Hook name -> (the library it hooks, the hook's module in this package)."""


def enable(name: str) -> bool:
    """Turn on one hook whose library is installed; False when the library is missing."""
    return bool(importlib.import_module(HOOKS[name][1], __package__).instrument())


def env_allows() -> bool:
    """False when ``TRACERL_AUTO_INSTRUMENT`` is ``0``/``false``/``no``/``off``."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def ensure_instrumented() -> None:
    """Enable every installed hook the user did not turn off (idempotent; cheap once done)."""
    global _settled
    if _settled or not env_allows():
        return
    with _lock:
        if _settled:
            return
        for name, (library, _module) in HOOKS.items():
            if name in _opted_out:
                continue
            with guard("auto_instrument"):
                if library in sys.modules:
                    enable(name)
                elif importlib.util.find_spec(library) is not None:
                    _waiting[library] = name
        if _waiting and not any(isinstance(f, _ImportWatcher) for f in sys.meta_path):
            sys.meta_path.insert(0, _ImportWatcher())
        _settled = True


def note_uninstrumented(name: str) -> None:
    """``ti.uninstrument(name)`` was called: auto-instrumentation must not undo it."""
    with _lock:
        _opted_out.add(name)
        for library, hook in list(_waiting.items()):
            if hook == name:
                del _waiting[library]


def note_instrumented(name: str) -> None:
    """``ti.instrument(name)`` was called: the user wants it on again."""
    with _lock:
        _opted_out.discard(name)


def reset() -> None:
    """Forget what was decided (tests): the next rollout decides again."""
    global _settled
    with _lock:
        _settled = False
        _opted_out.clear()
        _waiting.clear()


def _library_imported(library: str) -> None:
    """Called right after ``library``'s top-level module executed: enable its hook."""
    with _lock:
        name = _waiting.pop(library, None)
    if name is not None and env_allows():
        with guard("auto_instrument_on_import"):
            enable(name)


class _ImportWatcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of a watched library so its hook is enabled
    once the library is imported (what ``wrapt``'s post-import hooks do)."""

    _resolving = threading.local()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _waiting or getattr(self._resolving, "name", None) == fullname:
            return None
        self._resolving.name = fullname
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
            if spec is None:
                for finder in sys.meta_path:
                    if finder is self or not hasattr(finder, "find_spec"):
                        continue
                    spec = finder.find_spec(fullname, path, target)
                    if spec is not None:
                        break
        finally:
            self._resolving.name = None
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _NotifyingLoader(spec.loader, fullname)
        return spec


class _NotifyingLoader(importlib.abc.Loader):
    """The library's own loader, plus one call when its module has executed."""

    def __init__(self, loader: Any, library: str) -> None:
        self._loader = loader
        self._library = library

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self._loader  # the module keeps its real loader (resources, reload)
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _library_imported(self._library)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
