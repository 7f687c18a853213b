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

:class:`AiohttpTransport` goes further where aiohttp is installed (``Model.openai_client()`` picks it,
see :func:`openai_transport`): the same client above it, the HTTP exchange on aiohttp's pool (one
deque of idle connections per host) and C parser, ~0.6 ms less CPU per SDK call.
"""

from __future__ import annotations

import functools
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


class AiohttpTransport:
    """An httpx (or httpx2) async transport on aiohttp's connection pool and C HTTP parser.

    Why: under the OpenAI SDK the HTTP exchange is the largest share of a model call's client-side
    CPU, and aiohttp's costs less per request than httpcore's (bench/RESULTS.md, "Scale in
    simulation"); its pool keeps one deque of idle connections per host, so it also stays flat
    at thousands of connections without sharding.  The client above it (the SDK's ``httpx2.AsyncClient``,
    its hooks, retries, timeouts and streaming) is unchanged; aiohttp's failures are raised as the
    client's own exceptions, chosen as httpcore would: refused -> ``ConnectError``, closed before or
    during the answer -> ``RemoteProtocolError``, reset -> ``ReadError``, timeouts -> ``ConnectTimeout`` /
    ``ReadTimeout``, so the SDK (``APIConnectionError``, ``APITimeoutError``) and tracerl's fault
    classification see what they always saw.

    One aiohttp session per event loop (created on the loop's first request: aiohttp binds to it)."""

    def __init__(self, *, http: ModuleType = httpx, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 keepalive_expiry: float = 5.0, verify: Any = True) -> None:
        """``http``: ``httpx`` or ``httpx2``, the client's own; ``keepalive_expiry``: seconds an idle
        connection is reused (httpx's default, under tracerl's servers' ``KEEP_ALIVE_S``); ``verify``:
        as httpx's (a bool, a CA bundle path or an ``ssl.SSLContext``)."""
        import aiohttp  # noqa: F401 - fail here, where the choice is made, not on the first request

        self.http = http
        self.max_connections = max_connections
        self.keepalive_expiry = keepalive_expiry
        self._ssl = http.create_ssl_context(verify=verify)
        self._sessions: dict[Any, Any] = {}
        self._closers: dict[Any, Any] = {}
        self._timeouts: dict[tuple[Any, ...], Any] = {}

    async def _session(self) -> Any:
        import asyncio

        import aiohttp

        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            for old in [lp for lp in self._sessions if lp.is_closed()]:  # loops that ended (their sessions were closed)
                self._sessions.pop(old)
                self._closers.pop(old, None)
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=self.max_connections,
                                             keepalive_timeout=self.keepalive_expiry, ssl=self._ssl)
            session = self._sessions[loop] = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                                                   skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"))
            # closed when the loop ends (asyncio.run's shutdown_asyncgens closes open async generators),
            # so a client nobody closes does not leave an "Unclosed client session" behind
            closer = self._closers[loop] = _close_at_loop_end(session)
            await closer.__anext__()
        return session

    def _timeout(self, request: Any) -> Any:
        import aiohttp

        limits = request.extensions.get("timeout") or {}
        key = (limits.get("connect"), limits.get("read"), limits.get("pool"))
        timeout = self._timeouts.get(key)
        if timeout is None:
            timeout = self._timeouts[key] = aiohttp.ClientTimeout(total=None, sock_connect=key[0], sock_read=key[1],
                                                                  connect=key[2])
        return timeout

    def _mapped(self, error: BaseException) -> Exception:
        """``error`` as the exception httpcore would have raised (see the class doc)."""
        import asyncio

        import aiohttp

        http = self.http
        message = str(error) or type(error).__name__
        if isinstance(error, aiohttp.ConnectionTimeoutError):
            return http.ConnectTimeout(message)
        if isinstance(error, (aiohttp.ServerTimeoutError, asyncio.TimeoutError)):
            return http.ReadTimeout(message)
        if isinstance(error, aiohttp.ClientConnectorError):
            return http.ConnectError(message)
        if isinstance(error, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError)):
            return http.RemoteProtocolError(message)
        if isinstance(error, aiohttp.ClientOSError):
            return http.ReadError(message)
        return http.TransportError(message)

    async def handle_async_request(self, request: Any) -> Any:
        import asyncio

        import aiohttp

        try:
            data: Any = request.content or None
        except self.http.RequestNotRead:
            data = request.stream  # a streamed upload: aiohttp reads the async iterable
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw]
        if data is not None and not isinstance(data, bytes):
            headers = [(k, v) for k, v in headers if k.lower() != "transfer-encoding"]  # aiohttp chunks it itself
        try:
            response = await (await self._session()).request(request.method, str(request.url), data=data, headers=headers,
                                                      timeout=self._timeout(request), allow_redirects=False,
                                                      compress=False)
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            raise self._mapped(error) from error
        return self.http.Response(status_code=response.status, headers=response.raw_headers,
                                  stream=_stream_class(self.http)(self, response), request=request,
                                  extensions={"http_version": b"HTTP/1.1",
                                              "reason_phrase": (response.reason or "").encode()})

    async def aclose(self) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        session = self._sessions.pop(loop, None)
        self._closers.pop(loop, None)
        if session is not None:
            await session.close()

    async def __aenter__(self) -> "AiohttpTransport":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


class _AiohttpStream:
    """The answer's body for the httpx response: aiohttp's chunks, its failures as the client's exceptions."""

    def __init__(self, transport: AiohttpTransport, response: Any) -> None:
        self._transport, self._response = transport, response

    async def __aiter__(self) -> Any:
        import asyncio

        import aiohttp

        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            raise self._transport._mapped(error) from error

    async def aclose(self) -> None:
        self._response.release()  # read to the end: back to the pool; cut short: the connection is closed


async def _close_at_loop_end(session: Any) -> Any:
    try:
        yield
    finally:
        await session.close()


@functools.lru_cache(maxsize=None)
def _stream_class(http: ModuleType) -> type:
    """:class:`_AiohttpStream` as a subclass of the client's own ``AsyncByteStream`` (the client checks it)."""
    return type("AiohttpStream", (_AiohttpStream, http.AsyncByteStream), {})


def openai_transport(http: ModuleType) -> Any:
    """The transport ``Model.openai_client()`` uses: :class:`AiohttpTransport` when aiohttp is installed
    (``tracerl[backend]`` or ``openai[aiohttp]`` bring it), else :class:`ShardedTransport`."""
    try:
        return AiohttpTransport(http=http)
    except ImportError:
        return ShardedTransport(http=http)
