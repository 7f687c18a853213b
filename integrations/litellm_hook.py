"""Hook for LiteLLM: ``litellm.completion`` / ``litellm.acompletion`` (streaming included), and the
Responses and Anthropic routes (``responses`` / ``aresponses``, ``anthropic_messages``; not streamed).

Patches the module attributes, so enable it before ``from litellm import acompletion``
(``litellm.acompletion(...)`` always goes through the hook).  Requests to a
tracerl-served ``base_url``/``api_base`` ask for token ids and logprobs; LiteLLM keeps
``prompt_token_ids`` and per-choice ``token_ids`` on its ``ModelResponse``.  Failed calls
inside a rollout are noted as infrastructure failures like the OpenAI hook's.
"""

from __future__ import annotations

import functools
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

from .health import guard
from .model_calls import CallRecord, detach_context, end_span_with_error
from .openai_hook import prepare_request
from .patching import Patches
from .spans import finish_chat_span, start_chat_span
from .streams import AsyncStreamRecorder, StreamRecorder

_patches = Patches()


LITELLM_TIMEOUT_KNOB = "litellm's timeout=..., e.g. Model(inference_timeout=...) via litellm_completion_params()"


def _begin(kwargs: dict[str, Any]) -> tuple[Any, Any, CallRecord]:
    span = token = None
    base_url = kwargs.get("base_url") or kwargs.get("api_base")
    call = CallRecord(base_url or kwargs.get("model"), kwargs, kwargs.get("timeout"), LITELLM_TIMEOUT_KNOB)
    with guard("litellm_request"):
        requested = prepare_request(kwargs, base_url)
        model = str(kwargs.get("model") or "")
        provider = model.split("/", 1)[0] if "/" in model else "litellm"
        span = start_chat_span("litellm", kwargs, provider=provider, base_url=base_url, token_ids_requested=requested)
        token = otel_context.attach(trace.set_span_in_context(span))
    return span, token, call


def _positional(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``completion(model, messages, ...)`` positional form -> keyword form."""
    if args:
        names = ("model", "messages")
        for name, value in zip(names, args):
            kwargs.setdefault(name, value)
        args = args[len(names) :]
    return args, kwargs


def _respond(span: Any, result: Any, recorder: type | None, call: CallRecord) -> Any:
    """What the caller gets back: ``result``, or a recorder that finishes the span as it streams."""
    if span is None:
        call.ended()
        return result
    with guard("litellm_response"):
        if recorder is not None:
            stream = recorder(result, span, "litellm")
            stream.on_end = call.ended
            return stream
        finish_chat_span(span, result)
    call.ended()
    return result


def _wrap_sync(original: Any) -> Any:
    @functools.wraps(original)
    def completion(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _positional(args, kwargs)
        span, token, call = _begin(kwargs)
        try:
            result = original(*args, **kwargs)
        except BaseException as error:
            detach_context(token)
            call.returned()
            end_span_with_error(span, error)
            call.failed(error)
            raise
        detach_context(token)
        call.returned()
        return _respond(span, result, StreamRecorder if kwargs.get("stream") else None, call)

    completion.__tracerl_original__ = original  # type: ignore[attr-defined]
    return completion


def _wrap_async(original: Any) -> Any:
    @functools.wraps(original)
    async def acompletion(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _positional(args, kwargs)
        span, token, call = _begin(kwargs)
        try:
            result = await original(*args, **kwargs)
        except BaseException as error:
            detach_context(token)
            call.returned()
            end_span_with_error(span, error)
            call.failed(error)
            raise
        detach_context(token)
        call.returned()
        return _respond(span, result, AsyncStreamRecorder if kwargs.get("stream") else None, call)

    acompletion.__tracerl_original__ = original  # type: ignore[attr-defined]
    return acompletion


def instrument() -> bool:
    """Patch ``litellm.completion`` / ``acompletion``, and its Responses (``responses`` / ``aresponses``) and
    Anthropic (``anthropic_messages``) routes; idempotent."""
    try:
        import litellm
    except ImportError:
        return False
    _patches.apply(litellm, "completion", _wrap_sync)
    _patches.apply(litellm, "acompletion", _wrap_async)
    from .api_hooks import LITELLM_MESSAGES, LITELLM_RESPONSES, litellm_endpoint, wrap_create

    for name, api, is_async in (("responses", LITELLM_RESPONSES, False), ("aresponses", LITELLM_RESPONSES, True),
                                ("anthropic_messages", LITELLM_MESSAGES, True)):  # fmt: skip
        if hasattr(litellm, name):
            _patches.apply(litellm, name, lambda original, api=api, is_async=is_async: wrap_create(api, original, is_async, litellm_endpoint))
    return True


def uninstrument() -> None:
    _patches.restore()


def is_instrumented() -> bool:
    return bool(_patches)
