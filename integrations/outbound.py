"""What leaves the process: spans redacted and with full chat inputs; trajectories redacted.

:class:`OutboundSpanExporter` wraps the exporter of every destination tracerl exports to
(``export_to_otlp`` / ``export_to_langfuse``), and is public so that an exporter the user
attaches to the same provider gets the same treatment (it wraps any ``SpanExporter``).  On
the export thread, for each span of a batch (tracerl's, OpenInference's, the MCP SDK's, anyone's):

1. tracerl's internal spans are dropped: the HTTP client spans an instrumentation (httpx,
   requests...) records of requests to the endpoints tracerl itself sends to — the OTLP
   endpoints it exports to, Langfuse's ingestion, score and key-check endpoints, the read
   endpoints an import uses (:func:`mark_internal_url`), by URL, whoever sent them.  tracerl
   sends that traffic with instrumentation suppressed; this catches instrumentations that
   ignore the suppression, and exporters of other libraries instrumented the same way;
2. a chat span whose input capture stored as a delta (:mod:`.input_delta`) gets its full
   ``gen_ai.input.messages`` back, so each generation shows its whole input (without the
   wrapper an exporter sees only the messages each call added);
3. attributes, event attributes (``exception.message`` / ``exception.stacktrace`` included),
   link attributes, the status description and the name pass through :func:`tracerl.redact.redact`.

Expanded inputs are transient: a batch is handed on in slices of at most
``max_batch_chars`` characters of expanded input, so memory stays bounded however long the
rollouts are.  :func:`redact_trajectory` is the capture-side half, applied when a rollout ends.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import Link, Status

from tracerl.redact import redact, redact_message, redact_text
from tracerl.types import Choice, History, Trajectory

from . import semconv as sc
from .health import record_error
from .input_delta import InputExpander

MAX_BATCH_CHARS = 8_000_000
"""Characters of expanded chat input handed to the inner exporter at once (one slice of a batch)."""
_DELTA_KEYS = (sc.INPUT_BASE_SPAN_ID, sc.INPUT_PREFIX_LENGTH)


_internal_urls: set[str] = set()
_URL_KEYS = ("url.full", "http.url")  # HTTP semconv: current name, then the older one


def mark_internal_url(prefix: str) -> None:
    """Requests to URLs starting with ``prefix`` are tracerl's own traffic (their spans are internal)."""
    _internal_urls.add(prefix)


def is_internal_span(span: ReadableSpan) -> bool:
    """An HTTP client span of tracerl's own traffic to an export destination (see :func:`mark_internal_url`)."""
    attributes = span.attributes or {}
    url = next((attributes[k] for k in _URL_KEYS if isinstance(attributes.get(k), str)), None)
    return url is not None and any(url.startswith(prefix) for prefix in tuple(_internal_urls))


