"""``tracerl serve --tinker``'s app on loopback in the test process, the service started on the server's own loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@contextlib.contextmanager
def tinker_on_loopback(root: Path, name: str, *, token: str = "owner-token-not-a-tenant-key", **service_options: Any
                       ) -> Iterator[tuple[str, Any, asyncio.AbstractEventLoop]]:  # fmt: skip
    """The app's URL, the :class:`~tracerl.tinker.service.TinkerService` (``service_options``) and the server's loop;
    offline, without the SDK's telemetry or a ``TINKER_BASE_URL`` from the environment."""
    from tracerl.net.http_server import BackgroundUvicorn
    from tracerl.serve.server import create_app
    from tracerl.tinker.service import TinkerService
    from tracerl.train.local_backend import LocalBackend

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TINKER_TELEMETRY", "0")
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.delenv("TINKER_BASE_URL", raising=False)
        service = TinkerService(root / "service", **service_options)
        http = BackgroundUvicorn(create_app(LocalBackend(root / "serve", inference=None), token=token, tinker=service), name=name)
        url = f"http://127.0.0.1:{http.start()}"
        assert http.loop is not None
        asyncio.run_coroutine_threadsafe(service.start(), http.loop).result(timeout=300)
        try:
            yield url, service, http.loop
        finally:
            asyncio.run_coroutine_threadsafe(service.close(), http.loop).result(timeout=60)
            http.stop()
