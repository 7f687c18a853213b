"""Replacing library functions with capture wrappers, and putting the originals back.

Every hook that patches a library (the OpenAI SDK, LiteLLM, the MCP client) keeps its
originals in one :class:`Patches`, so enabling twice never wraps a wrapper and disabling
restores exactly what was there.
"""

from __future__ import annotations

from typing import Any, Callable


class Patches:
    """The attributes one hook has replaced: ``(owner, name) -> original``."""

    def __init__(self) -> None:
        self._originals: dict[tuple[Any, str], Any] = {}

    def apply(self, owner: Any, name: str, wrap: Callable[[Any], Any]) -> None:
        """Replace ``owner.name`` by ``wrap(original)`` unless this hook already did."""
        if (owner, name) not in self._originals:
            original = getattr(owner, name)
            self._originals[(owner, name)] = original
            setattr(owner, name, wrap(original))

    def restore(self) -> None:
        """Put every original back."""
        while self._originals:
            (owner, name), original = self._originals.popitem()
            setattr(owner, name, original)

    def __bool__(self) -> bool:
        return bool(self._originals)
