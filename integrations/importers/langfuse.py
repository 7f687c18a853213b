"""Langfuse traces -> trajectories: the traces users already collect become training data.

Each trace's observations are read through Langfuse's public API (:mod:`.langfuse_api`)
and made into spans the converter reads: a ``GENERATION`` becomes a model call (its
``input`` / ``output`` in whichever shape the recording integration used,
:mod:`.chat_format`; ``model``; ``usageDetails``), a ``TOOL`` a tool run (result, and the
call id LangChain's handler keeps in the metadata).  Other observations (chains, spans,
events) carry no turn and are skipped.  The trace gives the session, the task (its
input), its name and tags.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from typing import Any, Iterable

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan

from tracerl.types import Trajectory

from .. import semconv as sc
from ..messages import to_semconv
from ..spans import tool_definitions
from .chat_format import input_messages, output_message, parse_json
from .langfuse_api import LangfuseReader, parse_since
from .records import ImportSummary, TraceInfo, trajectories_from_spans

LAYER = "langfuse"
"""``tracerl.layer`` of the spans made from Langfuse observations."""
IMPORT_ID = "tracerl.import.id"
"""The observation's own id, kept on its span (provenance)."""


def import_langfuse(
    host: str | None = None,
    *,
    public_key: str | None = None,
    secret_key: str | None = None,
    session: str | None = None,
    tags: Iterable[str] = (),
    name: str | None = None,
    user: str | None = None,
    since: str | dt.datetime | None = None,
    trace_ids: Iterable[str] = (),
    limit: int | None = None,
    summary: ImportSummary | None = None,
    **reader_options: Any,
) -> list[Trajectory]:
    """Trajectories from the Langfuse traces that match (or the given ``trace_ids``).

    ``since``: an ISO 8601 time or an age such as ``"24h"``.  ``reader_options`` go to
    :class:`~.langfuse_api.LangfuseReader` (``timeout_s``, ``max_retries``, ``page_size``).
    Raises :class:`~.errors.TraceSourceError` when Langfuse cannot be read.
    """
    summary = summary if summary is not None else ImportSummary()
    with LangfuseReader(host, public_key, secret_key, **reader_options) as reader:
        ids = list(trace_ids)
        if ids:
            found: Iterable[dict[str, Any]] = (reader.trace(trace_id) for trace_id in ids)
        else:
            found = reader.traces(
                session_id=session, name=name, tags=tuple(tags), user_id=user, since=parse_since(since), limit=limit
            )
        spans: list[ReadableSpan] = []
        infos: dict[str, TraceInfo] = {}
        for trace_object in found:
            trace_id = str(trace_object["id"])
            number = otel_id(trace_id, 128)
            infos[f"{number:032x}"] = trace_info(trace_object)
            spans.extend(observation_spans(reader.observations(trace_id), number))
        trajectories = trajectories_from_spans(spans, {"source": "langfuse", "host": reader.host}, traces=infos, summary=summary)
    for trajectory in trajectories:
        provenance = trajectory.metadata["import"]
        provenance["observation_ids"] = provenance.pop("span_ids")
    return trajectories


def trace_info(trace_object: dict[str, Any]) -> TraceInfo:
    """Session, task (the trace's input), name and tags of a Langfuse trace object."""
    task = parse_json(trace_object.get("input"))
    return TraceInfo(
        session=trace_object.get("sessionId"),
        task=task if task not in ("", None, {}, []) else None,
        name=trace_object.get("name"),
        tags=[str(t) for t in trace_object.get("tags") or []],
        source_id=str(trace_object["id"]),
        extra={"user": trace_object["userId"]} if trace_object.get("userId") else {},
    )


def observation_spans(observations: Iterable[dict[str, Any]], trace_number: int) -> list[ReadableSpan]:
    """The observations that describe turns, as spans (model calls and tool runs)."""
    spans = []
    for observation in observations:
        kind = str(observation.get("type") or "").upper()
        if kind == "GENERATION":
            attributes = _generation_attributes(observation)
        elif kind == "TOOL":
            attributes = _tool_attributes(observation)
        else:
            continue
        if attributes is None:
            continue
        attributes[IMPORT_ID] = str(observation["id"])
        spans.append(_span(observation, trace_number, attributes))
    return spans


