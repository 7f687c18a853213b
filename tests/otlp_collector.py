"""A real OTLP/HTTP + Langfuse-ingestion endpoint on loopback, for the export tests.

It accepts what a Langfuse server accepts and decodes it the same way: protobuf
``ExportTraceServiceRequest`` bodies (gunzipped when ``Content-Encoding: gzip``) at
``POST /api/public/otel/v1/traces`` (Basic auth required) and ``POST /v1/traces`` (plain
OTLP, no auth), JSON scores at ``POST /api/public/scores`` and the key check at
``GET /api/public/projects``.  Every span is recorded as a :class:`CollectedSpan`, and
:meth:`OTLPCollector.observations` maps them as Langfuse's ingestion does
(:mod:`langfuse_mapping`); scores are validated as Langfuse's public API validates them.
Every request body is kept as it came (decompressed), so :meth:`OTLPCollector.dump` can
write what was received as the OpenTelemetry Collector's file exporter would: OTLP JSON
lines or length-prefixed protobuf.
"""

from __future__ import annotations

import base64
import gzip
import json
import re
import struct
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from langfuse_mapping import Observation, observation
from loopback_app import LoopbackApp
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


@dataclass
class CollectedSpan:
    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    scope: str
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    resource: dict[str, Any]
    path: str
    headers: dict[str, str] = field(default_factory=dict)
    links: list[tuple[str, str]] = field(default_factory=list)
    start_time: int = 0
    end_time: int = 0
    status_code: int = 0


