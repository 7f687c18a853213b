"""Exporters: captured spans to any OTLP/HTTP backend; spans and scores to Langfuse.

Nothing here runs until an exporter is configured, so capture pays nothing for it.  Then:
spans leave through OpenTelemetry's own ``BatchSpanProcessor`` + ``OTLPSpanExporter``
(background thread, bounded queue), and the ``langfuse.*`` attributes Langfuse reads first
are derived from the ``gen_ai.*`` / ``tracerl.*`` ones on that thread, on span copies.
Scores (reward, RULER score + explanation) go as ``gen_ai.evaluation.result`` into the
rollout's trace, for any OTLP backend, and for Langfuse as JSON to ``/api/public/scores``
from one background thread; score ids are ``{trace_id}-{name}`` and Langfuse upserts on id.
Rewards are sent when a rollout ends, RULER scores when ``apply_scores`` runs (hooks in
``rollout.py`` / ``ruler/group.py``), later changes by :func:`export_scores`.  Failures
never reach the agent or the trainer: logged once per kind and counted
(:func:`tracerl.integrations.capture_error_counts`).
"""

from __future__ import annotations

import base64
import contextlib
import os
import queue
import random
import threading
import time
from collections import OrderedDict
from typing import Any, Iterable, Mapping, TypeVar
from urllib.parse import urlsplit

import httpx
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from tracerl.errors import ConfigError, TracerlError
from tracerl.types import Trajectory, TrajectoryGroup

from . import semconv as sc
from .health import record_error
from .processor import get_tracer_provider

LANGFUSE_OTEL_PATH = "/api/public/otel/v1/traces"
LANGFUSE_SCORES_PATH = "/api/public/scores"
LANGFUSE_DEFAULT_HOST = "https://cloud.langfuse.com"
# GenAI semconv names for judge results (kept here: only this module writes them).
EVALUATION_EVENT = "gen_ai.evaluation.result"
EVALUATION_NAME = "gen_ai.evaluation.name"
EVALUATION_SCORE = "gen_ai.evaluation.score.value"
EVALUATION_EXPLANATION = "gen_ai.evaluation.explanation"
OBSERVATION_TYPE = "langfuse.observation.type"
_OBSERVATION_TYPES = {
    **dict.fromkeys(sc.LLM_OPERATIONS, "generation"), sc.OP_EXECUTE_TOOL: "tool", sc.OP_INVOKE_AGENT: "agent"
}  # fmt: skip
_TRACE_METADATA = {
    sc.ROLLOUT_ID: "rollout_id", sc.ROLLOUT_TASK: "task", sc.ROLLOUT_GROUP: "group", sc.ROLLOUT_MODEL: "model"
}  # fmt: skip
_REMEMBERED = 10_000  # traces whose root span id / last sent scores are kept, per process
T = TypeVar("T")


class ExportError(TracerlError, ConnectionError):
    """Spans or scores could not be delivered (recorded and counted, never raised into training)."""


def langfuse_attributes(span: ReadableSpan) -> dict[str, Any]:
    """The ``langfuse.*`` attributes for one span, derived from what tracerl already wrote.

    Langfuse reads these before ``gen_ai.*``: without them a rollout root is a plain span
    and a group's attempts are not one session.  Attributes already on the span win.
    """
    attributes = span.attributes or {}
    kind = _OBSERVATION_TYPES.get(attributes.get(sc.OPERATION_NAME))  # type: ignore[arg-type]
    out: dict[str, Any] = {OBSERVATION_TYPE: kind or "evaluator"} if kind or EVALUATION_NAME in attributes else {}
    if sc.ROLLOUT_ID in attributes:
        out["langfuse.trace.name"] = span.name
        out.update({f"langfuse.trace.metadata.{n}": attributes[k] for k, n in _TRACE_METADATA.items() if k in attributes})
        if sc.ROLLOUT_GROUP in attributes:
            out["session.id"] = attributes[sc.ROLLOUT_GROUP]  # a group's N attempts, side by side
        if sc.ROLLOUT_TASK in attributes:
            out["langfuse.observation.input"] = attributes[sc.ROLLOUT_TASK]
    return {k: v for k, v in out.items() if k not in attributes}


def langfuse_span_filter(span: ReadableSpan) -> bool:
    """``should_export_span`` for the Langfuse SDK: its default filter plus every tracerl span.

    The default keeps spans with a ``gen_ai.*`` attribute (tracerl's rollout, chat, tool and
    evaluation spans have one) but drops MCP protocol spans such as ``tools/list``.
    """
    from langfuse.span_filter import is_default_export_span

    scope = span.instrumentation_scope
    return (scope is not None and scope.name == sc.SCOPE) or is_default_export_span(span)


