"""Hook for the ``openai`` SDK: ``chat.completions.create`` on ``OpenAI`` and ``AsyncOpenAI``
(and ``responses.create``, through :mod:`.api_hooks`).

Each call becomes a GenAI-semconv ``chat {model}`` span (made current, so lower layers
such as OpenInference's request span nest under it); streams are re-assembled as they
are consumed.  When the client points at a tracerl-served endpoint the request asks for
``return_token_ids`` and ``logprobs`` and the exact ids are kept as a token record joined
by span id / response id.  Capture failures never reach the caller.

A failed call (refused or dropped connection, timeout, 5xx) inside a rollout is noted
as an infrastructure failure (:mod:`.faults`), so the rollout raises even when the agent
swallows the error; a retry of the same request that succeeds forgives it.
"""

from __future__ import annotations

import functools
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

from . import semconv as sc
from .endpoints import is_tracerl_endpoint
from .health import record_error
from .model_calls import RESOURCE_CLIENT, CallRecord, detach_context, end_span_with_error
from .patching import Patches
from .spans import finish_chat_span, start_chat_span
from .streams import AsyncStreamRecorder, StreamRecorder

_patches = Patches()


def prepare_request(kwargs: dict[str, Any], base_url: Any) -> bool:
    """Ask a tracerl endpoint for token ids and logprobs; returns whether it did."""
    if not is_tracerl_endpoint(base_url):
        return False
    extra_body = kwargs.get("extra_body")
    extra_body = dict(extra_body) if isinstance(extra_body, dict) else {}
    extra_body.setdefault("return_token_ids", True)
    kwargs["extra_body"] = extra_body
    if kwargs.get("logprobs") in (None, False) or type(kwargs.get("logprobs")).__name__ == "Omit":
        kwargs["logprobs"] = True
    return True


OPENAI_TIMEOUT_KNOB = "the client's timeout, e.g. Model(inference_timeout=...)"


def _begin(completions: Any, kwargs: dict[str, Any]) -> tuple[Any, Any, CallRecord]:
    span = token = None
    client = RESOURCE_CLIENT.of(completions)
    base_url = getattr(client, "base_url", None)
    timeout = kwargs.get("timeout")
    target = base_url or "the OpenAI SDK client's endpoint"
    call = CallRecord(target, kwargs, getattr(client, "timeout", None) if timeout is None else timeout, OPENAI_TIMEOUT_KNOB)
    try:
        requested = prepare_request(kwargs, base_url)
        current = otel_context.get_current()
        span = start_chat_span(
            "openai", kwargs, provider="openai", base_url=base_url, token_ids_requested=requested, context=current
        )
        token = otel_context.attach(trace.set_span_in_context(span, current))
    except Exception as error:  # noqa: BLE001 - as ``guard``
        record_error("openai_request", error)
    return span, token, call


def _parsed(result: Any) -> Any:
    """The ChatCompletion behind a raw response (``with_raw_response``), else the result."""
    if type(result).__name__ == "LegacyAPIResponse" and hasattr(result, "parse"):
        return result.parse()
    return result


def _respond(span: Any, result: Any, stream_type: str, recorder: type, call: CallRecord) -> Any:
    """What the caller gets back: ``result``, or a recorder that finishes the span as it streams."""
    if span is None:
        call.ended()
        return result
    try:
        value = _parsed(result)
        if value.__class__.__name__ == stream_type and (hasattr(value, "__iter__") or hasattr(value, "__aiter__")):
            if value is result:
                stream = recorder(value, span, "openai")
                stream.on_end = call.ended  # a stream that breaks is a failed call too
                return stream
            span.set_attribute(sc.STREAM, True)  # raw streaming response: request side only
            span.end()
            return result
        finish_chat_span(span, value)
    except Exception as error:  # noqa: BLE001 - as ``guard``
        record_error("openai_response", error)
    call.ended()
    return result


def _wrap_sync(original: Any) -> Any:
    @functools.wraps(original)
    def create(self: Any, *args: Any, **kwargs: Any) -> Any:
        span, token, call = _begin(self, kwargs)
        try:
            result = original(self, *args, **kwargs)
        except BaseException as error:
            detach_context(token)
            call.returned()
            end_span_with_error(span, error)
            call.failed(error)
            raise
        detach_context(token)
        call.returned()
        return _respond(span, result, "Stream", StreamRecorder, call)

    create.__tracerl_original__ = original  # type: ignore[attr-defined]
    return create


def _wrap_async(original: Any) -> Any:
    @functools.wraps(original)
    async def create(self: Any, *args: Any, **kwargs: Any) -> Any:
        span, token, call = _begin(self, kwargs)
        try:
            result = await original(self, *args, **kwargs)
        except BaseException as error:
            detach_context(token)
            call.returned()
            end_span_with_error(span, error)
            call.failed(error)
            raise
        detach_context(token)
        call.returned()
        return _respond(span, result, "AsyncStream", AsyncStreamRecorder, call)

    create.__tracerl_original__ = original  # type: ignore[attr-defined]
    return create


def instrument() -> bool:
    """Patch ``chat.completions.create`` and ``responses.create`` (sync and async; ``responses.stream``
    calls ``create``); idempotent. False if ``openai`` is missing."""
    try:
        from openai.resources.chat.completions import AsyncCompletions, Completions
    except ImportError:
        return False
    for resource in (Completions, AsyncCompletions):
        _patches.apply(resource, "__init__", RESOURCE_CLIENT.wrap)
    _patches.apply(Completions, "create", _wrap_sync)
    _patches.apply(AsyncCompletions, "create", _wrap_async)
    try:
        from openai.resources.responses import AsyncResponses, Responses
    except ImportError:  # an SDK from before the Responses API
        return True
    from .api_hooks import RESPONSES, wrap_create

    for resource in (Responses, AsyncResponses):
        _patches.apply(resource, "__init__", RESOURCE_CLIENT.wrap)
    _patches.apply(Responses, "create", lambda original: wrap_create(RESPONSES, original, is_async=False))
    _patches.apply(AsyncResponses, "create", lambda original: wrap_create(RESPONSES, original, is_async=True))
    return True


def uninstrument() -> None:
    _patches.restore()


def is_instrumented() -> bool:
    return bool(_patches)
