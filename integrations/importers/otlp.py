"""OTLP trace files -> spans -> trajectories.

Reads what the OpenTelemetry Collector's ``file`` exporter writes, and what OTLP/HTTP
carries:

* OTLP JSON lines: one ``ExportTraceServiceRequest`` (``{"resourceSpans": [...]}``) per
  line, ids in hex as the OTLP JSON encoding says (base64 ids, as a generic protobuf
  JSON printer writes them, are read too);
* protobuf: messages each preceded by their length (4 bytes, big-endian), the file
  exporter's ``format: proto``; or one bare message (an OTLP/HTTP request body).
  Gzipped files are read as well.

Spans keep their attributes as written (GenAI semconv, OpenInference, tracerl's own);
OpenInference and GenAI tool spans from other instrumentors are marked so the converter
uses their results.  A malformed line or message raises :class:`TraceImportError` naming
the file and the line or offset, never a half-read import.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import string
import struct
from pathlib import Path
from typing import Any, Iterable, Iterator

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from tracerl.types import Trajectory

from .. import semconv as sc
from .errors import TraceImportError
from .records import ImportSummary, trajectories_from_spans

_HEX_DIGITS = frozenset(string.hexdigits)
IMPORTED_LAYER = "import"
"""``tracerl.layer`` given to tool spans of other instrumentors, so their results are used."""


def import_otlp(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], *, summary: ImportSummary | None = None
) -> list[Trajectory]:
    """Trajectories (one per trace with model calls) from OTLP JSON-lines or protobuf files."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    spans: list[ReadableSpan] = []
    files = []
    for path in paths:
        spans.extend(read_otlp_file(path))
        files.append(str(path))
    return trajectories_from_spans(spans, {"source": "otlp", "files": files}, summary=summary)


