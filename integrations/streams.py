"""Streamed chat completions: pass chunks through untouched, re-assemble them on the side,
and end the span (with token ids, when the server streams them) once the stream is done."""

from __future__ import annotations

from typing import Any, Callable

from opentelemetry import trace

from .completions import extra_field, field, ints, logprob_values, sampling_of
from .health import guard
from .messages import openai_tool_call
from .spans import ChatAnswer, end_chat_span


class ChunkAccumulator:
    """Re-assembles ``ChatCompletionChunk``s (objects or dicts) into messages and token data."""

    def __init__(self) -> None:
        self.response_id: str | None = None
        self.model: str | None = None
        self.choices: dict[int, dict[str, Any]] = {}
        self.prompt_token_ids: list[int] | None = None
        self.token_ids: list[int] | None = None
        self.logprobs: list[float] | None = None
        self.sampling: Any = None
        self.usage: Any = None

    def add(self, chunk: Any) -> None:
        self.response_id = self.response_id or field(chunk, "id")
        self.model = self.model or field(chunk, "model")
        prompt_ids = extra_field(chunk, "prompt_token_ids")
        if prompt_ids is not None and self.prompt_token_ids is None:
            self.prompt_token_ids = ints(prompt_ids)
        usage = field(chunk, "usage")
        if usage is not None:
            self.usage = usage
        for choice in field(chunk, "choices") or ():
            index = field(choice, "index") or 0
            state = self.choices.setdefault(index, {"content": [], "reasoning": [], "calls": {}, "finish_reason": None})
            delta = field(choice, "delta")
            content = field(delta, "content")
            if content:
                state["content"].append(content)
            reasoning = extra_field(delta, "reasoning_content")
            if isinstance(reasoning, str):
                state["reasoning"].append(reasoning)
            for call in field(delta, "tool_calls") or ():
                slot = state["calls"].setdefault(field(call, "index") or 0, {"id": None, "name": [], "arguments": []})
                slot["id"] = slot["id"] or field(call, "id")
                function = field(call, "function")
                if field(function, "name"):
                    slot["name"].append(field(function, "name"))
                if field(function, "arguments"):
                    slot["arguments"].append(field(function, "arguments"))
            if field(choice, "finish_reason"):
                state["finish_reason"] = field(choice, "finish_reason")
            if index == 0:
                if prompt_ids is None and extra_field(choice, "prompt_token_ids") is not None and self.prompt_token_ids is None:
                    self.prompt_token_ids = ints(extra_field(choice, "prompt_token_ids"))
                ids = extra_field(choice, "token_ids")
                if ids:  # extended in place: a stream of n chunks is O(n), not O(n²)
                    self.token_ids = self.token_ids or []
                    self.token_ids.extend(map(int, ids))
                values = logprob_values(field(choice, "logprobs"))
                if values:
                    self.logprobs = self.logprobs or []
                    self.logprobs.extend(values)
                if self.sampling is None:  # on the choice's first (and last) chunk from tracerl's servers
                    self.sampling = sampling_of(choice)

    def finish(self, span: Any) -> None:
        messages, finishes = [], []
        for index in sorted(self.choices):
            state = self.choices[index]
            message: dict[str, Any] = {"role": "assistant", "content": "".join(state["content"]) or None}
            if state["reasoning"]:
                message["reasoning_content"] = "".join(state["reasoning"])
            calls = [openai_tool_call(slot["id"], "".join(slot["name"]), "".join(slot["arguments"]))
                     for _, slot in sorted(state["calls"].items())]  # fmt: skip
            if calls:
                message["tool_calls"] = calls
            elif message["content"] is None:
                message["content"] = ""
            messages.append(message)
            finishes.append(state["finish_reason"])
        tokens = (self.prompt_token_ids, self.token_ids, self.logprobs, self.sampling)
        answer = ChatAnswer(messages, finishes, self.response_id, self.model,
                            field(self.usage, "prompt_tokens"), field(self.usage, "completion_tokens"))  # fmt: skip
        end_chat_span(span, answer, tokens=tokens if any(part is not None for part in tokens[:3]) else None)


class _Recorder:
    on_end: Callable[[BaseException | None], None] | None = None
    """Told how the stream ended (the error, or None); the hooks note infrastructure failures with it."""

    def __init__(self, stream: Any, span: Any, layer: str, accumulator: Any) -> None:
        """``accumulator``: what re-assembles the stream's items (``add(item)``, ``finish(span)``)."""
        self._stream, self._span, self._layer, self._acc = stream, span, layer, accumulator
        self._done = False

    def _record(self, chunk: Any) -> None:
        with guard(f"{self._layer}_stream_chunk"):
            self._acc.add(chunk)

    def _finish(self, error: BaseException | None = None) -> None:
        if self._done:
            return
        self._done = True
        with guard(f"{self._layer}_stream_end"):
            if error is not None:
                self._span.record_exception(error)
                self._span.set_status(trace.Status(trace.StatusCode.ERROR, type(error).__name__))
            self._acc.finish(self._span)
        if self.on_end is not None:
            with guard(f"{self._layer}_stream_on_end"):
                self.on_end(error)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class StreamRecorder(_Recorder):
    """Wraps a sync ``openai.Stream`` (or any chunk iterator)."""

    def __init__(self, stream: Any, span: Any, layer: str, accumulator: Any) -> None:
        super().__init__(stream, span, layer, accumulator)
        self._iterator = iter(stream)

    def __iter__(self) -> "StreamRecorder":
        return self

    def __next__(self) -> Any:
        try:
            chunk = next(self._iterator)
        except StopIteration:
            self._finish()
            raise
        except Exception as error:
            self._finish(error)
            raise
        self._record(chunk)
        return chunk

    def __enter__(self) -> "StreamRecorder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        try:
            close = getattr(self._stream, "close", None)
            if close is not None:
                close()
        finally:
            self._finish()


class AsyncStreamRecorder(_Recorder):
    """Wraps an ``openai.AsyncStream`` (or any async chunk iterator)."""

    def __init__(self, stream: Any, span: Any, layer: str, accumulator: Any) -> None:
        super().__init__(stream, span, layer, accumulator)
        self._iterator = stream.__aiter__()

    def __aiter__(self) -> "AsyncStreamRecorder":
        return self

    async def __anext__(self) -> Any:
        try:
            chunk = await self._iterator.__anext__()
        except StopAsyncIteration:
            self._finish()
            raise
        except Exception as error:
            self._finish(error)
            raise
        self._record(chunk)
        return chunk

    async def __aenter__(self) -> "AsyncStreamRecorder":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        try:
            close = getattr(self._stream, "close", None)
            if close is not None:
                result = close()
                if hasattr(result, "__await__"):
                    await result
        finally:
            self._finish()
