"""``POST /v1/responses`` and ``POST /v1/messages`` for a server that completes chat requests.

Both tracerl servers (the transformers server and the proxy in front of vLLM) answer OpenAI's
Responses API and Anthropic's Messages API by translating each request onto their own
chat-completions path (:mod:`.responses_api`, :mod:`.messages_api`): one sampling path, one chat
template, one tool-call parser, and the sampled token ids and logprobs kept in every answer.
Streaming requests get each API's own server-sent events, sent once the answer is complete (as
the chat route streams).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..net.http_server import OpenAIError
from . import messages_api, responses_api
from .gateway import Gateway, add_gateway_routes

CompleteChat = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
"""A chat-completions request body -> its completion (raises :class:`OpenAIError` for a bad request)."""


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError as error:
        raise OpenAIError(f"the request body is not valid JSON: {error}") from error


def add_api_routes(app: Any, complete: CompleteChat, *, stored_responses: int = responses_api.DEFAULT_STORED) -> CompleteChat:
    """Add the Responses and Messages routes and the rollout gateway (:mod:`.gateway`) to ``app``,
    answered through ``complete``; returns ``complete`` as the gateway sees it, for the chat route."""
    gateway = Gateway()
    add_gateway_routes(app, gateway)
    complete = gateway.wrap(complete)
    store = responses_api.ResponseStore(stored_responses)
    calls = messages_api.CallTexts()

    @app.post("/v1/responses")
    async def responses(request: Request) -> Any:
        body = await _json(request)
        turn = responses_api.chat_request(body, store)
        response = responses_api.response_from_chat(await complete(turn.chat), turn, store)
        if body.get("stream"):
            return StreamingResponse(responses_api.response_events(response), media_type="text/event-stream")
        return response

    @app.post("/v1/messages")
    async def messages(request: Request) -> Any:
        try:
            body = await _json(request)
            turn = messages_api.chat_request(body, calls)
            message = messages_api.message_from_chat(await complete(turn.chat), turn, calls)
        except OpenAIError as error:  # Anthropic's SDK reads its own error shape
            return JSONResponse(messages_api.error_body(error), status_code=error.status)
        if body.get("stream"):
            return StreamingResponse(messages_api.message_events(message), media_type="text/event-stream")
        return message

    return complete