class _Exporter(SpanExporter):
    """Wraps the OTLP exporter: adds Langfuse's attributes (on copies) and counts failures."""

    def __init__(self, inner: SpanExporter, endpoint: str, add_langfuse_attributes: bool) -> None:
        self.inner, self.endpoint, self.add_langfuse_attributes = inner, endpoint, add_langfuse_attributes
        self.failed_spans = 0

    def export(self, spans: Any) -> SpanExportResult:
        cause = "unreachable, or it answered with an error (401/403: wrong keys)"
        try:
            result = self.inner.export([_with_langfuse(s) for s in spans] if self.add_langfuse_attributes else spans)
        except Exception as error:  # noqa: BLE001 - runs on the export thread; count, keep going
            result, cause = SpanExportResult.FAILURE, repr(error)
        if result is not SpanExportResult.SUCCESS:
            self.failed_spans += len(spans)
            record_error("otlp_export", ExportError(f"{len(spans)} spans not exported to {self.endpoint}: {cause}"))
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()


def _with_langfuse(span: ReadableSpan) -> ReadableSpan:
    extra = langfuse_attributes(span)
    if not extra:
        return span
    return ReadableSpan(
        name=span.name, context=span.context, parent=span.parent, resource=span.resource,
        attributes={**(span.attributes or {}), **extra}, events=span.events, links=span.links, kind=span.kind,
        status=span.status, start_time=span.start_time, end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )  # fmt: skip


class _ScoreSender:
    """POSTs Langfuse scores from one daemon thread, so a slow or absent Langfuse never blocks training."""

    def __init__(self, host: str, headers: Mapping[str, str], timeout_s: float, max_queue: int = 10_000) -> None:
        self.url = host + LANGFUSE_SCORES_PATH
        self.sent = self.failed = self.dropped = 0
        self._client = httpx.Client(headers=dict(headers), timeout=timeout_s)
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(max_queue)
        self._thread = threading.Thread(target=self._run, name="tracerl-langfuse-scores", daemon=True)
        self._thread.start()

    def submit(self, body: dict[str, Any]) -> None:
        try:
            self._queue.put_nowait(body)
        except queue.Full:
            self.dropped += 1
            record_error("langfuse_scores_dropped", ExportError(f"score queue full; dropped score {body['name']}"))

    def _run(self) -> None:
        while (body := self._queue.get()) is not None:
            self._post(body)
            self._queue.task_done()
        self._queue.task_done()

    def _post(self, body: dict[str, Any]) -> None:
        try:
            response = self._client.post(self.url, json=body)
            if response.status_code < 400:
                self.sent += 1
                return
            auth = response.status_code in (401, 403)
            hint = "the keys were rejected; check LANGFUSE_PUBLIC_KEY/SECRET_KEY" if auth else response.text[:300]
            kind, error = ("langfuse_auth" if auth else "langfuse_scores"), f"answered {response.status_code}: {hint}"
        except Exception as exc:  # noqa: BLE001 - httpx errors and anything else: count, keep going
            kind, error = "langfuse_scores", f"cannot be reached: {exc!r}"
        self.failed += 1
        record_error(kind, ExportError(f"Langfuse at {self.url} {error}"))

    def flush(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def shutdown(self) -> None:
        self.flush(5.0)
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=1.0)
        self._thread.join(5.0)
        self._client.close()


class ExportProcessor(BatchSpanProcessor):
    """One destination: OpenTelemetry's batch processor for spans, plus Langfuse's score sender."""

    def __init__(self, provider: TracerProvider, exporter: _Exporter, scores: _ScoreSender | None) -> None:
        super().__init__(exporter)
        self.provider, self.exporter, self.scores, self.endpoint = provider, exporter, scores, exporter.endpoint
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
_roots: OrderedDict[int, int] = OrderedDict()  # trace id -> root span id, for rollouts ended in this process
_last_sent: OrderedDict[tuple[str, str], tuple[float, str | None]] = OrderedDict()
_hooks_installed = False


def export_to_otlp(
    endpoint: str, *, headers: Mapping[str, str] | None = None, tracer_provider: TracerProvider | None = None,
    timeout_s: float = 10.0, compression: str = "gzip", add_langfuse_attributes: bool = True,
) -> SpanProcessor:  # fmt: skip
    """Send every span of the provider tracerl captures on (rollouts, gen_ai spans from any
    instrumentor) to an OTLP/HTTP endpoint, e.g. ``http://localhost:6006/v1/traces`` (Phoenix).

    Returns the processor (``force_flush()`` / ``shutdown()``); calling again with the same
    endpoint returns the same one.  Call it after ``configure_tracing(provider)`` if you move
    capture.  Raises :class:`~tracerl.ConfigError` for a bad URL or compression.
    """
    url = _check_url(endpoint, "OTLP endpoint")
    if compression not in ("gzip", "deflate", "none"):
        raise ConfigError(f"compression must be 'gzip', 'deflate' or 'none', not {compression!r}")
    return _attach(url, headers, tracer_provider, timeout_s, compression, add_langfuse_attributes)


