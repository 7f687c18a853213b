"""The router's HTTP surface: OpenAI routes relayed to a replica, adapter routes sent to all.

Apart from :mod:`tracerl.cluster.router` because it needs FastAPI (the ``backend`` extra), while
the router's constants and policy stay importable by a light agent process.  It names the router
only through :class:`Relay`, so the router can build it without the two importing each other.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..errors import InferenceServerError, NoHealthyReplicaError
from ..net.http_server import OpenAIError, install_error_handlers
from ..net.untraced import untraced_fastapi
from .pool import Replica, ReplicaPool
from .routing import GROUP_HEADER, HOP_BY_HOP, REPLICA_HEADER, group_key
from .upstream import AnswerDropped, UpstreamTimeout


class Relay(Protocol):
    """What the app asks of its :class:`~tracerl.cluster.router.Router`."""

    pool: ReplicaPool

    async def forward(self, method: str, path: str, headers: Any, content: bytes, key: str | None) -> tuple[Any, Replica]: ...

    def relay(self, response: Any, replica: Replica) -> AsyncIterator[bytes]: ...

    async def read(self, response: Any, replica: Replica) -> bytes: ...

    async def broadcast(self, path: str, content: bytes, headers: Any) -> list[tuple[str, int, bytes]]: ...


def build_app(router: Relay) -> Any:
    """The router's FastAPI app (emits no spans of its own: see :mod:`tracerl.net.untraced`)."""
    app = untraced_fastapi(title="tracerl router")
    install_error_handlers(app)

    async def proxied(request: Request, path: str) -> Any:
        content = await request.body()
        if request.headers.get(GROUP_HEADER):  # the key is in the header: the body goes on unparsed
            key = group_key(request.headers, None)
        else:
            try:
                key = group_key(request.headers, json.loads(content) if content else None)
            except ValueError as error:
                raise OpenAIError(f"the request body is not valid JSON: {error}") from error
        try:
            response, replica = await router.forward(request.method, path, request.headers, content, key)
        except NoHealthyReplicaError as error:
            raise OpenAIError(str(error), status=503, type="NoHealthyReplicaError") from error
        except UpstreamTimeout as error:
            raise OpenAIError(str(error), status=504, type="InferenceTimeoutError") from error
        except InferenceServerError as error:
            raise OpenAIError(str(error), status=502, type="InferenceServerError") from error
        headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_BY_HOP}
        headers[REPLICA_HEADER] = replica.url
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(router.relay(response, replica), status_code=response.status, headers=headers)
        # a whole JSON answer: one body with its length, not a chunked stream (less work on both sides)
        try:
            content = await router.read(response, replica)
        except AnswerDropped as error:
            raise OpenAIError(f"the replica {replica.url} {error}", status=502, type="InferenceServerError") from error
        return Response(content, status_code=response.status, headers=headers)

    # the relayed routes are plain Starlette routes: FastAPI's dependency solving costs ~0.2 ms a request
    for path, method in (("/v1/chat/completions", "POST"), ("/v1/completions", "POST"), ("/v1/responses", "POST"),
                         ("/v1/messages", "POST"), ("/v1/models", "GET")):
        async def relayed(request: Request, path: str = path) -> Any:
            return await proxied(request, path)

        app.add_route(path, relayed, methods=[method], include_in_schema=False)

    async def fan_out(request: Request, path: str) -> Any:
        results = await router.broadcast(path, await request.body(), request.headers)
        failed = [(url, status, text) for url, status, text in results if status != 200]
        if failed:
            detail = "; ".join(f"{url}: {status} {text[:300].decode(errors='replace')}" for url, status, text in failed)
            raise OpenAIError(f"{len(failed)} of {len(results)} replicas failed {path}: {detail}", status=502,
                              type="InferenceServerError")
        return Response(results[0][2], media_type="application/json")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Any:
        return await fan_out(request, "/v1/load_lora_adapter")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Any:
        return await fan_out(request, "/v1/unload_lora_adapter")

    @app.get("/health")
    async def health() -> Any:
        healthy = len(router.pool.healthy)
        return JSONResponse({"status": "ok" if healthy else "no healthy replica", "healthy": healthy,
                             "replicas": len(router.pool.replicas)}, status_code=200 if healthy else 503)

    @app.get("/router/replicas")
    async def replicas() -> Any:
        return {"replicas": [r.state() for r in router.pool.replicas]}

    return app
