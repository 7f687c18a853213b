"""A Starlette app served by uvicorn in a daemon thread on a free loopback port.

The base of the test servers that stand in for remote services (an OpenAI-compatible
model server, an OTLP/Langfuse collector): subclasses give their routes.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn
from starlette.applications import Starlette


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LoopbackApp:
    """``with Subclass() as app:`` serves ``app.routes()`` at ``http://127.0.0.1:{app.port}``."""

    def __init__(self) -> None:
        self.port = free_port()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def routes(self) -> list[Any]:
        raise NotImplementedError

    def start(self) -> Any:
        config = uvicorn.Config(
            Starlette(routes=self.routes()), host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.time() + 20
        while not self._server.started:
            if time.time() > deadline:
                raise RuntimeError(f"{type(self).__name__} did not start on port {self.port}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
