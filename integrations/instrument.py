"""Turn on every hook whose library is installed (idempotent); each hook also works alone.

Rollouts turn these hooks on by themselves (:mod:`.auto`); calling this explicitly picks the
tracer provider, and turns back on a hook that ``uninstrument`` turned off."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from . import auto
from .processor import configure

_HOOKS = {
    "openai": ("openai", ".openai_hook"),
    "litellm": ("litellm", ".litellm_hook"),
    "langchain": ("langchain_core", ".langchain_hook"),
    "mcp": ("mcp", ".mcp_hook"),
}


def instrument(*hooks: str, tracer_provider: Any = None) -> list[str]:
    """Enable the named hooks (default: all installed) and return those now active.

    ``tracer_provider``: an SDK ``TracerProvider`` to attach capture to (default: the
    global one when it is an SDK provider, else a private one).
    """
    configure(tracer_provider)
    names = hooks or tuple(_HOOKS)
    for name in names:
        if name not in _HOOKS:
            raise ValueError(f"unknown hook {name!r}; known: {sorted(_HOOKS)}")
    active = []
    for name in names:
        auto.note_instrumented(name)
        if importlib.util.find_spec(_HOOKS[name][0]) is not None and enable(name):
            active.append(name)
    return active


def enable(name: str) -> bool:
    """Turn on one hook whose library is installed; False when the library is missing."""
    return bool(importlib.import_module(_HOOKS[name][1], __package__).instrument())


def uninstrument(*hooks: str) -> None:
    """Undo :func:`instrument` for the named hooks (default: all); rollouts no longer turn them on."""
    for name in hooks or tuple(_HOOKS):
        auto.note_uninstrumented(name)
        library, module = _HOOKS[name]
        if importlib.util.find_spec(library) is None:
            continue
        hook = importlib.import_module(module, __package__)
        if hook.is_instrumented():
            hook.uninstrument()
