"""Hook for LiteLLM: ``litellm.completion`` / ``litellm.acompletion`` (streaming included).

Patches the module attributes, so enable it before ``from litellm import acompletion``
(``litellm.acompletion(...)`` always goes through the hook).  Requests to a
tracerl-served ``base_url``/``api_base`` ask for token ids and logprobs; LiteLLM keeps
``prompt_token_ids`` and per-choice ``token_ids`` on its ``ModelResponse``.
"""

from __future__ import annotations

import functools
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

from .health import guard
from .openai_hook import _detach, _fail, prepare_request
from .spans import finish_chat_span, start_chat_span
from .streams import AsyncStreamRecorder, StreamRecorder

_originals: dict[str, Any] = {}


def _begin(kwargs: dict[str, Any]) -> tuple[Any, Any]:
    span = token = None
    with guard("litellm_request"):
        base_url = kwargs.get("base_url") or kwargs.get("api_base")
        requested = prepare_request(kwargs, base_url)
        model = str(kwargs.get("model") or "")
        provider = model.split("/", 1)[0] if "/" in model else "litellm"
        span = start_chat_span("litellm", kwargs, provider=provider, base_url=base_url, token_ids_requested=requested)
        token = otel_context.attach(trace.set_span_in_context(span))
    return span, token


def _positional(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``completion(model, messages, ...)`` positional form -> keyword form."""
    if args:
        names = ("model", "messages")
        for name, value in zip(names, args):
            kwargs.setdefault(name, value)
        args = args[len(names) :]
    return args, kwargs


def _wrap_sync(original: Any) -> Any:
    @functools.wraps(original)
    def completion(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _positional(args, kwargs)
        span, token = _begin(kwargs)
        try:
            result = original(*args, **kwargs)
        except BaseException as error:
            _detach(token)
            _fail(span, error)
            raise
        _detach(token)
        if span is None:
            return result
        with guard("litellm_response"):
            if kwargs.get("stream"):
                return StreamRecorder(result, span, "litellm")
            finish_chat_span(span, result)
        return result

    completion.__tracerl_original__ = original  # type: ignore[attr-defined]
    return completion


def _wrap_async(original: Any) -> Any:
    @functools.wraps(original)
    async def acompletion(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _positional(args, kwargs)
        span, token = _begin(kwargs)
        try:
            result = await original(*args, **kwargs)
        except BaseException as error:
            _detach(token)
            _fail(span, error)
            raise
        _detach(token)
        if span is None:
            return result
        with guard("litellm_response"):
            if kwargs.get("stream"):
                return AsyncStreamRecorder(result, span, "litellm")
            finish_chat_span(span, result)
        return result

    acompletion.__tracerl_original__ = original  # type: ignore[attr-defined]
    return acompletion


def instrument() -> bool:
    """Patch ``litellm.completion`` and ``litellm.acompletion``; idempotent."""
    try:
        import litellm
    except ImportError:
        return False
    if "completion" not in _originals:
        _originals["completion"] = litellm.completion
        litellm.completion = _wrap_sync(litellm.completion)
    if "acompletion" not in _originals:
        _originals["acompletion"] = litellm.acompletion
        litellm.acompletion = _wrap_async(litellm.acompletion)
    return True


def uninstrument() -> None:
    import litellm

    if "completion" in _originals:
        litellm.completion = _originals.pop("completion")
    if "acompletion" in _originals:
        litellm.acompletion = _originals.pop("acompletion")


def is_instrumented() -> bool:
    return bool(_originals)
