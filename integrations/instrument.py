"""Turn on every hook whose library is installed (idempotent); each hook also works alone."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

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
    active = []
    for name in names:
        if name not in _HOOKS:
            raise ValueError(f"unknown hook {name!r}; known: {sorted(_HOOKS)}")
        library, module = _HOOKS[name]
        if importlib.util.find_spec(library) is None:
            continue
        if importlib.import_module(module, __package__).instrument():
            active.append(name)
    return active


def uninstrument(*hooks: str) -> None:
    """Undo :func:`instrument` for the named hooks (default: all)."""
    for name in hooks or tuple(_HOOKS):
        library, module = _HOOKS[name]
        if importlib.util.find_spec(library) is None:
            continue
        hook = importlib.import_module(module, __package__)
        if hook.is_instrumented():
            hook.uninstrument()