def read_otlp_file(path: str | os.PathLike[str]) -> list[ReadableSpan]:
    """Every span in one OTLP file (format detected from the content, not the name)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise TraceImportError(f"cannot read OTLP file {path}: {error}") from error
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as error:
            raise TraceImportError(f"{path}: not a complete gzip file ({error})") from error
    if data.lstrip()[:1] in (b"{", b"["):
        return list(_spans_of_json(data, path))
    return list(_spans_of_protobuf(data, path))


# -- JSON ------------------------------------------------------------------------------------------
def _spans_of_json(data: bytes, path: Path) -> Iterator[ReadableSpan]:
    from google.protobuf.json_format import ParseDict, ParseError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            document = json.loads(line)
            for request in document if isinstance(document, list) else [document]:
                message = ParseDict(_base64_ids(request), ExportTraceServiceRequest(), ignore_unknown_fields=True)
                yield from spans_of_request(message)
        except (ValueError, ParseError, TypeError, AttributeError) as error:
            raise TraceImportError(f"{path}, line {number}: not an OTLP JSON ExportTraceServiceRequest ({error})") from error


def _base64_ids(request: Any) -> Any:
    """Ids as protobuf's JSON parser wants them (base64), however the file spells them.

    OTLP JSON (the Collector's file exporter) writes ids in hex, either case; files written
    with protobuf's own JSON mapping (``MessageToJson``, some SDKs and tools) in base64,
    standard or URL-safe, padded or not, which the parser reads as it is.  Lengths tell them
    apart: hex ids are 32 / 16 characters, base64 ones 22-24 / 11-12.  A 64-bit trace id in
    hex (16 characters, from Zipkin or Jaeger) is widened to 128 bits as they do.
    """
    for resource_spans in request.get("resourceSpans") or []:
        for scope_spans in resource_spans.get("scopeSpans") or []:
            for span in scope_spans.get("spans") or []:
                for holder in [span, *(span.get("links") or [])]:
                    for key, sizes in (("traceId", (32, 16)), ("spanId", (16,)), ("parentSpanId", (16,))):
                        value = holder.get(key)
                        if isinstance(value, str) and len(value) in sizes and set(value) <= _HEX_DIGITS:
                            holder[key] = base64.b64encode(bytes.fromhex(value.rjust(sizes[0], "0"))).decode()
    return request


# -- protobuf --------------------------------------------------------------------------------------
def _spans_of_protobuf(data: bytes, path: Path) -> Iterator[ReadableSpan]:
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    chunks = [(0, data)] if data[:1] == b"\x0a" else list(_length_prefixed(data, path))
    for offset, chunk in chunks:
        message = ExportTraceServiceRequest()
        try:
            message.ParseFromString(chunk)
        except DecodeError as error:
            raise TraceImportError(f"{path}, byte {offset}: not an OTLP protobuf ExportTraceServiceRequest ({error})") from error
        yield from spans_of_request(message)


def _length_prefixed(data: bytes, path: Path) -> Iterator[tuple[int, bytes]]:
    offset = 0
    while offset < len(data):
        if offset + 4 > len(data):
            raise TraceImportError(f"{path}, byte {offset}: truncated length prefix (a torn file?)")
        (size,) = struct.unpack(">I", data[offset : offset + 4])
        if offset + 4 + size > len(data):
            raise TraceImportError(f"{path}, byte {offset}: message of {size} bytes runs past the end (a torn file?)")
        yield offset, data[offset + 4 : offset + 4 + size]
        offset += 4 + size


# -- messages -> spans -----------------------------------------------------------------------------
def spans_of_request(message: Any) -> Iterator[ReadableSpan]:
    """The spans of one ``ExportTraceServiceRequest`` as SDK ``ReadableSpan`` objects."""
    for resource_spans in message.resource_spans:
        resource = Resource(_attributes(resource_spans.resource.attributes))
        for scope_spans in resource_spans.scope_spans:
            scope = InstrumentationScope(scope_spans.scope.name, scope_spans.scope.version or None)
            for span in scope_spans.spans:
                yield _readable(span, resource, scope)


def _readable(span: Any, resource: Resource, scope: InstrumentationScope) -> ReadableSpan:
    trace_id = int.from_bytes(span.trace_id, "big")
    context = trace.SpanContext(trace_id, int.from_bytes(span.span_id, "big"), is_remote=True)
    parent = None
    if span.parent_span_id:
        parent = trace.SpanContext(trace_id, int.from_bytes(span.parent_span_id, "big"), is_remote=True)
    status = trace.Status(trace.StatusCode(span.status.code), span.status.message or None)
    return ReadableSpan(
        name=span.name,
        context=context,
        parent=parent,
        resource=resource,
        attributes=_with_tool_layer(_attributes(span.attributes)),
        kind=trace.SpanKind(max(span.kind - 1, 0)),  # OTLP's enum counts UNSPECIFIED as 0
        status=status,
        start_time=span.start_time_unix_nano,
        end_time=span.end_time_unix_nano,
        instrumentation_scope=scope,
    )


def _with_tool_layer(attributes: dict[str, Any]) -> dict[str, Any]:
    """Tool spans of other instrumentors, in the shape the converter reads tool runs from."""
    if sc.LAYER in attributes:
        return attributes
    if attributes.get(sc.OPERATION_NAME) == sc.OP_EXECUTE_TOOL:
        return {**attributes, sc.LAYER: IMPORTED_LAYER}
    if attributes.get(sc.OI_SPAN_KIND) == "TOOL":
        out = {**attributes, sc.OPERATION_NAME: sc.OP_EXECUTE_TOOL, sc.LAYER: IMPORTED_LAYER}
        if sc.OI_TOOL_NAME in attributes:
            out.setdefault(sc.TOOL_NAME, attributes[sc.OI_TOOL_NAME])
        if sc.OI_OUTPUT_VALUE in attributes:
            out.setdefault(sc.TOOL_CALL_RESULT, attributes[sc.OI_OUTPUT_VALUE])
        return out
    return attributes


def _attributes(key_values: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in key_values}


def _value(value: Any) -> Any:
    """An OTLP ``AnyValue`` as a span attribute value (maps and mixed lists as JSON strings)."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        items = [_value(v) for v in value.array_value.values]
        homogeneous = len({type(i) for i in items}) <= 1 and not any(isinstance(i, (dict, list)) for i in items)
        return items if homogeneous else json.dumps(items, default=str)
    if kind == "kvlist_value":
        return json.dumps({kv.key: _value(kv.value) for kv in value.kvlist_value.values}, default=str)
    if kind == "bytes_value":
        return base64.b64encode(value.bytes_value).decode()
    return getattr(value, kind)
