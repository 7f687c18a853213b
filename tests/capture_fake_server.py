"""A small OpenAI-compatible chat-completions server for capture tests (real HTTP + SSE).

Replies are scripted by a function ``script(body) -> Reply``; the default one calls the
first offered tool once (with the last user message as ``query``) and then answers with
``"answer: " + <last tool result or user message>``.  For the fault tests a reply can
also be an error status (``Reply(status=500)``), a connection that drops in the middle of
the response (``Reply(drop=True)``, streamed or not), or no answer at all until the server
stops (``Reply(hang=True)``).  It returns ``prompt_token_ids`` and per-choice ``token_ids`` when
asked with ``return_token_ids``, and logprobs when asked with ``logprobs``; by default always,
as tracerl's servers do (``token_truth=False``: only when asked).  Token ids are fake but deterministic
(character codes), so tests can check they were joined to the right turn.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from loopback_app import LoopbackApp
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


@dataclass
class Reply:
    content: str | None = None
    tool_calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    finish_reason: str | None = None
    status: int | None = None
    """Answer with this HTTP error status (an OpenAI-style error body) instead."""
    drop: bool = False
    """Start the response, then drop the connection mid-body (the server "vanishes")."""
    hang: bool = False
    """Never answer (until the server stops)."""
    reasoning: str | None = None
    """The reply's ``reasoning_content`` (as vLLM's reasoning parsers and tracerl's servers send it)."""


def default_script(body: dict[str, Any]) -> Reply:
    messages = body.get("messages") or []
    tools = body.get("tools") or []
    last_user = next((m for m in reversed(messages) if m.get("role") == "user"), {"content": ""})
    user_text = _text(last_user.get("content"))
    tool_results = [m for m in messages if m.get("role") == "tool"]
    if tools and not tool_results:
        name = tools[0]["function"]["name"]
        return Reply(tool_calls=[(name, {"query": user_text})])
    source = _text(tool_results[-1]["content"]) if tool_results else user_text
    return Reply(content=f"answer: {source}")


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def fake_token_ids(text: str) -> list[int]:
    return [ord(c) % 50_000 for c in text]


def fake_logprobs(ids: list[int]) -> list[float]:
    return [-((i * 7 + t) % 13) / 10.0 - 0.01 for i, t in enumerate(ids)]


def render_prompt(messages: list[dict[str, Any]]) -> str:
    parts = []
    for m in messages:
        calls = "".join(
            f"<call>{c['function']['name']}:{c['function']['arguments']}</call>" for c in m.get("tool_calls") or ()
        )
        parts.append(f"<{m.get('role')}>{_text(m.get('content'))}{calls}</>")
    return "".join(parts) + "<assistant>"


