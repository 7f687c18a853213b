"""Hook for the ``openai`` SDK: ``chat.completions.create``, ``responses.create`` and the legacy
``completions.create``, on ``OpenAI`` and ``AsyncOpenAI`` (the wrapper: :mod:`.api_hooks`).

Each call becomes one record (a GenAI-semconv ``chat {model}`` span for exporters when one listens,
made current during the call so lower layers nest under it); streams are re-assembled as they are
consumed.  When the client points at a tracerl-served endpoint the chat request asks for
``return_token_ids`` and ``logprobs``.  Capture failures never reach the caller.

A failed call (refused or dropped connection, timeout, 5xx) inside a rollout is an infrastructure
failure (:mod:`.faults`): the rollout raises even when the agent swallows the error.
"""

from __future__ import annotations

from .api_hooks import CHAT, COMPLETIONS, RESPONSES, wrap_create
from .model_calls import RESOURCE_CLIENT
from .patching import Patches

_patches = Patches()


def instrument() -> bool:
    """Patch ``chat.completions.create``, ``responses.create`` (``responses.stream`` calls it) and the
    legacy ``completions.create``, sync and async; idempotent. False if ``openai`` is missing."""
    try:
        from openai.resources import completions as text
        from openai.resources.chat import completions as chat
    except ImportError:
        return False
    apis = [(chat.Completions, chat.AsyncCompletions, CHAT), (text.Completions, text.AsyncCompletions, COMPLETIONS)]
    try:
        from openai.resources import responses

        apis.append((responses.Responses, responses.AsyncResponses, RESPONSES))
    except ImportError:  # an SDK from before the Responses API
        pass
    for sync, asynchronous, api in apis:
        for resource in (sync, asynchronous):
            _patches.apply(resource, "__init__", RESOURCE_CLIENT.wrap)
        _patches.apply(sync, "create", lambda original, api=api: wrap_create(api, original, is_async=False))
        _patches.apply(asynchronous, "create", lambda original, api=api: wrap_create(api, original, is_async=True))
    return True


uninstrument = _patches.restore
is_instrumented = _patches.__bool__
