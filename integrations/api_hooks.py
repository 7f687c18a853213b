"""The wrapper every model-call hook uses, and the APIs it reads: chat completions, OpenAI's Responses
API, Anthropic's Messages API, legacy completions (OpenAI SDK, ``anthropic`` SDK, LiteLLM).

Every hooked call is one record, opened before the call and ended with its answer (or as its
stream ends): the conversation and answer in chat shape (:mod:`.api_shapes` translates the other
APIs), and, from a tracerl endpoint, the sampled token ids and logprobs the answer carries.  So a
trajectory of an agent on any of them is the same ``Trajectory``, and ``backend.train`` trains on
it unchanged.

A call whose request cannot be read (a shape :mod:`.api_shapes` does not know) goes on untouched
and is counted (``capture_error_counts``); the rollout then warns that it missed a call.  A
failed call inside a rollout is an infrastructure failure as for chat completions (:mod:`.faults`).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Callable

from opentelemetry import context as otel_context
from opentelemetry import trace

from . import api_shapes
from .endpoints import is_tracerl_endpoint
from .health import guard, record_error
from .model_calls import RESOURCE_CLIENT, CallRecord, detach_context, end_span_with_error
from .spans import end_with_error, finish_chat_span, given, start_chat_span
from .streams import AsyncStreamRecorder, ChunkAccumulator, StreamRecorder


@dataclass(frozen=True)
class Api:
    """What one API's hook needs to know about it."""

    layer: str
    provider: str
    request: Callable[[dict[str, Any]], dict[str, Any]]
    """``create``'s keyword arguments -> chat keyword arguments (the whole conversation)."""
    completion: Callable[[Any, dict[str, Any]], dict[str, Any]]
    """A finished answer and the chat request -> a chat completion."""
    accumulator: Callable[["Api", dict[str, Any]], Any] | None
    """A new re-assembler of the API's stream events (``add(event)``, ``finish(span)``); None: streams not captured."""
    knob: str
    prepare: Callable[[dict[str, Any], Any], bool] | None = None
    """Asks a tracerl endpoint (base URL) for token ids in ``create``'s keyword arguments, where the API
    must ask for them; returns whether it did."""
    positional: tuple[str, ...] = ()
    """Names of a function's leading positional parameters (``litellm.completion(model, messages)``)."""


class _FinalAnswer:
    """Keeps a stream's finished answer; ends the span with it (or as failed when none came)."""

    def __init__(self, api: Api, chat: dict[str, Any]) -> None:
        self.api, self.chat = api, chat
        self.answer: Any = None

    def finish(self, span: Any) -> None:
        if self.answer is None:
            end_with_error(span, RuntimeError(f"the {self.api.provider} stream ended before its final event"))
            return
        finish_chat_span(span, self.api.completion(self.answer, self.chat))


class ResponseEvents(_FinalAnswer):
    """Responses-API stream events: the final ``response`` comes whole with the last event."""

    def add(self, event: Any) -> None:
        if getattr(event, "type", None) in ("response.completed", "response.incomplete"):
            self.answer = event.response


class MessageEvents(_FinalAnswer):
    """Messages-API stream events, re-assembled into the ``message`` they stream."""

    def __init__(self, api: Api, chat: dict[str, Any]) -> None:
        super().__init__(api, chat)
        self._message: dict[str, Any] | None = None
        self._json: dict[int, list[str]] = {}

    def add(self, event: Any) -> None:
        kind = getattr(event, "type", None)
        if kind == "message_start":
            self._message = {**event.message.model_dump(), "content": []}
        elif self._message is None:
            return
        elif kind == "content_block_start":
            self._message["content"].append(event.content_block.model_dump())
        elif kind == "content_block_delta":
            block, delta = self._message["content"][event.index], event.delta
            if delta.type == "text_delta":
                block["text"] = block.get("text", "") + delta.text
            elif delta.type == "input_json_delta":
                self._json.setdefault(event.index, []).append(delta.partial_json)
        elif kind == "content_block_stop" and event.index in self._json:
            self._message["content"][event.index]["input"] = json.loads("".join(self._json.pop(event.index)) or "{}")
        elif kind == "message_delta":
            self._message.update(stop_reason=event.delta.stop_reason, stop_sequence=event.delta.stop_sequence)
            self._message["usage"] = {**(self._message.get("usage") or {}), "output_tokens": event.usage.output_tokens}
        elif kind == "message_stop":
            self.answer = self._message