class OutboundSpanExporter(SpanExporter):
    """Wrap your own ``SpanExporter`` in this to send tracerl's spans the way tracerl's exporters do.

    Attaching an exporter of your own to the provider tracerl captures on (``BatchSpanProcessor
    (OutboundSpanExporter(ConsoleSpanExporter()))``) makes it receive every span, credentials
    included wherever an instrumentation recorded them, and chat inputs as deltas; wrapped, it
    gets what Langfuse and OTLP destinations get: tracerl's internal spans dropped, full chat
    inputs, everything redacted (:func:`tracerl.redact.redact`; register your own secrets with
    :func:`tracerl.redact.register_secret`), in slices of at most ``max_batch_chars``
    characters of expanded input (memory stays bounded).  ``keep_internal=True`` keeps the
    internal spans.  Spans are copies: the originals, and other processors, are untouched.
    """

    def __init__(self, inner: SpanExporter, *, max_batch_chars: int = MAX_BATCH_CHARS, keep_internal: bool = False) -> None:
        self.inner = inner
        self.max_batch_chars = max_batch_chars
        self.keep_internal = keep_internal
        self.dropped_internal = 0
        """Internal spans dropped so far."""
        self.expander = InputExpander(redact_text)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Hand the spans on, cleaned, slice by slice; FAILURE when the inner exporter failed any slice."""
        result = SpanExportResult.SUCCESS
        for part in self._slices(spans):
            if self.inner.export(part) is not SpanExportResult.SUCCESS:
                result = SpanExportResult.FAILURE
        return result

    def _slices(self, spans: Sequence[ReadableSpan]) -> Iterator[list[ReadableSpan]]:
        part: list[ReadableSpan] = []
        size = 0
        for span in spans:
            if not self.keep_internal and is_internal_span(span):
                self.dropped_internal += 1
                continue
            clean, chars = self._outbound(span)
            if part and size + chars > self.max_batch_chars:
                yield part
                part, size = [], 0
            part.append(clean)
            size += chars
        if part:
            yield part

    def _outbound(self, span: ReadableSpan) -> tuple[ReadableSpan, int]:
        """The span as it may leave, and the characters of chat input it carries."""
        attributes = dict(span.attributes or {})
        full = None
        if sc.INPUT_MESSAGES in attributes and span.instrumentation_scope and span.instrumentation_scope.name == sc.SCOPE:
            try:
                full = self.expander.full_input(span.context.trace_id, span.context.span_id, attributes)
            except Exception as error:  # noqa: BLE001 - a malformed input must not stop the export
                record_error("export_expand_input", error)
        if full is not None:
            for key in _DELTA_KEYS:
                attributes.pop(key, None)
            attributes[sc.INPUT_MESSAGES] = full  # already redacted, message by message
        elif sc.INPUT_BASE_SPAN_ID in attributes:
            record_error("export_input_base_missing")  # leaves as a delta, marked by its base attributes
        return redact_span(span, attributes, skip=sc.INPUT_MESSAGES if full is not None else None), len(full or "")

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self.inner.shutdown()


def redact_span(span: ReadableSpan, attributes: dict[str, Any] | None = None, *, skip: str | None = None) -> ReadableSpan:
    """A copy of ``span`` whose attributes, events, links, status and name are redacted
    (``attributes``: use these instead of the span's; ``skip``: one attribute already clean)."""
    attributes = dict(span.attributes or {}) if attributes is None else attributes
    kept = attributes.pop(skip, None) if skip else None
    clean = _redact_attributes(attributes)
    if skip and kept is not None:
        clean[skip] = kept
    events = [Event(e.name, _redact_attributes(e.attributes), e.timestamp) for e in span.events]
    links = [Link(link.context, _redact_attributes(link.attributes)) for link in span.links]
    status = span.status
    if status.description:
        status = Status(status.status_code, redact_text(status.description))
    return ReadableSpan(
        name=redact_text(span.name), context=span.context, parent=span.parent, resource=span.resource,
        attributes=clean, events=events, links=links, kind=span.kind, status=status,
        start_time=span.start_time, end_time=span.end_time, instrumentation_scope=span.instrumentation_scope,
    )  # fmt: skip


def _redact_attributes(attributes: Any) -> dict[str, Any]:
    if not attributes:
        return {}
    out = redact(dict(attributes))
    return {k: tuple(v) if isinstance(v, list) else v for k, v in out.items()}  # OTel sequences stay tuples


def redact_trajectory(trajectory: Trajectory) -> Trajectory:
    """Redact a captured trajectory in place (messages, tools' arguments, metadata, logs); returns it.

    Runs once when a rollout ends, so credentials that reached the agent's messages (a tool
    result, an error echoed back) are never trained on, stored by ``model.log`` or sent to
    ``tracerl serve``.  Token ids are kept as they are.
    """
    tools_seen: dict[Any, tuple[Any, Any]] = {}
    clean_seen: set[tuple[Any, ...]] | None = set() if trajectory.additional_histories else None
    for history in (trajectory, *trajectory.additional_histories):
        _redact_history(history, tools_seen, clean_seen)
    # assign only what changed: every assignment to a trajectory field is validated again
    metadata = redact(trajectory.metadata)
    if metadata is not trajectory.metadata:
        trajectory.metadata = metadata
    logs = [redact_text(line) for line in trajectory.logs]
    if any(a is not b for a, b in zip(logs, trajectory.logs)):
        trajectory.logs = logs
    return trajectory


def _redact_history(
    history: History, tools_seen: dict[Any, tuple[Any, Any]], clean_seen: set[tuple[Any, ...]] | None
) -> None:
    """``tools_seen``: tool schemas already redacted in this trajectory (:func:`_redacted_tool`);
    ``clean_seen`` (a trajectory of several histories): the contents of messages without tool
    calls found clean so far (each history holds its own copy of a prompt the calls shared: it
    is checked once)."""
    items = history.messages_and_choices
    for index, item in enumerate(items):
        if isinstance(item, Choice):
            message = redact_message(item.message)
            if message is not item.message:
                item.message = message
        elif clean_seen is not None and item.__class__ is dict and "tool_calls" not in item:
            content = tuple(item.items())
            try:
                if content in clean_seen:
                    continue
            except TypeError:  # a value that cannot be hashed (a list of content parts): no memo
                items[index] = redact_message(item)
                continue
            clean = redact_message(item)
            if clean is item:
                clean_seen.add(content)
            else:
                items[index] = clean
        else:
            items[index] = redact_message(item)
    tools = history.tools
    if tools:
        redacted = [_redacted_tool(tool, tools_seen) for tool in tools]
        if any(new is not old for new, old in zip(redacted, tools)):
            history.tools = redacted


def _redacted_tool(tool: Any, seen: dict[Any, tuple[Any, Any]]) -> Any:
    """``redact(tool)``, remembered per trajectory by the tool's name: each history holds its own copy
    of the rollout's schemas (pydantic copies a dict field), so an equal one is answered from the
    first (one C-level comparison instead of a walk); an unchanged tool is returned as itself."""
    function = tool.get("function") if type(tool) is dict else None
    name = function.get("name") if type(function) is dict else None
    key = name if type(name) is str else id(tool)
    entry = seen.get(key)
    if entry is not None and (entry[0] is tool or _equal(entry[0], tool)):
        return tool if entry[1] is entry[0] else entry[1]
    result = redact(tool)
    seen[key] = (tool, result)
    return result


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value that cannot be compared: walk the tool instead
        return False