def any_value(value: Any) -> Any:
    """An OTLP ``AnyValue`` as a Python value."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind)


def _attributes(key_values: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in key_values}


class OTLPCollector(LoopbackApp):
    """``with OTLPCollector(public_key, secret_key) as c:`` then ``c.url``, ``c.spans``, ``c.scores``."""

    def __init__(self, public_key: str = "pk-lf-test", secret_key: str = "sk-lf-test") -> None:
        super().__init__()
        self.expected_auth = "Basic " + base64.b64encode(f"{public_key}:{secret_key}".encode()).decode()
        self.spans: list[CollectedSpan] = []
        self.scores: list[dict[str, Any]] = []
        self.score_problems: list[str] = []
        """Why each refused score was refused (400, as Langfuse answers)."""
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.rejected: list[str] = []
        self.bodies: list[bytes] = []
        """Every request body as received, decompressed (spans and scores alike)."""
        self.trace_bodies: list[bytes] = []
        """The decoded OTLP trace requests (protobuf), in order: what :meth:`dump` writes."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def routes(self) -> list[Any]:
        return [
            Route("/api/public/otel/v1/traces", self._traces, methods=["POST"]),
            Route("/v1/traces", self._traces, methods=["POST"]),
            Route("/api/public/scores", self._score, methods=["POST"]),
            Route("/api/public/projects", self._projects, methods=["GET"]),
        ]

    # -- queries -----------------------------------------------------------------------------
    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
        deadline = time.time() + timeout_s
        while not predicate():
            if time.time() > deadline:
                raise AssertionError(f"timed out; spans={[s.name for s in self.spans]} scores={self.scores}")
            time.sleep(0.02)

    def trace(self, trace_id: str) -> list[CollectedSpan]:
        return [s for s in self.spans if s.trace_id == trace_id]

    def observations(self, trace_ids: Any = None) -> list[Observation]:
        """Every span as the Langfuse observation it becomes (of the given trace id or ids)."""
        wanted = {trace_ids} if isinstance(trace_ids, str) else set(trace_ids or ())
        return [observation(s) for s in self.spans if not wanted or s.trace_id in wanted]

    def generations(self, trace_ids: Any = None) -> list[Observation]:
        return [o for o in self.observations(trace_ids) if o.type == "generation"]

    def summed_usage(self, trace_ids: Any = None) -> dict[str, float]:
        """What Langfuse adds up for the traces: the usage of every observation that has one."""
        total: dict[str, float] = {}
        for o in self.observations(trace_ids):
            for key, value in o.usage.items():
                total[key] = total.get(key, 0) + value
        return total

    def trace_fields(self, trace_id: str) -> set[tuple[Any, ...]]:
        """The trace-level fields each observation of a trace carries (one tuple per distinct value)."""
        return {
            (o.trace_name, o.session_id, o.user_id, tuple(o.tags), o.release, o.version, o.environment)
            for o in self.observations(trace_id)
        }

    def dump(self, path: Path, format: str = "json") -> Path:
        """Write every request received, as the Collector's ``file`` exporter does.

        ``json``: one OTLP/JSON ``ExportTraceServiceRequest`` per line (ids in hex, enums
        as numbers, as the OTLP JSON encoding says); ``proto``: each protobuf message
        preceded by its length (4 bytes, big-endian).
        """
        with open(path, "wb") as f:
            for body in self.trace_bodies:
                if format == "proto":
                    f.write(struct.pack(">I", len(body)) + body)
                else:
                    f.write(json.dumps(otlp_json(body)).encode() + b"\n")
        return path

    # -- endpoints ---------------------------------------------------------------------------
    def _authorized(self, request: Request) -> bool:
        ok = request.headers.get("authorization") == self.expected_auth
        if not ok:
            self.rejected.append(request.url.path)
        return ok

    async def _traces(self, request: Request) -> Response:
        path = request.url.path
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.requests.append((path, headers))
        if path.startswith("/api/public/") and not self._authorized(request):
            return JSONResponse({"message": "Invalid credentials"}, status_code=401)
        body = await request.body()
        if headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        self.bodies.append(body)
        if headers.get("content-type") != "application/x-protobuf":
            return JSONResponse({"message": "only OTLP/HTTP protobuf"}, status_code=415)
        message = ExportTraceServiceRequest()
        message.ParseFromString(body)
        self.trace_bodies.append(body)
        for resource_spans in message.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(
                        CollectedSpan(
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex() or None,
                            name=span.name,
                            scope=scope_spans.scope.name,
                            attributes=_attributes(span.attributes),
                            events=[(e.name, _attributes(e.attributes)) for e in span.events],
                            resource=resource,
                            path=path,
                            headers=headers,
                            links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                            start_time=span.start_time_unix_nano,
                            end_time=span.end_time_unix_nano,
                            status_code=span.status.code,
                        )
                    )
        return Response(ExportTraceServiceResponse().SerializeToString(), media_type="application/x-protobuf")

    async def _score(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse({"message": "Invalid credentials"}, status_code=401)
        self.bodies.append(await request.body())
        body = await request.json()
        problem = score_problem(body)
        if problem:
            self.score_problems.append(problem)
            return JSONResponse({"message": problem}, status_code=400)
        self.scores.append({**body, "environment": body.get("environment", "default")})
        return JSONResponse({"id": body.get("id") or uuid.uuid4().hex})

    async def _projects(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse({"message": "Invalid credentials"}, status_code=401)
        return JSONResponse({"data": [{"id": "project-1", "name": "tracerl-test"}]})




SCORE_FIELDS = frozenset({
    "id", "traceId", "sessionId", "observationId", "datasetRunId", "name", "value", "comment", "metadata",
    "environment", "queueId", "dataType", "configId", "source",
})  # fmt: skip
"""``CreateScoreRequest``'s properties (Langfuse's ``fern/apis/server/definition/scores.yml``)."""
_ENVIRONMENT = re.compile(r"^(?!langfuse)[a-z0-9_-]+$")


def score_problem(body: dict[str, Any]) -> str | None:
    """Langfuse's ``PostScoresBody`` checks (``applyScoreValidation`` and the data types), and no
    field outside ``CreateScoreRequest`` (zod would drop it silently: a misspelt field is lost)."""
    unknown = sorted(set(body) - SCORE_FIELDS)
    if unknown:
        return f"not fields of CreateScoreRequest: {unknown}"
    if not body.get("name") or "value" not in body:
        return "name and value are required"
    targets = [k for k in ("traceId", "sessionId", "datasetRunId") if body.get(k)]
    if len(targets) != 1 or (body.get("observationId") and targets != ["traceId"]):
        return "Provide exactly one of traceId (with optional observationId), sessionId or datasetRunId"
    if any(not isinstance(body.get(k, ""), str) for k in ("id", "traceId", "sessionId", "observationId", "comment")):
        return "ids and comment must be strings"
    if body.get("dataType") not in (None, "NUMERIC", "CATEGORICAL", "BOOLEAN", "CORRECTION", "TEXT"):
        return f"unknown dataType {body.get('dataType')!r}"
    if body.get("dataType") == "NUMERIC" and (isinstance(body["value"], bool) or not isinstance(body["value"], (int, float))):
        return "NUMERIC scores need a number"
    if body.get("source") not in (None, "API", "ANNOTATION"):
        return "source must be API or ANNOTATION"
    if body.get("metadata") is not None and not isinstance(body["metadata"], (dict, list)):
        return "metadata must be JSON"
    environment = body.get("environment", "default")
    if not isinstance(environment, str) or not _ENVIRONMENT.fullmatch(environment):
        return "environment: lowercase letters, digits, '-' or '_', not starting with 'langfuse'"
    return None


def otlp_json(body: bytes) -> dict[str, Any]:
    """A protobuf ``ExportTraceServiceRequest`` in the OTLP JSON encoding (hex ids, not base64)."""
    from google.protobuf.json_format import MessageToDict

    message = ExportTraceServiceRequest()
    message.ParseFromString(body)
    data = MessageToDict(message, use_integers_for_enums=True)
    for resource_spans in data.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if span.get(key):
                        span[key] = base64.b64decode(span[key]).hex()
                for link in span.get("links", []):
                    for key in ("traceId", "spanId"):
                        if link.get(key):
                            link[key] = base64.b64decode(link[key]).hex()
    return data
