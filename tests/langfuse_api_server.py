"""A Langfuse stand-in on loopback: OTLP ingestion in, Langfuse's public read API out.

Spans arrive as at Langfuse (``POST /api/public/otel/v1/traces``, protobuf, Basic auth;
from the Langfuse SDK itself or from tracerl's exporter) and are mapped the way
Langfuse's ingestion maps them (``langfuse_mapping``, the port of its OTel ingestion;
observation metadata as Langfuse stores it: the attributes it did not use, the resource,
the scope, ``langfuse.observation.metadata.*``; a model call's tools moved into its input),
then served with Langfuse's field names and pagination:

* ``GET /api/public/traces`` (``page``, ``limit``, ``sessionId``, ``name``, ``userId``,
  ``tags`` (all of them), ``fromTimestamp``; ``meta.page/limit/totalItems/totalPages``),
  ``GET /api/public/traces/{traceId}``;
* ``GET /api/public/v2/observations`` (``traceId``, ``limit``, ``cursor``;
  ``meta.cursor``; ``input`` / ``output`` as raw strings) — or, with ``v2=False``, 404
  there as on older servers, and ``GET /api/public/observations`` (``page`` / ``limit``,
  inputs and outputs as JSON values).

Faults on demand: ``rate_limit_requests`` (request numbers answered 429 with a
``Retry-After``), ``hang_s`` (every read request stalls that long).  ``api_ids`` gives
traces and observations the ids their senders chose, as traces sent through Langfuse's
SDKs (v2) or its ingestion API keep them (any string; only OTel-ingested ones are hex):
a function of the hex id.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
from typing import Any, Callable
from urllib.parse import unquote

from langfuse_mapping import observation
from otlp_collector import CollectedSpan, OTLPCollector
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route



TRACES_PATH = "/api/public/traces"


class LangfuseAPIServer(OTLPCollector):
    """``with LangfuseAPIServer() as lf:`` then ``lf.url``; ``lf.reads`` lists each read request."""

    def __init__(self, *, v2: bool = True, rate_limit_requests: tuple[int, ...] = (), retry_after: str = "1",
                 hang_s: float = 0.0, api_ids: Callable[[str], str] | None = None, **keys: str) -> None:  # fmt: skip
        super().__init__(**keys)
        self.v2, self.rate_limit_requests, self.retry_after, self.hang_s = v2, set(rate_limit_requests), retry_after, hang_s
        self.reads: list[tuple[str, dict[str, Any], int]] = []
        self.api_id: Callable[[str], str] = api_ids or (lambda hex_id: hex_id)
        self._hex_of: dict[str, str] = {}

    def _api(self, hex_id: str | None) -> str | None:
        if hex_id is None:
            return None
        api_id = self.api_id(hex_id)
        self._hex_of[api_id] = hex_id
        return api_id

    def routes(self) -> list[Any]:
        return [
            *super().routes(),
            Route("/api/public/traces", self._list_traces, methods=["GET"]),
            Route("/api/public/traces/{trace_id:path}", self._get_trace, methods=["GET"]),
            Route("/api/public/v2/observations", self._observations_v2, methods=["GET"]),
            Route("/api/public/observations", self._observations_v1, methods=["GET"]),
        ]

    # -- the data model ----------------------------------------------------------------------------
    def trace_objects(self) -> list[dict[str, Any]]:
        by_trace: dict[str, list[CollectedSpan]] = {}
        for span in self.spans:
            by_trace.setdefault(span.trace_id, []).append(span)
        return sorted((trace_object(tid, spans, self._api) for tid, spans in by_trace.items()), key=lambda t: t["timestamp"])

    def observation_objects(self, trace_id: str, *, raw_io: bool) -> list[dict[str, Any]]:
        """The observations of a trace, by its API id."""
        self.trace_objects()  # every id known
        spans = sorted(self.trace(self._hex_of.get(trace_id, trace_id)), key=lambda s: s.start_time)
        return [observation_object(s, self._api, raw_io=raw_io) for s in spans]

    # -- endpoints -----------------------------------------------------------------------------------
    async def _read(self, request: Request) -> Response | None:
        """Auth, fault injection and bookkeeping shared by every read endpoint."""
        number = len(self.reads) + 1
        self.reads.append((request.url.path, dict(request.query_params.multi_items()), number))
        if self.hang_s:
            await asyncio.sleep(self.hang_s)
        if not self._authorized(request):
            return JSONResponse({"message": "Invalid credentials"}, status_code=401)
        if number in self.rate_limit_requests:
            return JSONResponse({"message": "Rate limit exceeded"}, status_code=429, headers={"Retry-After": self.retry_after})
        return None

    async def _list_traces(self, request: Request) -> Response:
        if (refused := await self._read(request)) is not None:
            return refused
        q = request.query_params
        traces = self.trace_objects()
        if q.get("sessionId"):
            traces = [t for t in traces if t["sessionId"] == q["sessionId"]]
        if q.get("name"):
            traces = [t for t in traces if t["name"] == q["name"]]
        if q.get("userId"):
            traces = [t for t in traces if t["userId"] == q["userId"]]
        tags = q.getlist("tags")
        if tags:
            traces = [t for t in traces if set(tags) <= set(t["tags"])]
        if q.get("fromTimestamp"):
            since = _parse_time(q["fromTimestamp"])
            traces = [t for t in traces if _parse_time(t["timestamp"]) >= since]
        return JSONResponse(_page(traces, q))

    async def _get_trace(self, request: Request) -> Response:
        if (refused := await self._read(request)) is not None:
            return refused
        segment = request.scope["raw_path"].decode().split(f"{TRACES_PATH}/", 1)[1]
        if "/" in segment:  # Langfuse's route is one path segment: an id with "/" must come quoted
            return JSONResponse({"message": "Not found"}, status_code=404)
        found = [t for t in self.trace_objects() if t["id"] == unquote(segment)]
        if not found:
            return JSONResponse({"message": "Trace not found within authorized project"}, status_code=404)
        return JSONResponse({**found[0], "observations": self.observation_objects(found[0]["id"], raw_io=False)})

    async def _observations_v2(self, request: Request) -> Response:
        if not self.v2:
            return Response("Not Found", status_code=404)
        if (refused := await self._read(request)) is not None:
            return refused
        q = request.query_params
        items = self.observation_objects(q["traceId"], raw_io=True) if q.get("traceId") else []
        start = int(base64.b64decode(q["cursor"]).decode()) if q.get("cursor") else 0
        limit = int(q.get("limit", 50))
        meta = {"cursor": base64.b64encode(str(start + limit).encode()).decode()} if start + limit < len(items) else {}
        return JSONResponse({"data": items[start : start + limit], "meta": meta})

    async def _observations_v1(self, request: Request) -> Response:
        if (refused := await self._read(request)) is not None:
            return refused
        q = request.query_params
        items = self.observation_objects(q["traceId"], raw_io=False) if q.get("traceId") else []
        return JSONResponse(_page(items, q))


def _page(items: list[dict[str, Any]], q: Any) -> dict[str, Any]:
    page, limit = int(q.get("page", 1)), int(q.get("limit", 50))
    total_pages = (len(items) + limit - 1) // limit
    chunk = items[(page - 1) * limit : page * limit]
    return {"data": chunk, "meta": {"page": page, "limit": limit, "totalItems": len(items), "totalPages": total_pages}}


# -- observations and traces as the public API returns them --------------------------------------------
def observation_object(span: CollectedSpan, api: Callable[[str | None], str | None], *, raw_io: bool) -> dict[str, Any]:
    """One observation (Langfuse's mapping: ``langfuse_mapping``) with the API's field names and ids."""
    o = observation(span)
    a = span.attributes
    return {
        "id": api(o.id),
        "traceId": api(o.trace_id),
        "type": o.type.upper(),
        "name": o.name,
        "startTime": _iso(span.start_time),
        "endTime": _iso(span.end_time),
        "parentObservationId": api(o.parent_id),
        "level": a.get("langfuse.observation.level") or ("ERROR" if span.status_code == 2 else "DEFAULT"),
        "model": o.model,
        "input": _raw(o.input) if raw_io else _json_value(o.input),
        "output": _raw(o.output) if raw_io else _json_value(o.output),
        "metadata": o.metadata,
        "usageDetails": {k: int(v) for k, v in o.usage.items()},
        "environment": o.environment,
    }


def trace_object(trace_id: str, spans: list[CollectedSpan], api: Callable[[str | None], str | None]) -> dict[str, Any]:
    """A trace: its fields from the observations (every span carries them), input from the root."""
    ordered = sorted(spans, key=lambda s: s.start_time)
    root = next((s for s in ordered if s.parent_span_id is None), ordered[0])
    observations = [observation(s) for s in ordered]

    def first(field: str) -> Any:
        return next((getattr(o, field) for o in observations if getattr(o, field) not in (None, "", [])), None)

    top = observation(root)
    return {
        "id": api(trace_id),
        "timestamp": _iso(root.start_time),
        "name": first("trace_name") or root.name,
        "sessionId": first("session_id"),
        "userId": first("user_id"),
        "tags": first("tags") or [],
        "input": _json_value(top.trace_input),
        "output": _json_value(top.trace_output),
        "metadata": first("trace_metadata") or {},
        "observations": [api(s.span_id) for s in ordered],
    }


def _raw(value: Any) -> Any:
    """The v2 API's raw form: the stored string (an input Langfuse rebuilt, e.g. with tools, as JSON)."""
    return value if value is None or isinstance(value, str) else json.dumps(value)


def _json_value(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _iso(ns: int) -> str:
    return dt.datetime.fromtimestamp(ns / 1e9, dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _parse_time(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
