"""Turn on every hook whose library is installed (idempotent); each hook also works alone.

Rollouts turn these hooks on by themselves (:mod:`.auto`); calling this explicitly picks the
tracer provider, and turns back on a hook that ``uninstrument`` turned off."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from . import auto
from .auto import HOOKS, enable
from .processor import configure


def instrument(*hooks: str, tracer_provider: Any = None) -> list[str]:
    """Enable the named hooks (default: all installed) and return those now active.

    ``tracer_provider``: an SDK ``TracerProvider`` to attach capture to (default: the
    global one when it is an SDK provider, else a private one).
    """
    configure(tracer_provider)
    names = hooks or tuple(HOOKS)
    for name in names:
        if name not in HOOKS:
            raise ValueError(f"unknown hook {name!r}; known: {sorted(HOOKS)}")
    active = []
    for name in names:
        auto.note_instrumented(name)
        if importlib.util.find_spec(HOOKS[name][0]) is not None and enable(name):
            active.append(name)
    return active


def uninstrument(*hooks: str) -> None:
    """Undo :func:`instrument` for the named hooks (default: all); rollouts no longer turn them on."""
    for name in hooks or tuple(HOOKS):
        auto.note_uninstrumented(name)
        library, module = HOOKS[name]
        if importlib.util.find_spec(library) is None:
            continue
        hook = importlib.import_module(module, __package__)
        if hook.is_instrumented():
            hook.uninstrument()