RESPONSES = Api(
    layer="openai_responses", provider="openai", request=api_shapes.responses_request, completion=api_shapes.responses_completion,
    accumulator=ResponseEvents, knob="the client's timeout, e.g. Model(inference_timeout=...)",
)  # fmt: skip
LITELLM_RESPONSES = Api(
    layer="litellm_responses", provider="litellm", request=api_shapes.responses_request,
    completion=api_shapes.responses_completion, accumulator=None, knob="litellm's timeout=...", positional=("input", "model"),
)  # fmt: skip
MESSAGES = Api(
    layer="anthropic", provider="anthropic", request=api_shapes.messages_request,
    completion=lambda message, _chat: api_shapes.messages_completion(message), accumulator=MessageEvents,
    knob="the client's timeout (anthropic.Anthropic(timeout=...))",
)  # fmt: skip


def sdk_endpoint(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """(base URL, timeout) of an SDK method's call: its resource's client (``args[0]``)."""
    client = RESOURCE_CLIENT.of(args[0])
    return getattr(client, "base_url", None), getattr(client, "timeout", None)


def litellm_endpoint(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """(base URL, timeout) of a LiteLLM function's call: its keyword arguments."""
    return kwargs.get("api_base") or kwargs.get("base_url"), None


def _begin(api: Api, endpoint: tuple[Any, Any], kwargs: dict[str, Any]) -> tuple[Any, Any, CallRecord, dict[str, Any]]:
    span = token = None
    chat: dict[str, Any] = {}
    base_url, client_timeout = endpoint
    timeout = kwargs.get("timeout")
    requested = False
    try:
        chat = api.request(kwargs)
        requested = api.prepare(kwargs, base_url) if api.prepare is not None else is_tracerl_endpoint(base_url)
    except Exception as error:  # noqa: BLE001 - a request capture cannot read still goes out
        record_error(f"{api.layer}_request", error)
    call = CallRecord(base_url or api.provider, chat or kwargs, client_timeout if timeout is None else timeout, api.knob)
    if not chat:
        return span, token, call, chat
    try:
        current = otel_context.get_current()
        span = start_chat_span(api.layer, chat, provider=api.provider, base_url=base_url,
                               token_ids_requested=requested, context=current)  # fmt: skip
        token = otel_context.attach(trace.set_span_in_context(span, current))
    except Exception as error:  # noqa: BLE001 - as ``guard``
        record_error(f"{api.layer}_request", error)
    return span, token, call, chat


def _respond(api: Api, span: Any, result: Any, call: CallRecord, chat: dict[str, Any], is_async: bool) -> Any:
    """What the caller gets back: ``result``, or a recorder that ends the call's record as it streams."""
    if span is None:
        call.ended()
        return result
    try:
        raw = type(result).__name__ == "LegacyAPIResponse" and hasattr(result, "parse")  # ``with_raw_response``
        value = result.parse() if raw else result
        if not chat.get("stream"):
            finish_chat_span(span, api.completion(value, chat))
        elif value is not result:  # a raw streaming response: the request side only
            span.end()
        elif api.accumulator is not None:
            recorder = (AsyncStreamRecorder if is_async else StreamRecorder)(result, span, api.layer, api.accumulator(api, chat))
            recorder.on_end = call.ended  # a stream that breaks is a failed call too
            return recorder
        else:  # a stream not re-assembled (LiteLLM's Responses / Anthropic routes, legacy completions'): the rollout warns
            span.end()
            record_error(f"{api.layer}_stream_not_captured")
    except Exception as error:  # noqa: BLE001 - as ``guard``
        record_error(f"{api.layer}_response", error)
    call.ended()
    return result


def wrap_create(api: Api, original: Any, is_async: bool, endpoint: Callable[..., tuple[Any, Any]] = sdk_endpoint) -> Any:
    """``original`` (an SDK's ``create`` method, or a LiteLLM function with ``endpoint=litellm_endpoint``),
    each call recorded: its record opened before it, ended with its answer (or its stream's)."""

    def fail(token: Any, call: CallRecord, span: Any, error: BaseException) -> None:
        detach_context(token)
        call.returned()
        end_span_with_error(span, error)
        call.failed(error)

    if is_async:

        @functools.wraps(original)
        async def create_async(*args: Any, **kwargs: Any) -> Any:
            args = _keywords(api, args, kwargs)
            span, token, call, chat = _begin(api, endpoint(args, kwargs), kwargs)
            try:
                result = await original(*args, **kwargs)
            except BaseException as error:
                fail(token, call, span, error)
                raise
            detach_context(token)
            call.returned()
            return _respond(api, span, result, call, chat, True)

        create_async.__tracerl_original__ = original  # type: ignore[attr-defined]
        return create_async

    @functools.wraps(original)
    def create(*args: Any, **kwargs: Any) -> Any:
        args = _keywords(api, args, kwargs)
        span, token, call, chat = _begin(api, endpoint(args, kwargs), kwargs)
        try:
            result = original(*args, **kwargs)
        except BaseException as error:
            fail(token, call, span, error)
            raise
        detach_context(token)
        call.returned()
        return _respond(api, span, result, call, chat, False)

    create.__tracerl_original__ = original  # type: ignore[attr-defined]
    return create


def _keywords(api: Api, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Leading positional arguments named in ``api.positional`` moved into ``kwargs``; the rest."""
    for name, value in zip(api.positional, args):
        kwargs.setdefault(name, value)
    return args[len(api.positional) :] if api.positional else args


class _MessageStreamManager:
    """Around the ``anthropic`` SDK's ``messages.stream(...)`` manager: the call is recorded from
    the stream's final message snapshot when the ``with`` block ends."""

    def __init__(self, manager: Any, kwargs: dict[str, Any], resource: Any) -> None:
        self._manager, self._kwargs, self._resource = manager, kwargs, resource
        self._span: Any = None
        self._call: CallRecord | None = None
        self._chat: dict[str, Any] = {}
        self._stream: Any = None

    def _start(self) -> None:
        self._span, token, self._call, self._chat = _begin(MESSAGES, sdk_endpoint((self._resource,), self._kwargs),
                                                           {**self._kwargs, "stream": True})  # fmt: skip
        detach_context(token)  # the stream is consumed inside the caller's block: its spans are siblings

    def _end(self, error: BaseException | None) -> None:
        call, span = self._call, self._span
        if call is None:
            return
        call.returned()
        if error is not None:
            end_span_with_error(span, error)
            call.failed(error)
            return
        if span is not None:
            with guard("anthropic_stream_end"):
                snapshot = self._stream.current_message_snapshot
                if snapshot is None or snapshot.stop_reason is None:
                    end_with_error(span, RuntimeError("the anthropic stream was left before its final message"))
                else:
                    finish_chat_span(span, MESSAGES.completion(snapshot, self._chat))
        call.ended()

    def __enter__(self) -> Any:
        self._start()
        try:
            self._stream = self._manager.__enter__()
        except BaseException as error:
            self._end(error)
            raise
        return self._stream

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> Any:
        try:
            return self._manager.__exit__(kind, error, traceback)
        finally:
            self._end(error)

    async def __aenter__(self) -> Any:
        self._start()
        try:
            self._stream = await self._manager.__aenter__()
        except BaseException as error:
            self._end(error)
            raise
        return self._stream

    async def __aexit__(self, kind: Any, error: Any, traceback: Any) -> Any:
        try:
            return await self._manager.__aexit__(kind, error, traceback)
        finally:
            self._end(error)


def wrap_stream(original: Any) -> Any:
    @functools.wraps(original)
    def stream(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _MessageStreamManager(original(self, *args, **kwargs), kwargs, self)

    return stream


LITELLM_MESSAGES = Api(
    layer="litellm_anthropic", provider="litellm", request=api_shapes.messages_request,
    completion=MESSAGES.completion, accumulator=None, knob="litellm's timeout=...", positional=("max_tokens", "messages", "model"),
)  # fmt: skip


def prepare_request(kwargs: dict[str, Any], base_url: Any) -> bool:
    """Ask a tracerl endpoint for token ids and logprobs on a chat completion; returns whether it did
    (tracerl's servers send them anyway; another endpoint registered as tracerl's may not)."""
    if not is_tracerl_endpoint(base_url):
        return False
    extra_body = kwargs.get("extra_body")
    kwargs["extra_body"] = {"return_token_ids": True, **(extra_body if isinstance(extra_body, dict) else {})}
    if kwargs.get("logprobs") in (None, False) or not given(kwargs.get("logprobs")):
        kwargs["logprobs"] = True
    return True


def _ask_for_tokens(kwargs: dict[str, Any], base_url: Any) -> bool:
    """Legacy completions return token ids and logprobs only when asked (``logprobs=0``: the sampled ones)."""
    if not is_tracerl_endpoint(base_url):
        return False
    kwargs["extra_body"] = {**(kwargs.get("extra_body") or {}), "return_token_ids": True}
    if not given(kwargs.get("logprobs")):
        kwargs["logprobs"] = 0
    return True


COMPLETIONS = Api(
    layer="openai_completions", provider="openai", request=api_shapes.completions_request,
    completion=api_shapes.completions_completion, accumulator=None, knob=RESPONSES.knob, prepare=_ask_for_tokens,
)  # fmt: skip


CHAT = Api(
    layer="openai", provider="openai", request=lambda kwargs: kwargs, completion=lambda completion, _chat: completion,
    accumulator=lambda _api, _chat: ChunkAccumulator(), knob=RESPONSES.knob, prepare=prepare_request,
)  # fmt: skip
LITELLM_CHAT = Api(
    layer="litellm", provider="litellm", request=CHAT.request, completion=CHAT.completion, accumulator=CHAT.accumulator,
    knob="litellm's timeout=..., e.g. Model(inference_timeout=...) via litellm_completion_params()",
    prepare=prepare_request, positional=("model", "messages"),
)  # fmt: skip