def export_to_langfuse(
    host: str | None = None, public_key: str | None = None, secret_key: str | None = None, *,
    tracer_provider: TracerProvider | None = None, timeout_s: float = 10.0, check: bool = False,
) -> SpanProcessor:  # fmt: skip
    """Send spans (OTLP/HTTP protobuf, gzip) and scores to Langfuse.

    Arguments left out come from ``LANGFUSE_BASE_URL`` / ``LANGFUSE_HOST`` (default Langfuse
    Cloud), ``LANGFUSE_PUBLIC_KEY`` and ``LANGFUSE_SECRET_KEY``; missing or swapped keys raise
    :class:`~tracerl.ConfigError`.  ``check=True`` also asks Langfuse whether it accepts the
    keys, so a wrong key fails here instead of as counted export errors later.
    """
    host = host or os.environ.get("LANGFUSE_BASE_URL") or os.environ.get("LANGFUSE_HOST") or LANGFUSE_DEFAULT_HOST
    host = _check_url(host.rstrip("/"), "Langfuse host")
    public_key = public_key or os.environ.get("LANGFUSE_PUBLIC_KEY")
    secret_key = secret_key or os.environ.get("LANGFUSE_SECRET_KEY")
    if not public_key or not secret_key:
        given = (("LANGFUSE_PUBLIC_KEY", public_key), ("LANGFUSE_SECRET_KEY", secret_key))
        missing = " and ".join(name for name, value in given if not value)
        raise ConfigError(f"export_to_langfuse needs API keys: pass public_key=/secret_key= or set {missing}")
    if public_key.startswith("sk-lf-") or secret_key.startswith("pk-lf-"):
        raise ConfigError("Langfuse keys look swapped: the public key starts with pk-lf-, the secret key with sk-lf-")
    token = base64.b64encode(f"{public_key}:{secret_key}".encode()).decode("ascii")
    headers = {"Authorization": f"Basic {token}", "x-langfuse-public-key": public_key, "x-langfuse-ingestion-version": "4"}
    if check:
        _check_langfuse_keys(host, headers, timeout_s)
    return _attach(host + LANGFUSE_OTEL_PATH, headers, tracer_provider, timeout_s, "gzip", True, score_host=host)


def export_scores(items: T) -> T:
    """Send the scores of a group, a trajectory, or a list of either; returns ``items``.

    Per trajectory: ``reward``, and after RULER ``ruler`` (comment: the judge's explanation)
    and ``independent_reward``.  Scores unchanged since last sent are skipped; usable as
    ``after_each`` in :func:`tracerl.gather_trajectory_groups`.  Never raises.
    """
    try:
        if not _active:
            record_error("export_not_configured", ExportError("export_scores: call export_to_langfuse/_otlp first"))
            return items
        for trajectory in _trajectories(items):
            if not trajectory.trace_id:
                record_error("export_scores_no_trace", ExportError(f"trajectory {trajectory.id} has no trace_id"))
                continue
            for name, value, comment, metadata in _scores_of(trajectory):
                _emit(trajectory.trace_id, name, value, comment, metadata)
    except Exception as error:  # noqa: BLE001 - exporting must never break training
        record_error("export_scores", error)
    return items


