"""Hook for the ``anthropic`` SDK: ``messages.create`` and ``messages.stream``, sync and async.

Each call is recorded as a chat-completion call is (:mod:`.api_hooks`): agents on Anthropic's
Messages API pointed at tracerl's endpoint (``/v1/messages``) become trajectories with the
sampled token ids, like any other.
"""

from __future__ import annotations

from .api_hooks import MESSAGES, wrap_create, wrap_stream
from .model_calls import RESOURCE_CLIENT
from .patching import Patches

_patches = Patches()


def instrument() -> bool:
    """Patch ``messages.create`` and ``messages.stream`` (sync and async); idempotent. False if ``anthropic`` is missing."""
    try:
        from anthropic.resources.messages import AsyncMessages, Messages
    except ImportError:
        return False
    for resource in (Messages, AsyncMessages):
        _patches.apply(resource, "__init__", RESOURCE_CLIENT.wrap)
    _patches.apply(Messages, "create", lambda original: wrap_create(MESSAGES, original, is_async=False))
    _patches.apply(AsyncMessages, "create", lambda original: wrap_create(MESSAGES, original, is_async=True))
    _patches.apply(Messages, "stream", wrap_stream)
    _patches.apply(AsyncMessages, "stream", wrap_stream)
    return True


uninstrument = _patches.restore
is_instrumented = _patches.__bool__
