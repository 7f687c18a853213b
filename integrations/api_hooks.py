"""Hooks for OpenAI's Responses API and Anthropic's Messages API.

``client.responses.create`` / ``responses.stream`` (OpenAI SDK, sync and async) and
``client.messages.create`` / ``messages.stream`` (``anthropic`` SDK, sync and async) are recorded
as chat-completion calls are: one ``chat {model}`` span per call, the conversation and answer in
chat shape (:mod:`.api_shapes`), and, from a tracerl endpoint, the sampled token ids and logprobs
the answer carries.  So a trajectory of an agent on either API is the same ``Trajectory`` a
chat-completions agent yields, and ``backend.train`` trains on it unchanged.

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
from .spans import end_with_error, finish_chat_span, start_chat_span
from .streams import AsyncStreamRecorder, StreamRecorder


@dataclass(frozen=True)
class Api:
    """What one API's hook needs to know about it."""

    layer: str
    provider: str
    request: Callable[[dict[str, Any]], dict[str, Any]]
    """``create``'s keyword arguments -> chat keyword arguments (the whole conversation)."""
    completion: Callable[[Any, dict[str, Any]], dict[str, Any]]
    """A finished answer and the chat request -> a chat completion."""
    accumulator: Callable[["Api", dict[str, Any]], Any]
    """A new re-assembler of the API's stream events (``add(event)``, ``finish(span)``)."""
    knob: str


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
    completion=api_shapes.responses_completion, accumulator=ResponseEvents, knob="litellm's timeout=...",
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
    try:
        chat = api.request(kwargs)
    except Exception as error:  # noqa: BLE001 - a request capture cannot read still goes out
        record_error(f"{api.layer}_request", error)
    call = CallRecord(base_url or api.provider, chat or kwargs, client_timeout if timeout is None else timeout, api.knob)
    if not chat:
        return span, token, call, chat
    try:
        current = otel_context.get_current()
        span = start_chat_span(api.layer, chat, provider=api.provider, base_url=base_url,
                               token_ids_requested=is_tracerl_endpoint(base_url), context=current)  # fmt: skip
        token = otel_context.attach(trace.set_span_in_context(span, current))
    except Exception as error:  # noqa: BLE001 - as ``guard``
        record_error(f"{api.layer}_request", error)
    return span, token, call, chat


def _respond(api: Api, span: Any, result: Any, call: CallRecord, chat: dict[str, Any]) -> Any:
    if span is None:
        call.ended()
        return result
    try:
        name = type(result).__name__
        if name in ("Stream", "AsyncStream"):
            recorder = (StreamRecorder if name == "Stream" else AsyncStreamRecorder)(result, span, api.layer, api.accumulator(api, chat))
            recorder.on_end = call.ended
            return recorder
        if chat.get("stream"):  # a stream of another kind (LiteLLM's): not re-assembled, the rollout warns of it
            span.end()
            record_error(f"{api.layer}_stream_not_captured")
        else:
            finish_chat_span(span, api.completion(result, chat))
    except Exception as error:  # noqa: BLE001 - as ``guard``
        record_error(f"{api.layer}_response", error)
    call.ended()
    return result


def wrap_create(api: Api, original: Any, is_async: bool, endpoint: Callable[..., tuple[Any, Any]] = sdk_endpoint) -> Any:
    """``original`` (an SDK's ``create`` method, or a LiteLLM function with ``endpoint=litellm_endpoint``) recorded."""

    def fail(token: Any, call: CallRecord, span: Any, error: BaseException) -> None:
        detach_context(token)
        call.returned()
        end_span_with_error(span, error)
        call.failed(error)

    if is_async:

        @functools.wraps(original)
        async def create_async(*args: Any, **kwargs: Any) -> Any:
            span, token, call, chat = _begin(api, endpoint(args, kwargs), kwargs)
            try:
                result = await original(*args, **kwargs)
            except BaseException as error:
                fail(token, call, span, error)
                raise
            detach_context(token)
            call.returned()
            return _respond(api, span, result, call, chat)

        return create_async

    @functools.wraps(original)
    def create(*args: Any, **kwargs: Any) -> Any:
        span, token, call, chat = _begin(api, endpoint(args, kwargs), kwargs)
        try:
            result = original(*args, **kwargs)
        except BaseException as error:
            fail(token, call, span, error)
            raise
        detach_context(token)
        call.returned()
        return _respond(api, span, result, call, chat)

    return create


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
    completion=MESSAGES.completion, accumulator=MessageEvents, knob="litellm's timeout=...",
)
