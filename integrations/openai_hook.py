"""Hook for the ``openai`` SDK: ``chat.completions.create`` on ``OpenAI`` and ``AsyncOpenAI``.

Each call becomes a GenAI-semconv ``chat {model}`` span (made current, so lower layers
such as OpenInference's request span nest under it); streams are re-assembled as they
are consumed.  When the client points at a tracerl-served endpoint the request asks for
``return_token_ids`` and ``logprobs`` and the exact ids are kept as a token record joined
by span id / response id.  Capture failures never reach the caller.
"""

from __future__ import annotations

import functools
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

from . import semconv as sc
from .endpoints import is_tracerl_endpoint
from .health import guard
from .patching import Patches
from .spans import end_with_error, finish_chat_span, start_chat_span
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


def _begin(completions: Any, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    span = token = None
    with guard("openai_request"):
        client = getattr(completions, "_client", None)
        base_url = getattr(client, "base_url", None)
        requested = prepare_request(kwargs, base_url)
        span = start_chat_span("openai", kwargs, provider="openai", base_url=base_url, token_ids_requested=requested)
        token = otel_context.attach(trace.set_span_in_context(span))
    return span, token


def _detach(token: Any) -> None:
    if token is not None:
        with guard("openai_detach"):
            otel_context.detach(token)


def _fail(span: Any, error: BaseException) -> None:
    if span is not None:
        with guard("openai_error"):
            end_with_error(span, error)


def _parsed(result: Any) -> Any:
    """The ChatCompletion behind a raw response (``with_raw_response``), else the result."""
    if type(result).__name__ == "LegacyAPIResponse" and hasattr(result, "parse"):
        return result.parse()
    return result


def _respond(span: Any, result: Any, stream_type: str, recorder: type) -> Any:
    """What the caller gets back: ``result``, or a recorder that finishes the span as it streams."""
    if span is None:
        return result
    with guard("openai_response"):
        value = _parsed(result)
        if value.__class__.__name__ == stream_type and (hasattr(value, "__iter__") or hasattr(value, "__aiter__")):
            if value is result:
                return recorder(value, span, "openai")
            span.set_attribute(sc.STREAM, True)  # raw streaming response: request side only
            span.end()
            return result
        finish_chat_span(span, value)
    return result


def _wrap_sync(original: Any) -> Any:
    @functools.wraps(original)
    def create(self: Any, *args: Any, **kwargs: Any) -> Any:
        span, token = _begin(self, kwargs)
        try:
            result = original(self, *args, **kwargs)
        except BaseException as error:
            _detach(token)
            _fail(span, error)
            raise
        _detach(token)
        return _respond(span, result, "Stream", StreamRecorder)

    create.__tracerl_original__ = original  # type: ignore[attr-defined]
    return create


def _wrap_async(original: Any) -> Any:
    @functools.wraps(original)
    async def create(self: Any, *args: Any, **kwargs: Any) -> Any:
        span, token = _begin(self, kwargs)
        try:
            result = await original(self, *args, **kwargs)
        except BaseException as error:
            _detach(token)
            _fail(span, error)
            raise
        _detach(token)
        return _respond(span, result, "AsyncStream", AsyncStreamRecorder)

    create.__tracerl_original__ = original  # type: ignore[attr-defined]
    return create


def instrument() -> bool:
    """Patch ``chat.completions.create`` (sync and async); idempotent. False if ``openai`` is missing."""
    try:
        from openai.resources.chat.completions import AsyncCompletions, Completions
    except ImportError:
        return False
    _patches.apply(Completions, "create", _wrap_sync)
    _patches.apply(AsyncCompletions, "create", _wrap_async)
    return True


def uninstrument() -> None:
    _patches.restore()


def is_instrumented() -> bool:
    return bool(_patches)