# -- internals ----------------------------------------------------------------------------------
def _check_url(url: str, what: str) -> str:
    parts = urlsplit(url or "")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{what} {url!r} is not an http(s) URL (e.g. http://localhost:3000)")
    return url


def _check_langfuse_keys(host: str, headers: Mapping[str, str], timeout_s: float) -> None:
    try:
        response = httpx.get(host + "/api/public/projects", headers=dict(headers), timeout=timeout_s)
    except httpx.HTTPError as error:
        raise ConfigError(f"cannot reach Langfuse at {host}: {error!r}") from error
    if response.status_code in (401, 403):
        raise ConfigError(f"Langfuse at {host} rejected the keys ({response.status_code}): check public_key/secret_key")
    if response.status_code >= 400:
        raise ConfigError(f"Langfuse at {host} answered {response.status_code} to the key check: {response.text[:200]}")


def _attach(endpoint: str, headers: Mapping[str, str] | None, provider: TracerProvider | None, timeout_s: float,
            compression: str, add_langfuse_attributes: bool, score_host: str | None = None) -> ExportProcessor:  # fmt: skip
    try:
        from opentelemetry.exporter.otlp.proto.http import Compression
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as error:
        raise ConfigError("exporting needs opentelemetry-exporter-otlp-proto-http: install tracerl[langfuse]") from error
    provider = provider or get_tracer_provider()
    with _lock:
        processor = _active.get((id(provider), endpoint))
        if processor is None:
            otlp = OTLPSpanExporter(
                endpoint=endpoint, headers=dict(headers or {}), timeout=timeout_s, compression=Compression(compression)
            )
            scores = _ScoreSender(score_host, headers or {}, timeout_s) if score_host else None
            processor = ExportProcessor(provider, _Exporter(otlp, endpoint, add_langfuse_attributes), scores)
            _active[(id(provider), endpoint)] = processor
            provider.add_span_processor(processor)
    _install_hooks()
    return processor


def _install_hooks() -> None:
    global _hooks_installed
    with _lock:
        if _hooks_installed:
            return
        _hooks_installed = True
    from tracerl.ruler.group import on_scores_applied

    from .rollout import _end_hooks

    _end_hooks.append(_on_rollout_end)
    on_scores_applied.append(_on_scores_applied)


def _on_scores_applied(group: TrajectoryGroup) -> None:
    if _active:
        export_scores(group)


def _on_rollout_end(scope: Any) -> None:
    """Before the root span ends: remember its id, put the reward on it, send it to Langfuse."""
    if not _active:
        return
    context = scope._span.get_span_context()
    _remember(_roots, context.trace_id, context.span_id)
    reward = float(scope.reward)
    scope._span.add_event(EVALUATION_EVENT, {EVALUATION_NAME: "reward", EVALUATION_SCORE: reward})
    _emit(f"{context.trace_id:032x}", "reward", reward, evaluation_span=False)  # the event above is in the trace


def _trajectories(items: Any) -> Iterable[Trajectory]:
    if isinstance(items, Trajectory):
        yield items
    elif isinstance(items, TrajectoryGroup):
        yield from items.trajectories
    elif isinstance(items, (list, tuple)):
        for item in items:
            yield from _trajectories(item)


def _scores_of(t: Trajectory) -> list[tuple[str, float, str | None, dict[str, Any] | None]]:
    out: list[tuple[str, float, str | None, dict[str, Any] | None]] = [("reward", float(t.reward), None, None)]
    ruler = t.metadata.get("ruler")
    if isinstance(ruler, dict) and isinstance(ruler.get("score"), (int, float)):
        metadata = {k: ruler[k] for k in ("judge", "rubric_version", "scores_by_order") if k in ruler}
        out.append(("ruler", float(ruler["score"]), str(ruler.get("explanation") or "") or None, metadata))
        independent = t.metrics.get("independent_reward")
        if isinstance(independent, (int, float)):
            out.append(("independent_reward", float(independent), None, None))
    return out


def _emit(trace_hex: str, name: str, value: float, comment: str | None = None, metadata: dict[str, Any] | None = None,
          *, evaluation_span: bool = True) -> None:  # fmt: skip
    """One score, unless it is what was last sent for (trace, name): evaluation span(s) + Langfuse scores."""
    with _lock:
        if _last_sent.get((trace_hex, name)) == (value, comment):
            return
    _remember(_last_sent, (trace_hex, name), (value, comment))
    if evaluation_span:
        _evaluation_spans(int(trace_hex, 16), name, value, comment)
    body: dict[str, Any] = {"id": f"{trace_hex}-{name}", "traceId": trace_hex, "name": name, "value": value}
    body.update({"dataType": "NUMERIC", **{k: v for k, v in (("comment", comment), ("metadata", metadata)) if v}})
    for processor in list(_active.values()):
        if processor.scores is not None:
            processor.scores.submit(body)


def _evaluation_spans(trace_id: int, name: str, value: float, comment: str | None) -> None:
    """A short ``evaluation {name}`` span under the rollout's root (which has ended by now).

    A rollout from another process has no known root id: the span then hangs off the trace.
    """
    parent_id = _roots.get(trace_id) or random.getrandbits(64)
    sampled = trace.TraceFlags(trace.TraceFlags.SAMPLED)
    context = trace.set_span_in_context(trace.NonRecordingSpan(trace.SpanContext(trace_id, parent_id, True, sampled)))
    attributes: dict[str, Any] = {EVALUATION_NAME: name, EVALUATION_SCORE: value}
    if comment:
        attributes[EVALUATION_EXPLANATION] = comment
    for provider in {id(p.provider): p.provider for p in list(_active.values())}.values():
        span = provider.get_tracer(sc.SCOPE).start_span(f"evaluation {name}", context, attributes=attributes)
        span.add_event(EVALUATION_EVENT, attributes)
        span.end()


def _remember(store: OrderedDict[Any, Any], key: Any, value: Any) -> None:
    with _lock:
        store[key] = value
        store.move_to_end(key)
        while len(store) > _REMEMBERED:
            store.popitem(last=False)
