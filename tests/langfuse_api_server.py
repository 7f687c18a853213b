"""A Langfuse stand-in on loopback: OTLP ingestion in, Langfuse's public read API out.

Spans arrive as at Langfuse (``POST /api/public/otel/v1/traces``, protobuf, Basic auth;
from the Langfuse SDK itself or from tracerl's exporter) and are mapped the way
Langfuse's ingestion maps them (``packages/shared/src/server/otel/``:
``ObservationTypeMapper`` for the type, ``extractInputAndOutput`` / ``extractName`` /
``extractMetadata`` / ``extractModelName`` / usage, trace-level fields from every span),
then served with Langfuse's field names and pagination:

* ``GET /api/public/traces`` (``page``, ``limit``, ``sessionId``, ``name``, ``userId``,
  ``tags`` (all of them), ``fromTimestamp``; ``meta.page/limit/totalItems/totalPages``),
  ``GET /api/public/traces/{traceId}``;
* ``GET /api/public/v2/observations`` (``traceId``, ``limit``, ``cursor``;
  ``meta.cursor``; ``input`` / ``output`` as raw strings) — or, with ``v2=False``, 404
  there as on older servers, and ``GET /api/public/observations`` (``page`` / ``limit``,
  inputs and outputs as JSON values).

Faults on demand: ``rate_limit_requests`` (request numbers answered 429 with a
``Retry-After``), ``hang_s`` (every read request stalls that long).
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
from typing import Any

from otlp_collector import CollectedSpan, OTLPCollector
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

_GENERATION_OPERATIONS = {"chat": "GENERATION", "text_completion": "GENERATION", "generate_content": "GENERATION",
                          "invoke_agent": "AGENT", "execute_tool": "TOOL"}  # fmt: skip
_OPENINFERENCE_KINDS = {"CHAIN": "CHAIN", "RETRIEVER": "RETRIEVER", "LLM": "GENERATION", "AGENT": "AGENT", "TOOL": "TOOL"}


class LangfuseAPIServer(OTLPCollector):
    """``with LangfuseAPIServer() as lf:`` then ``lf.url``; ``lf.reads`` lists each read request."""

    def __init__(self, *, v2: bool = True, rate_limit_requests: tuple[int, ...] = (), retry_after: str = "1",
                 hang_s: float = 0.0, **keys: str) -> None:  # fmt: skip
        super().__init__(**keys)
        self.v2, self.rate_limit_requests, self.retry_after, self.hang_s = v2, set(rate_limit_requests), retry_after, hang_s
        self.reads: list[tuple[str, dict[str, Any], int]] = []

    def routes(self) -> list[Any]:
        return [
            *super().routes(),
            Route("/api/public/traces", self._list_traces, methods=["GET"]),
            Route("/api/public/traces/{trace_id}", self._get_trace, methods=["GET"]),
            Route("/api/public/v2/observations", self._observations_v2, methods=["GET"]),
            Route("/api/public/observations", self._observations_v1, methods=["GET"]),
        ]

    # -- the data model ----------------------------------------------------------------------------
    def trace_objects(self) -> list[dict[str, Any]]:
        by_trace: dict[str, list[CollectedSpan]] = {}
        for span in self.spans:
            by_trace.setdefault(span.trace_id, []).append(span)
        return sorted((trace_object(tid, spans) for tid, spans in by_trace.items()), key=lambda t: t["timestamp"])

    def observation_objects(self, trace_id: str, *, raw_io: bool) -> list[dict[str, Any]]:
        spans = sorted(self.trace(trace_id), key=lambda s: s.start_time)
        return [observation_object(s, raw_io=raw_io) for s in spans]

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
        found = [t for t in self.trace_objects() if t["id"] == request.path_params["trace_id"]]
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


# -- Langfuse's ingestion mapping (the parts a trace import reads) ---------------------------------------
def observation_type(a: dict[str, Any]) -> str:
    """``ObservationTypeMapper``: langfuse.observation.type, OpenInference kind, GenAI operation, tool, model."""
    if a.get("langfuse.observation.type"):
        return str(a["langfuse.observation.type"]).upper()
    if a.get("openinference.span.kind") in _OPENINFERENCE_KINDS:
        return _OPENINFERENCE_KINDS[a["openinference.span.kind"]]
    if a.get("gen_ai.operation.name") in _GENERATION_OPERATIONS:
        return _GENERATION_OPERATIONS[a["gen_ai.operation.name"]]
    if a.get("gen_ai.tool.name") or a.get("gen_ai.tool.call.id"):
        return "TOOL"
    if any(a.get(k) for k in ("langfuse.observation.model.name", "gen_ai.request.model", "gen_ai.response.model", "llm.model_name")):
        return "GENERATION"
    return "SPAN"


def input_output(a: dict[str, Any]) -> tuple[Any, Any]:
    """``extractInputAndOutput``, in its order, for the attributes these tests produce."""
    for input_key, output_key in (
        ("langfuse.observation.input", "langfuse.observation.output"),
        ("input.value", "output.value"),
        ("gen_ai.input.messages", "gen_ai.output.messages"),
        ("gen_ai.tool.call.arguments", "gen_ai.tool.call.result"),
    ):
        if a.get(input_key) or a.get(output_key):
            return a.get(input_key), a.get(output_key)
    return None, None


def observation_object(span: CollectedSpan, *, raw_io: bool) -> dict[str, Any]:
    a = span.attributes
    raw_input, raw_output = input_output(a)
    usage = _usage(a)
    metadata = {k.removeprefix("langfuse.observation.metadata."): v for k, v in a.items()
                if k.startswith("langfuse.observation.metadata.")}  # fmt: skip
    return {
        "id": span.span_id,
        "traceId": span.trace_id,
        "type": observation_type(a),
        "name": a.get("gen_ai.tool.name") or span.name,
        "startTime": _iso(span.start_time),
        "endTime": _iso(span.end_time),
        "parentObservationId": span.parent_span_id,
        "level": a.get("langfuse.observation.level") or ("ERROR" if span.status_code == 2 else "DEFAULT"),
        "model": next((a[k] for k in ("langfuse.observation.model.name", "gen_ai.response.model", "gen_ai.request.model",
                                      "llm.model_name") if a.get(k)), None),  # fmt: skip
        "input": raw_input if raw_io else _json_value(raw_input),
        "output": raw_output if raw_io else _json_value(raw_output),
        "metadata": metadata,
        "usageDetails": usage,
        "environment": a.get("langfuse.environment", "default"),
    }


def trace_object(trace_id: str, spans: list[CollectedSpan]) -> dict[str, Any]:
    root = min((s for s in spans if s.parent_span_id is None), key=lambda s: s.start_time, default=spans[0])

    def first(*keys: str) -> Any:
        for span in sorted(spans, key=lambda s: s.start_time):
            for key in keys:
                if span.attributes.get(key) not in (None, ""):
                    return span.attributes[key]
        return None

    tags = first("langfuse.trace.tags")
    return {
        "id": trace_id,
        "timestamp": _iso(root.start_time),
        "name": first("langfuse.trace.name") or root.name,
        "sessionId": first("session.id", "langfuse.session.id"),
        "userId": first("user.id", "langfuse.user.id"),
        "tags": list(tags) if isinstance(tags, (list, tuple)) else json.loads(tags) if isinstance(tags, str) else [],
        "input": _json_value(first("langfuse.trace.input") or root.attributes.get("langfuse.observation.input")),
        "output": _json_value(first("langfuse.trace.output") or root.attributes.get("langfuse.observation.output")),
        "metadata": {},
        "observations": [s.span_id for s in spans],
    }


def _usage(a: dict[str, Any]) -> dict[str, int]:
    if a.get("langfuse.observation.usage_details"):
        return json.loads(a["langfuse.observation.usage_details"])
    usage = {}
    for name, keys in (("input", ("gen_ai.usage.input_tokens", "llm.token_count.prompt")),
                       ("output", ("gen_ai.usage.output_tokens", "llm.token_count.completion"))):  # fmt: skip
        value = next((a[k] for k in keys if a.get(k) is not None), None)
        if value is not None:
            usage[name] = int(value)
    return usage


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
