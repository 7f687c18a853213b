"""HTTP connection pools that stay cheap at a thousand concurrent requests to one server.

Why: httpcore's pool (under httpx, and its fork httpcore2 under httpx2 and the OpenAI SDK 3.x)
re-scans its whole connection list whenever a request starts or ends
(``_assign_requests_to_connections``); httpcore2 probes every idle connection's socket on each
scan (``has_expired``: one ``is_readable`` check each), and httpcore 1.x closes every idle
connection once the pool holds more than ``max_keepalive_connections`` connections in all.  With
1,000 rollouts calling one router through one client, each call walks ~1,000 connections twice,
and with the OpenAI SDK's default keep-alive limit of 100 connections get closed after a burst of
answers and opened again on the next turn.  Measured in ``bench/scale_sim.py`` (bench/RESULTS.md,
"Scale in simulation").

:class:`ShardedTransport` splits the pool: ``shards`` transports, each holding at most
``max_connections / shards`` connections, all of them kept alive, requests dealt round-robin.
Each call then scans a pool ``shards`` times smaller.  Timeouts, errors and streaming are the
underlying transport's own.
"""

from __future__ import annotations

import importlib
import itertools
from types import ModuleType
from typing import Any

import httpx

DEFAULT_MAX_CONNECTIONS = 4096
"""Connections one client may hold to one server (the OpenAI SDK's default is 1,000)."""
DEFAULT_SHARDS = 16


class ShardedTransport:
    """``shards`` keep-alive pools behind one async transport (see the module doc for why).

    Duck-typed to ``AsyncBaseTransport`` so it serves httpx and its fork httpx2 (which the OpenAI SDK
    3.x is built on) alike: pass the client's module as ``http``."""

    def __init__(self, *, http: ModuleType = httpx, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 shards: int = DEFAULT_SHARDS, **transport: Any) -> None:
        """``http``: ``httpx`` or ``httpx2``, the client's own; ``transport``: keyword arguments of its
        ``AsyncHTTPTransport`` (``retries``, ``verify``...) other than ``limits``, which this class sets
        (each shard's share, all of them kept alive)."""
        if shards < 1 or max_connections < shards:
            raise ValueError(f"need 1 <= shards <= max_connections, got shards={shards}, max_connections={max_connections}")
        per_shard = -(-max_connections // shards)
        limits = http.Limits(max_connections=per_shard, max_keepalive_connections=per_shard)
        # one TLS context for all shards: building one loads the CA bundle (~25 ms each)
        verify = http.create_ssl_context(verify=transport.pop("verify", True), cert=transport.pop("cert", None),
                                         trust_env=transport.get("trust_env", True))
        self.shards = [http.AsyncHTTPTransport(limits=limits, verify=verify, **transport) for _ in range(shards)]
        self._next = itertools.cycle(self.shards)

    async def handle_async_request(self, request: Any) -> Any:
        return await next(self._next).handle_async_request(request)

    async def aclose(self) -> None:
        for shard in self.shards:
            await shard.aclose()

    async def __aenter__(self) -> "ShardedTransport":
        for shard in self.shards:
            await shard.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for shard in self.shards:
            await shard.__aexit__(*exc)


def http_module_of(client_class: type) -> ModuleType:
    """The httpx flavour ``client_class`` is built on (``httpx`` or ``httpx2``), for :class:`ShardedTransport`."""
    for base in client_class.__mro__:
        root = base.__module__.split(".")[0]
        if root in ("httpx", "httpx2"):
            return importlib.import_module(root)
    return httpx