def _generation_attributes(observation: dict[str, Any]) -> dict[str, Any] | None:
    messages, tools = input_messages(observation.get("input"))
    output, finish = output_message(observation.get("output"))
    if output is None:
        return None
    metadata = _metadata(observation)
    if not tools and isinstance(metadata.get("tools"), list):
        tools = [t for t in metadata["tools"] if isinstance(t, dict)]
    semconv_output = to_semconv(output)
    semconv_output["finish_reason"] = finish
    attributes: dict[str, Any] = {
        sc.OPERATION_NAME: sc.OP_CHAT,
        sc.LAYER: LAYER,
        sc.INPUT_MESSAGES: json.dumps([to_semconv(m) for m in messages], ensure_ascii=False),
        sc.OUTPUT_MESSAGES: json.dumps([semconv_output], ensure_ascii=False),
    }
    if tools:
        attributes[sc.TOOL_DEFINITIONS] = json.dumps(tool_definitions(tools), ensure_ascii=False)
    if observation.get("model"):
        attributes[sc.REQUEST_MODEL] = str(observation["model"])
    usage = observation.get("usageDetails") or observation.get("usage") or {}
    for key, name in ((sc.USAGE_INPUT_TOKENS, "input"), (sc.USAGE_OUTPUT_TOKENS, "output")):
        if isinstance(usage.get(name), int):
            attributes[key] = usage[name]
    response_id = metadata.get("response_id") or metadata.get("gen_ai.response.id")
    if isinstance(response_id, str):
        attributes[sc.RESPONSE_ID] = response_id
    return attributes


def _tool_attributes(observation: dict[str, Any]) -> dict[str, Any] | None:
    output = parse_json(observation.get("output"))
    call_id = _metadata(observation).get("tool_call_id")
    if isinstance(output, dict) and "content" in output:  # a LangChain ToolMessage, serialised
        call_id = call_id or output.get("tool_call_id")
        error = output.get("status") == "error"
        output = output["content"]
    else:
        error = str(observation.get("level") or "").upper() == "ERROR"
    arguments = observation.get("input")
    attributes: dict[str, Any] = {
        sc.OPERATION_NAME: sc.OP_EXECUTE_TOOL,
        sc.LAYER: LAYER,
        sc.TOOL_NAME: str(observation.get("name") or "tool"),
        sc.TOOL_CALL_ARGUMENTS: arguments if isinstance(arguments, str) else json.dumps(arguments, default=str),
        sc.TOOL_CALL_RESULT: output if isinstance(output, str) else json.dumps(output, default=str),
    }
    if call_id:
        attributes[sc.TOOL_CALL_ID] = str(call_id)
    if error:
        attributes[sc.ERROR_TYPE] = "ToolError"
    return attributes


def _metadata(observation: dict[str, Any]) -> dict[str, Any]:
    metadata = parse_json(observation.get("metadata"))
    if not isinstance(metadata, dict):
        return {}
    return {k: parse_json(v) for k, v in metadata.items()}


def _span(observation: dict[str, Any], trace_number: int, attributes: dict[str, Any]) -> ReadableSpan:
    context = trace.SpanContext(trace_number, otel_id(str(observation["id"]), 64), is_remote=True)
    parent_id = observation.get("parentObservationId")
    parent = trace.SpanContext(trace_number, otel_id(str(parent_id), 64), is_remote=True) if parent_id else None
    start = _nanoseconds(observation.get("startTime"))
    end = _nanoseconds(observation.get("endTime")) or start
    return ReadableSpan(
        name=str(observation.get("name") or observation.get("type")),
        context=context, parent=parent, attributes=attributes, start_time=start, end_time=end,
    )  # fmt: skip


def otel_id(value: str, bits: int) -> int:
    """A Langfuse id as an OpenTelemetry id: the id itself when it is one (hex of the right
    length, as OpenTelemetry-ingested ids are), else a stable hash of it (SDK v2 UUIDs)."""
    text = value.replace("-", "") if bits == 128 else value
    if len(text) == bits // 4:
        try:
            number = int(text, 16)
            if number:
                return number
        except ValueError:
            pass
    return int.from_bytes(hashlib.sha256(value.encode()).digest()[: bits // 8], "big") or 1


def _nanoseconds(value: Any) -> int:
    if not isinstance(value, str) or not value:
        return 0
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError:
        return 0
    when = when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)
    return (when - dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)) // dt.timedelta(microseconds=1) * 1000
