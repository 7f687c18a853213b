"""Replacing library functions with capture wrappers, and putting the originals back.

Every hook that patches a library (the OpenAI SDK, LiteLLM, the MCP client) keeps its
originals in one :class:`Patches`, so enabling twice never wraps a wrapper and disabling
restores exactly what was there.
"""

from __future__ import annotations

import functools
import inspect
import weakref
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


class InitArgument:
    """One constructor argument of a library's objects, kept per object as it is constructed.

    How a hook learns what an object was built with (the client behind an SDK resource, a
    session's default timeout) through the library's public constructor, never its private
    attributes.  Objects made before the hook was enabled are unknown (:meth:`of` gives None).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._values: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    def wrap(self, original: Any) -> Any:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def __init__(obj: Any, *args: Any, **kwargs: Any) -> None:
            original(obj, *args, **kwargs)
            try:
                value = signature.bind_partial(obj, *args, **kwargs).arguments.get(self.name)
                if value is not None:
                    self._values[obj] = value
            except (TypeError, ValueError):  # an unexpected call shape: the object stays unknown
                pass

        return __init__

    def of(self, obj: Any) -> Any:
        """The argument ``obj`` was constructed with, or None."""
        try:
            return self._values.get(obj)
        except TypeError:  # not weak-referenceable
            return None
