"""Inference replicas for the router tests: the scripted OpenAI server plus ``/health`` and adapter routes.

Each records the group header of every chat request it answered and every adapter load, and can
be told to fail its health check (``health_status``) or its adapter loads (``load_status``).
Stopped and started again it listens on the same port, as a restarted replica would.
"""

from __future__ import annotations

from typing import Any

from capture_fake_server import FakeOpenAIServer
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


class ReplicaServer(FakeOpenAIServer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.health_status = 200
        self.load_status = 200
        self.groups: list[str | None] = []
        self.loaded: list[dict[str, Any]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def routes(self) -> list[Any]:
        return [
            Route("/v1/chat/completions", self._tracked_chat, methods=["POST"]),
            Route("/health", self._health, methods=["GET"]),
            Route("/v1/load_lora_adapter", self._load, methods=["POST"]),
        ]

    async def _tracked_chat(self, request: Request) -> Any:
        self.groups.append(request.headers.get("x-tracerl-group"))
        return await self._chat(request)

    async def _health(self, request: Request) -> Any:
        return JSONResponse({"status": "ok"}, status_code=self.health_status)

    async def _load(self, request: Request) -> Any:
        body = await request.json()
        if self.load_status != 200:
            return JSONResponse({"error": {"message": "cannot load", "type": "server_error"}}, status_code=self.load_status)
        self.loaded.append(body)
        return JSONResponse(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")