class FakeOpenAIServer(LoopbackApp):
    """Start with ``with FakeOpenAIServer() as server: server.base_url``."""

    def __init__(
        self,
        script: Callable[[dict[str, Any]], Reply] = default_script,
        *,
        delay_s: float = 0.0,
        prompt_ids_on_choice: bool = False,
        token_truth: bool = True,
    ):
        """``prompt_ids_on_choice``: streamed prompt ids also on the first chunk's choice, as
        tracerl's servers send them (raw vLLM puts them on the chunk only); ``token_truth``: token
        ids and logprobs in every answer, asked for or not, as tracerl's servers send them (False:
        only when asked, as any other OpenAI-compatible server)."""
        super().__init__()
        self._stopping = threading.Event()
        self.prompt_ids_on_choice = prompt_ids_on_choice
        self.token_truth = token_truth
        self.script = script
        self.delay_s = delay_s
        self.requests: list[dict[str, Any]] = []
        self.responses: list[dict[str, Any]] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def routes(self) -> list[Any]:
        return [Route("/v1/chat/completions", self._chat, methods=["POST"])]

    # -- the endpoint -------------------------------------------------------------------------
    async def _chat(self, request: Request) -> Any:
        body = await request.json()
        self.requests.append(body)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        reply = self.script(body)
        if reply.hang:
            while not self._stopping.is_set():
                await asyncio.sleep(0.02)
        if reply.status is not None:
            error = {"message": f"scripted failure {reply.status}", "type": "server_error", "code": reply.status}
            return JSONResponse({"error": error}, status_code=reply.status)
        response = self._build(body, reply)
        if reply.drop:
            events = self._sse(body, response) if body.get("stream") else _chunks(json.dumps(response))
            media = "text/event-stream" if body.get("stream") else "application/json"
            return StreamingResponse(_dropped(events), media_type=media)
        self.responses.append(response)
        if body.get("stream"):
            return StreamingResponse(self._sse(body, response), media_type="text/event-stream")
        return JSONResponse(response)

    def stop(self) -> None:
        self._stopping.set()
        super().stop()

    def _build(self, body: dict[str, Any], reply: Reply) -> dict[str, Any]:
        calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:10]}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)},
            }
            for name, args in reply.tool_calls
        ]
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.reasoning is not None:
            message["reasoning_content"] = reply.reasoning
        if calls:
            message["tool_calls"] = calls
        sampled = (f"<think>{reply.reasoning}</think>" if reply.reasoning is not None else "") + (reply.content or "") + "".join(
            f"<tool_call>{c['function']['name']}{c['function']['arguments']}</tool_call>" for c in calls
        )
        ids = fake_token_ids(sampled) + [2]
        prompt_ids = fake_token_ids(render_prompt(body.get("messages") or []))
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": reply.finish_reason or ("tool_calls" if calls else "stop"),
        }
        want_ids = bool(body.get("return_token_ids")) or self.token_truth
        if body.get("logprobs") or self.token_truth:
            choice["logprobs"] = {
                "content": [
                    {"token": str(t), "logprob": lp, "bytes": None, "top_logprobs": []}
                    for t, lp in zip(ids, fake_logprobs(ids))
                ]
            }
        if want_ids:
            choice["token_ids"] = ids
        response: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "fake"),
            "choices": [choice],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids), "total_tokens": len(prompt_ids) + len(ids)},
        }
        if want_ids:
            response["prompt_token_ids"] = prompt_ids
        return response

    async def _sse(self, body: dict[str, Any], response: dict[str, Any]):
        choice = response["choices"][0]
        message = choice["message"]
        base = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"], "model": response["model"]}
        ids = choice.get("token_ids") or []
        logprob_entries = (choice.get("logprobs") or {}).get("content") or []
        content = message.get("content") or ""
        pieces = [content[i : i + 4] for i in range(0, len(content), 4)] or [""]
        first = {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
        if "prompt_token_ids" in response:
            first["prompt_token_ids"] = response["prompt_token_ids"]
            if self.prompt_ids_on_choice:
                first["choices"][0]["prompt_token_ids"] = response["prompt_token_ids"]
        yield f"data: {json.dumps(first)}\n\n"
        reasoning = message.get("reasoning_content") or ""
        for piece in (reasoning[i : i + 4] for i in range(0, len(reasoning), 4)):
            yield f"data: {json.dumps({**base, 'choices': [{'index': 0, 'delta': {'reasoning_content': piece}, 'finish_reason': None}]})}\n\n"
        # token ids / logprobs are spread over the content chunks; the rest go with the last chunk
        per_piece = max(1, len(ids) // (len(pieces) + 1)) if ids else 0
        cursor = 0
        for piece in pieces:
            delta_choice: dict[str, Any] = {"index": 0, "delta": {"content": piece}, "finish_reason": None}
            if ids:
                delta_choice["token_ids"] = ids[cursor : cursor + per_piece]
            if logprob_entries:
                delta_choice["logprobs"] = {"content": logprob_entries[cursor : cursor + per_piece]}
            cursor += per_piece
            yield f"data: {json.dumps({**base, 'choices': [delta_choice]})}\n\n"
        for index, call in enumerate(message.get("tool_calls") or ()):
            arguments = call["function"]["arguments"]
            half = len(arguments) // 2
            head = {"index": index, "id": call["id"], "type": "function", "function": {"name": call["function"]["name"], "arguments": arguments[:half]}}
            tail = {"index": index, "function": {"arguments": arguments[half:]}}
            for delta_call in (head, tail):
                yield f"data: {json.dumps({**base, 'choices': [{'index': 0, 'delta': {'tool_calls': [delta_call]}, 'finish_reason': None}]})}\n\n"
        last: dict[str, Any] = {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}
        if ids:
            last["token_ids"] = ids[cursor:]
        if logprob_entries:
            last["logprobs"] = {"content": logprob_entries[cursor:]}
        yield f"data: {json.dumps({**base, 'choices': [last]})}\n\n"
        if (body.get("stream_options") or {}).get("include_usage"):
            yield f"data: {json.dumps({**base, 'choices': [], 'usage': response['usage']})}\n\n"
        yield "data: [DONE]\n\n"




async def _chunks(text: str):
    for i in range(0, len(text), 16):
        yield text[i : i + 16]


async def _dropped(events: Any):
    """The first piece of a response, then the connection goes away (uvicorn closes it)."""
    async for event in events:
        yield event
        break
    raise ConnectionResetError("scripted: the inference server went away in the middle of a response")


if __name__ == "__main__":  # run standalone (e.g. for bench/capture_overhead.py): prints the base URL
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    port = parser.parse_args().port
    server = FakeOpenAIServer()
    if port:
        server.port = port
    server.start()
    print(server.base_url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()
