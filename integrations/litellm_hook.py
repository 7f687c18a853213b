"""Hook for LiteLLM: ``litellm.completion`` / ``litellm.acompletion`` (streaming included), and the
Responses and Anthropic routes (``responses`` / ``aresponses``, ``anthropic_messages``; not streamed).

Patches the module attributes, so enable it before ``from litellm import acompletion``
(``litellm.acompletion(...)`` always goes through the hook).  Requests to a tracerl-served
``base_url``/``api_base`` ask for token ids and logprobs; LiteLLM keeps ``prompt_token_ids`` and
per-choice ``token_ids`` on its ``ModelResponse``.  Failed calls inside a rollout are noted as
infrastructure failures like the OpenAI hook's (the wrapper: :mod:`.api_hooks`).
"""

from __future__ import annotations

from .api_hooks import LITELLM_CHAT, LITELLM_MESSAGES, LITELLM_RESPONSES, litellm_endpoint, wrap_create
from .patching import Patches

_patches = Patches()
_FUNCTIONS = [("completion", LITELLM_CHAT, False), ("acompletion", LITELLM_CHAT, True), ("responses", LITELLM_RESPONSES, False),
              ("aresponses", LITELLM_RESPONSES, True), ("anthropic_messages", LITELLM_MESSAGES, True)]  # fmt: skip


def instrument() -> bool:
    """Patch LiteLLM's chat, Responses and Anthropic functions (those its version has); idempotent."""
    try:
        import litellm
    except ImportError:
        return False
    for name, api, is_async in _FUNCTIONS:
        if hasattr(litellm, name):
            _patches.apply(litellm, name, lambda original, api=api, is_async=is_async: wrap_create(api, original, is_async, litellm_endpoint))
    return True


uninstrument = _patches.restore
is_instrumented = _patches.__bool__
