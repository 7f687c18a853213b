"""A small reader of Langfuse's public API: traces and their observations, paginated.

Endpoints (Langfuse's API definition, ``fern/apis/server/definition``):

* ``GET /api/public/traces`` — ``page`` (from 1), ``limit``, ``sessionId``, ``name``,
  ``userId``, ``tags`` (repeated: traces with all of them), ``fromTimestamp``,
  ``orderBy``; answers ``{"data": [...], "meta": {"page", "limit", "totalItems",
  "totalPages"}}``.  ``GET /api/public/traces/{traceId}`` gives one trace.
* ``GET /api/public/v2/observations`` — ``traceId``, ``fields`` (groups: ``core,basic,io,
  model,usage,metadata``), ``limit`` (≤ 1000), ``cursor``; answers ``{"data": [...],
  "meta": {"cursor"}}`` (no cursor: last page); inputs and outputs come as raw strings.
  Older servers only have ``GET /api/public/observations`` (``page`` / ``limit``,
  ``meta.totalPages``): used when v2 answers 404.

Every request has a timeout; 429 (rate limited) and 502/503/504 are retried after the
``Retry-After`` the server sends (seconds or an HTTP date), else with exponential backoff,
up to ``max_retries`` times; 401/403 and anything else fail at once.  Failures raise
:class:`TraceSourceError` naming the URL and what Langfuse said.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import time
from typing import Any, Callable, Iterator
from urllib.parse import quote

import httpx
from opentelemetry import context

from tracerl.errors import ConfigError
from tracerl.net.untraced import suppressed_context

from ..export.langfuse import langfuse_host, langfuse_keys
from ..outbound import mark_internal_url
from .errors import TraceSourceError

TRACES_PATH = "/api/public/traces"
OBSERVATIONS_V2_PATH = "/api/public/v2/observations"
OBSERVATIONS_V1_PATH = "/api/public/observations"
V2_FIELDS = "core,basic,io,model,usage,metadata"
_RETRIED = (429, 502, 503, 504)


class LangfuseReader:
    """``with LangfuseReader(host) as reader:`` then :meth:`traces`, :meth:`trace`, :meth:`observations`.

    Arguments left out come from ``LANGFUSE_BASE_URL`` / ``LANGFUSE_HOST`` (default Langfuse
    Cloud), ``LANGFUSE_PUBLIC_KEY`` and ``LANGFUSE_SECRET_KEY``.
    """

    def __init__(
        self,
        host: str | None = None,
        public_key: str | None = None,
        secret_key: str | None = None,
        *,
        timeout_s: float = 30.0,
        max_retries: int = 6,
        max_backoff_s: float = 60.0,
        page_size: int = 50,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.host = langfuse_host(host)
        for path in (TRACES_PATH, OBSERVATIONS_V2_PATH, OBSERVATIONS_V1_PATH):  # tracerl's own reads
            mark_internal_url(self.host + path)
        authorization = langfuse_keys(public_key, secret_key, "importing from Langfuse")[2]
        if timeout_s <= 0 or max_retries < 0 or page_size < 1:
            raise ConfigError("timeout_s must be > 0, max_retries >= 0 and page_size >= 1")
        self._client = httpx.Client(base_url=self.host, headers={"Authorization": authorization}, timeout=timeout_s)
        self.max_retries, self.max_backoff_s, self.page_size = max_retries, max_backoff_s, page_size
        self.sleep = sleep
        self.retries = 0
        self.requests = 0
        self._v2: bool | None = None  # whether /api/public/v2/observations exists here

    # -- what callers use --------------------------------------------------------------------
    def traces(
        self, *, session_id: str | None = None, name: str | None = None, tags: tuple[str, ...] = (),
        user_id: str | None = None, since: dt.datetime | None = None, limit: int | None = None,
    ) -> Iterator[dict[str, Any]]:  # fmt: skip
        """Traces matching the filters, oldest first, page after page (at most ``limit``)."""
        params: dict[str, Any] = {"limit": self.page_size, "orderBy": "timestamp.asc"}
        for key, value in (("sessionId", session_id), ("name", name), ("userId", user_id)):
            if value:
                params[key] = value
        if tags:
            params["tags"] = list(tags)
        if since is not None:
            params["fromTimestamp"] = since.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z")
        yielded = 0
        for item in self._pages(TRACES_PATH, params):
            if limit is not None and yielded >= limit:
                return
            yielded += 1
            yield item

    def trace(self, trace_id: str) -> dict[str, Any]:
        """One trace by id (any string: traces sent through Langfuse's SDKs or ingestion API
        keep the ids their senders chose, ``/``, spaces and all, so the id is one path segment)."""
        return self._get(f"{TRACES_PATH}/{quote(trace_id, safe='')}", {})

    def observations(self, trace_id: str) -> list[dict[str, Any]]:
        """Every observation of a trace (v2 endpoint, else the v1 one on older servers)."""
        if self._v2 is not False:
            try:
                params = {"traceId": trace_id, "fields": V2_FIELDS, "limit": min(1000, self.page_size)}
                result = list(self._cursor_pages(OBSERVATIONS_V2_PATH, params))
                self._v2 = True
                return result
            except _NotFound:
                if self._v2:
                    raise TraceSourceError(f"{self.host}{OBSERVATIONS_V2_PATH} went missing") from None
                self._v2 = False
        return list(self._pages(OBSERVATIONS_V1_PATH, {"traceId": trace_id, "limit": self.page_size}))

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "LangfuseReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- pagination ----------------------------------------------------------------------------
    def _pages(self, path: str, params: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Page-numbered listing: ``page`` from 1 until ``meta.totalPages``."""
        page = 1
        while True:
            body = self._get(path, {**params, "page": page})
            data = body.get("data") or []
            yield from data
            total = (body.get("meta") or {}).get("totalPages")
            if not data or (isinstance(total, int) and page >= total) or (total is None and len(data) < params["limit"]):
                return
            page += 1

    def _cursor_pages(self, path: str, params: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Cursor listing: follow ``meta.cursor`` until there is none."""
        cursor = None
        while True:
            body = self._get(path, {**params, **({"cursor": cursor} if cursor else {})})
            yield from body.get("data") or []
            cursor = (body.get("meta") or {}).get("cursor")
            if not cursor:
                return

    # -- one request -------------------------------------------------------------------------------
    def _get(self, path: str, params: dict[str, Any]) -> dict[str, Any]:
        url = f"{self.host}{path}"
        for attempt in range(self.max_retries + 1):
            self.requests += 1
            token = context.attach(suppressed_context())  # tracerl's own reads: never spans in the user's traces
            try:
                response = self._client.get(path, params=params)
            except httpx.HTTPError as error:  # timeouts, refused or dropped connections
                if attempt == self.max_retries:
                    raise TraceSourceError(f"Langfuse at {url} failed {attempt + 1} times: {error!r}") from error
                self._wait(self._backoff(attempt))
                continue
            finally:
                context.detach(token)
            if response.status_code in _RETRIED and attempt < self.max_retries:
                self._wait(self._retry_after(response) or self._backoff(attempt))
                continue
            return self._body(url, response)
        raise AssertionError("unreachable")  # pragma: no cover

    def _body(self, url: str, response: httpx.Response) -> dict[str, Any]:
        code = response.status_code
        if code in (401, 403):
            raise TraceSourceError(f"Langfuse at {url} rejected the keys ({code}): check LANGFUSE_PUBLIC_KEY/SECRET_KEY")
        if code == 404:
            raise _NotFound(url)
        if code >= 400:
            raise TraceSourceError(f"Langfuse at {url} answered {code}: {response.text[:300]}")
        try:
            body = response.json()
        except ValueError as error:
            raise TraceSourceError(f"Langfuse at {url} answered something that is not JSON: {response.text[:200]!r}") from error
        if not isinstance(body, dict):
            raise TraceSourceError(f"Langfuse at {url} answered {type(body).__name__}, not a JSON object")
        return body

    def _wait(self, seconds: float) -> None:
        self.retries += 1
        self.sleep(min(max(seconds, 0.0), self.max_backoff_s))

    def _backoff(self, attempt: int) -> float:
        return min(0.5 * 2**attempt, self.max_backoff_s)

    @staticmethod
    def _retry_after(response: httpx.Response) -> float | None:
        """``Retry-After`` in seconds: a number, or an HTTP date."""
        value = response.headers.get("retry-after")
        if not value:
            return None
        try:
            return float(value)
        except ValueError:
            pass
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        return (when - dt.datetime.now(dt.timezone.utc)).total_seconds()


class _NotFound(TraceSourceError):
    """404 (an endpoint this server does not have, or an unknown trace id)."""


def parse_since(value: str | dt.datetime | None) -> dt.datetime | None:
    """``--since``: an ISO 8601 time (``2026-11-30``, ``2026-11-30T12:00:00Z``) or an age (``30m``, ``6h``, ``7d``)."""
    if value is None or isinstance(value, dt.datetime):
        return value
    text = value.strip()
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    if text[:-1].replace(".", "", 1).isdigit() and text[-1:] in units:
        return dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=float(text[:-1]) * units[text[-1]])
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError as error:
        raise ConfigError(f"--since {value!r}: give an ISO 8601 time (2026-11-30T12:00:00Z) or an age (30m, 6h, 7d)") from error
    return when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)
