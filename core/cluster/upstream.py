"""The router's HTTP client to its replicas, on aiohttp.

Why aiohttp and not httpx: the relay is the router's whole job, and per relayed request httpx's
client (request model, httpcore's pool, h11 in pure Python, anyio) cost ~2.2 ms of CPU against
~0.14 ms for aiohttp's (C parser, one keep-alive deque per host) in the same loopback exchange
(bench/RESULTS.md, "Scale in simulation").  The router is one process, so its CPU per request
bounds the calls per second it can relay.

What the router needs from it, in its own terms (so :mod:`tracerl.cluster.router` never sees an
aiohttp type): :class:`Unreachable` (refused, connect timeout, closed before the answer's headers:
the request never reached a model, so it is retried on another replica), :class:`UpstreamTimeout`
(no byte of answer for ``request_timeout`` seconds), :class:`AnswerDropped` (cut mid-body).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Iterable

from ..net.http_pool import DEFAULT_MAX_CONNECTIONS
from ..timeouts import within

IDLE_S = 15.0
"""Seconds an idle connection to a replica is kept for reuse: well under the replicas' own
keep-alive (``KEEP_ALIVE_S``, 75 s), so the router never sends on a connection the replica is closing."""


class Unreachable(Exception):
    """The replica did not take the request (refused, connect timeout, closed before answering)."""


class AnswerDropped(Exception):
    """The replica's answer was cut (or stalled past the timeout) after its headers."""


class UpstreamTimeout(Exception):
    """A replica did not answer within the router's ``request_timeout`` (answered as a 504)."""

    def __init__(self, url: str, seconds: float | None) -> None:
        super().__init__(f"the replica {url} did not answer {within(seconds)} (knob: Router(request_timeout=...))")


class Upstream:
    """One aiohttp session for every replica, created in the loop that uses it (the router's serving loop)."""

    def __init__(self, *, request_timeout: float | None, connect_timeout: float, tls: Any = None) -> None:
        """``request_timeout``: the longest wait for the next bytes of an answer (None: no limit), as
        httpx's read timeout was; ``connect_timeout``: for opening a connection; ``tls``: an SSL context."""
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self._tls = tls
        self._session: Any = None
        self._timeout: Any = None
        self._urls: dict[tuple[str, str], Any] = {}

    def session(self) -> Any:
        if self._session is None or self._session.closed:
            import aiohttp

            connector = aiohttp.TCPConnector(limit=0, limit_per_host=DEFAULT_MAX_CONNECTIONS, keepalive_timeout=IDLE_S,
                                             ssl=self._tls if self._tls is not None else True)
            # raw bytes through: the router relays answers as the replica wrote them
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                                  skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"))
            self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout,
                                                  sock_read=self.request_timeout)
        return self._session

    def url(self, base: str, path: str) -> Any:
        """``base + path`` parsed once (a parse per request is measurable at thousands a second)."""
        key = (base, path)
        url = self._urls.get(key)
        if url is None:
            import yarl

            url = self._urls[key] = yarl.URL(base + path)
        return url

    async def open(self, method: str, base: str, path: str, headers: Iterable[tuple[str, str]], content: bytes) -> Any:
        """Send the request to replica ``base``; return the answer once its status and headers are in (body unread)."""
        import aiohttp

        session = self.session()
        try:
            return await session.request(method, self.url(base, path), data=content or None, headers=list(headers),
                                         timeout=self._timeout, allow_redirects=False)
        except aiohttp.ConnectionTimeoutError as error:
            raise self._unreachable(error) from error
        except (aiohttp.ServerTimeoutError, asyncio.TimeoutError) as error:
            raise UpstreamTimeout(base, self.request_timeout) from error
        except aiohttp.ClientError as error:  # refused, closed or reset before the headers, a malformed answer
            raise self._unreachable(error) from error

    def _unreachable(self, error: Exception) -> Unreachable:
        """``error`` in the router's words (its replica states and 503s name them)."""
        import aiohttp

        if isinstance(error, aiohttp.ConnectionTimeoutError):
            return Unreachable(f"connect timeout ({self.connect_timeout:g} s)")
        if isinstance(error, aiohttp.ClientConnectorError):
            return Unreachable(f"cannot connect ({type(error).__name__}: {error})")
        return Unreachable(f"{type(error).__name__}: {error}")

    @staticmethod
    async def body(response: Any) -> bytes:
        """The whole answer; :class:`AnswerDropped` if it is cut or stalls."""
        import aiohttp

        try:
            return await response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            raise AnswerDropped(f"dropped mid-answer: {type(error).__name__}") from error
        finally:
            response.release()

    @staticmethod
    async def chunks(response: Any) -> AsyncIterator[bytes]:
        """The answer as it arrives (server-sent events pass straight through)."""
        import aiohttp

        try:
            async for chunk in response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            raise AnswerDropped(f"dropped mid-answer: {type(error).__name__}") from error
        finally:
            response.release()  # read to the end: the connection goes back to the pool; else it is closed

    async def call(self, method: str, url: str, *, content: bytes = b"", headers: Iterable[tuple[str, str]] = (),
                   timeout: float | None = None) -> tuple[int, bytes]:
        """One whole exchange (health checks, adapter fan-out): status and body; any failure raises :class:`Unreachable`."""
        import aiohttp

        limit = aiohttp.ClientTimeout(total=timeout) if timeout is not None else None
        try:
            async with self.session().request(method, url, data=content or None, headers=list(headers),
                                              timeout=limit or self._timeout, allow_redirects=False) as answer:
                return answer.status, await answer.read()
        except asyncio.TimeoutError as error:  # aiohttp's timeouts are TimeoutErrors too (without a message)
            raise Unreachable(f"no answer {within(timeout if timeout is not None else self.request_timeout)}") from error
        except aiohttp.ClientError as error:
            raise self._unreachable(error) from error

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
