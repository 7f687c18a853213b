"""Spans to any OTLP/HTTP endpoint: one processor per destination, one exporter every span passes.

Nothing here runs until an exporter is configured, so capture pays nothing for it.  Then:
spans leave through OpenTelemetry's own ``BatchSpanProcessor`` + ``OTLPSpanExporter``
(background thread, bounded queue), and :meth:`SpanExporter.export` below is the one place
every outgoing span passes, on that thread: the Langfuse view is made there, on copies.
Failures never reach the agent or the trainer: they are logged once per kind and counted.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from tracerl.errors import ConfigError, TracerlError

from ..health import record_error
from ..outbound import OutboundSpanExporter, mark_internal_url
from ..processor import get_tracer_provider
from .langfuse import Destination, is_sdk_span, langfuse_view


class ExportError(TracerlError, ConnectionError):
    """Spans or scores could not be delivered (recorded and counted, never raised into training)."""


class Exporter(SpanExporter):
    """Wraps the OTLP exporter: every span passes :meth:`outgoing`; failures are counted."""

    def __init__(self, inner: SpanExporter, endpoint: str, where: Destination | None) -> None:
        self.inner, self.endpoint, self.where = inner, endpoint, where
        self.add_langfuse_attributes = where is not None
        self.skip_sdk_spans = False
        self.failed_spans = 0

    def outgoing(self, span: ReadableSpan) -> ReadableSpan | None:
        """The span as this destination receives it (None: not sent). Runs on the export thread.

        Every span bound for any destination passes here, once per destination: the place
        for any other step on the way out (e.g. redacting secrets); copy a span before changing it.
        """
        if self.skip_sdk_spans and is_sdk_span(span):
            return None  # the Langfuse SDK's own processor sends its spans
        return langfuse_view(span, self.where) if self.where is not None else span

    def export(self, spans: Any) -> SpanExportResult:
        cause = "unreachable, or it answered with an error (401/403: wrong keys)"
        try:
            outgoing = [s for s in (self.outgoing(span) for span in spans) if s is not None]
            result = self.inner.export(outgoing) if outgoing else SpanExportResult.SUCCESS
        except Exception as error:  # noqa: BLE001 - runs on the export thread; count, keep going
            result, cause = SpanExportResult.FAILURE, repr(error)
        if result is not SpanExportResult.SUCCESS:
            self.failed_spans += len(spans)
            record_error("otlp_export", ExportError(f"{len(spans)} spans not exported to {self.endpoint}: {cause}"))
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()


class ExportProcessor(BatchSpanProcessor):
    """One destination: OpenTelemetry's batch processor for spans, plus Langfuse's score sender."""

    def __init__(self, provider: TracerProvider, exporter: Exporter, scores: Any = None) -> None:
        super().__init__(exporter)
        self.provider, self.exporter, self.scores, self.endpoint = provider, exporter, scores, exporter.endpoint
        self.where = exporter.where or Destination()
        self.closed = False

    def on_end(self, span: ReadableSpan) -> None:
        if not self.closed:  # a provider cannot drop a processor: a closed one stays attached, idle
            super().on_end(span)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        done = super().force_flush(timeout_millis)
        return (self.scores.flush(timeout_millis / 1000) if self.scores else True) and done

    def shutdown(self) -> None:
        with _lock:
            if _active.get((id(self.provider), self.endpoint)) is not self:
                return
            del _active[(id(self.provider), self.endpoint)]
            self.closed = True
        super().shutdown()
        if self.scores is not None:
            self.scores.shutdown()


_lock = threading.Lock()
_active: dict[tuple[int, str], ExportProcessor] = {}


def active() -> list[ExportProcessor]:
    """The configured destinations (a copy)."""
    return list(_active.values())


def attach(
    endpoint: str, headers: Mapping[str, str] | None, provider: TracerProvider | None, timeout_s: float,
    compression: str, where: Destination | None, make_scores: Any = None, skip_sdk_spans: bool = False,
) -> ExportProcessor:  # fmt: skip
    """The processor for ``endpoint`` on ``provider`` (created once; later calls return it)."""
    try:
        from opentelemetry.exporter.otlp.proto.http import Compression
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as error:
        raise ConfigError("exporting needs opentelemetry-exporter-otlp-proto-http: install tracerl[langfuse]") from error
    provider = provider or get_tracer_provider()
    mark_internal_url(endpoint)
    with _lock:
        processor = _active.get((id(provider), endpoint))
        if processor is None:
            otlp = OTLPSpanExporter(
                endpoint=endpoint, headers=dict(headers or {}), timeout=timeout_s, compression=Compression(compression)
            )
            otlp = OutboundSpanExporter(otlp)  # full chat inputs, credentials redacted (outbound.py)
            exporter = Exporter(otlp, endpoint, where)
            processor = ExportProcessor(provider, exporter, make_scores() if make_scores else None)
            exporter.skip_sdk_spans = skip_sdk_spans
            _active[(id(provider), endpoint)] = processor
            provider.add_span_processor(processor)
    return processor
