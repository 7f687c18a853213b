"""Imported spans -> trajectories (one per trace), groups, and Trajectory JSONL.

Importers turn what they read (OTLP files, Langfuse observations) into OpenTelemetry
SDK ``ReadableSpan`` objects carrying GenAI-semconv / OpenInference attributes, and this
module builds trajectories from them with the same converter live capture uses
(:func:`tracerl.integrations.spans_to_trajectory`): calls seen by two layers are kept
once, conversations are rebuilt the same way.  Across traces too: OpenInference's
LangChain instrumentor does not make its spans current, so the OpenAI SDK's span of each
request lands in a trace of its own; a trace whose every model call (by response id) is
already in another trace is that duplicate, and is dropped (and counted).

Imported assistant turns carry no sampler token ids: ``metadata["retokenized"]`` is
``True`` and ``backend.train`` refuses them unless called with ``allow_retokenize=True``
(DESIGN §5.1).  Provenance is kept in ``metadata["import"]``: the source, the trace id,
the ids of the spans / observations the turns came from.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping

from opentelemetry.sdk.trace import ReadableSpan

from tracerl.errors import ConfigError
from tracerl.types import Trajectory, TrajectoryGroup

from .. import semconv as sc
from ..convert import spans_to_trajectory
from ..layers import is_model_call_attributes
from ..messages import canonical

GroupBy = Literal["session", "task", "trace"]
_SESSION_KEYS = (sc.ROLLOUT_GROUP, sc.OI_SESSION_ID, "langfuse.session.id", sc.CONVERSATION_ID)
_USED_OPERATIONS = (*sc.LLM_OPERATIONS, sc.OP_EXECUTE_TOOL)


@dataclass
class TraceInfo:
    """What a source knows about a trace beyond its spans (Langfuse's trace object, ...)."""

    session: str | None = None
    task: Any = None
    name: str | None = None
    tags: list[str] = field(default_factory=list)
    source_id: str | None = None
    """The trace's id at the source when it is not an OpenTelemetry one (a Langfuse SDK v2 UUID)."""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ImportSummary:
    """Counts of one import, reported by the CLI."""

    traces: int = 0
    trajectories: int = 0
    spans: int = 0
    traces_without_model_calls: int = 0
    duplicate_traces: int = 0
    stitched_traces: int = 0

    def __str__(self) -> str:
        return (
            f"{self.traces} traces, {self.spans} spans; {self.traces_without_model_calls} without model calls, "
            f"{self.duplicate_traces} repeating another trace, {self.stitched_traces} joined to a conversation"
        )


@dataclass
class _Trace:
    trace_ids: list[int]
    spans: list[ReadableSpan]
    trajectory: Trajectory
    single_calls: bool
    """Only root-level model calls (an instrumentor that opens no span around them)."""

    def response_ids(self) -> set[str]:
        return {c.response_id for c in self.trajectory.sampled_turns() if c.response_id}


def trajectories_from_spans(
    spans: Iterable[ReadableSpan],
    source: Mapping[str, Any],
    *,
    traces: Mapping[str, TraceInfo] | None = None,
    summary: ImportSummary | None = None,
) -> list[Trajectory]:
    """One trajectory per trace (or per conversation split over single-call traces) with model
    calls, oldest first."""
    summary = summary if summary is not None else ImportSummary()
    by_trace: OrderedDict[int, list[ReadableSpan]] = OrderedDict()
    for span in spans:
        by_trace.setdefault(span.context.trace_id, []).append(span)
        summary.spans += 1
    summary.traces += len(by_trace)
    built: list[_Trace] = []
    for trace_id, trace_spans in by_trace.items():
        trace_spans.sort(key=lambda s: s.start_time or 0)
        trajectory = spans_to_trajectory(trace_spans)
        if not trajectory.metrics.get("capture_model_calls"):
            summary.traces_without_model_calls += 1
            continue
        built.append(_Trace([trace_id], trace_spans, trajectory, _only_root_calls(trace_spans, trajectory)))
    built.sort(key=lambda t: t.spans[0].start_time or 0)
    kept = _stitched(_without_duplicate_traces(built, summary), summary)
    for item in kept:
        info = (traces or {}).get(f"{item.trace_ids[0]:032x}") or TraceInfo()
        _describe(item, info, traces or {}, source)
    summary.trajectories += len(kept)
    return [item.trajectory for item in kept]


def _only_root_calls(spans: list[ReadableSpan], trajectory: Trajectory) -> bool:
    ids = {s.context.span_id for s in spans}
    roots = [s for s in spans if s.parent is None or s.parent.span_id not in ids]
    return trajectory.metrics.get("capture_model_calls") == 1 and all(is_model_call_attributes(s.attributes) for s in roots)


def _without_duplicate_traces(built: list[_Trace], summary: ImportSummary) -> list[_Trace]:
    """Drop a trace whose model calls (by response id) all appear in another trace."""
    ids = [t.response_ids() for t in built]
    kept = []
    for i, item in enumerate(built):
        if ids[i] and any(j != i and (ids[i] < ids[j] or (ids[i] == ids[j] and j < i)) for j in range(len(built))):
            summary.duplicate_traces += 1
        else:
            kept.append(item)
    return kept


def _stitched(built: list[_Trace], summary: ImportSummary) -> list[_Trace]:
    """Join single-call traces that continue one conversation (OpenInference's OpenAI
    instrumentor alone gives every request a trace of its own).

    A single-call trace joins an earlier one when the earlier conversation, its output
    included, is a proper prefix of this call's input: tool-call ids and outputs make that
    a conversation's own.  Traces with any structure around their calls are never joined.
    """
    out: list[_Trace] = []
    for item in built:
        if item.single_calls:
            keys = [canonical(m) for m in item.trajectory.messages()]
            target = next((c for c in reversed(out) if c.single_calls and _continues(c.trajectory, keys)), None)
            if target is not None:
                target.spans = sorted(target.spans + item.spans, key=lambda s: s.start_time or 0)
                target.trace_ids.append(item.trace_ids[0])
                target.trajectory = spans_to_trajectory(target.spans)
                summary.stitched_traces += 1
                continue
        out.append(item)
    return out


def _continues(earlier: Trajectory, keys: list[tuple[Any, ...]]) -> bool:
    before = [canonical(m) for m in earlier.messages()]
    return 0 < len(before) < len(keys) and keys[: len(before)] == before and any(k[0] == "assistant" for k in before)


def _describe(item: _Trace, info: TraceInfo, infos: Mapping[str, TraceInfo], source: Mapping[str, Any]) -> None:
    trajectory, spans = item.trajectory, item.spans
    hex_ids = [(infos.get(f"{t:032x}") or TraceInfo()).source_id or f"{t:032x}" for t in item.trace_ids]
    trajectory.trace_id = hex_ids[0]
    used = [s for s in spans if (s.attributes or {}).get(sc.OPERATION_NAME) in _USED_OPERATIONS or _is_oi_call(s)]
    trajectory.metadata["import"] = {
        **dict(source),
        "trace_id": hex_ids[0],
        **({"trace_ids": hex_ids} if len(hex_ids) > 1 else {}),
        "span_ids": [_span_hex(s) for s in used],
    }
    trajectory.metadata["retokenized"] = True  # no sampler token ids: train with allow_retokenize=True
    _as_sent(trajectory)
    session = info.session or _first_attribute(spans, _SESSION_KEYS)
    task = info.task if info.task is not None else _first_attribute(spans, (sc.ROLLOUT_TASK,))
    if task is None:
        task = next((m.get("content") for m in trajectory.messages() if m.get("role") == "user"), None)
    for key, value in (("session", session), ("task", task), ("trace_name", info.name)):
        if value is not None:
            trajectory.metadata[key] = value
    if info.tags:
        trajectory.metadata["tags"] = list(info.tags)
    trajectory.metadata.update(info.extra)


def _as_sent(trajectory: Trajectory) -> None:
    """Tool results as an OpenAI request carries them: LangChain-level records (OpenInference's
    LangChain spans) add the tool's ``name`` to each result; the model never saw it."""
    for history in trajectory.histories():
        for item in history.messages_and_choices:
            if isinstance(item, dict) and item.get("role") == "tool" and item.get("tool_call_id"):
                item.pop("name", None)


def _span_hex(span: ReadableSpan) -> str:
    return str((span.attributes or {}).get("tracerl.import.id") or f"{span.context.span_id:016x}")


def _is_oi_call(span: ReadableSpan) -> bool:
    return (span.attributes or {}).get(sc.OI_SPAN_KIND) in ("LLM", "TOOL")


def _first_attribute(spans: list[ReadableSpan], keys: tuple[str, ...]) -> Any:
    for span in sorted(spans, key=lambda s: s.start_time or 0):
        attributes = span.attributes or {}
        for key in keys:
            if attributes.get(key) not in (None, ""):
                return attributes[key]
    return None


# -- groups and files ----------------------------------------------------------------------------
def group_trajectories(trajectories: Iterable[Trajectory], by: GroupBy = "session") -> list[TrajectoryGroup]:
    """Trajectories that share a session (or a task) as one group each, in first-seen order.

    A trajectory without that key is a group of its own.  ``group.metadata`` names the key.
    """
    if by not in ("session", "task", "trace"):
        raise ConfigError(f"group_by must be 'session', 'task' or 'trace', not {by!r}")
    groups: OrderedDict[Any, list[Trajectory]] = OrderedDict()
    for index, trajectory in enumerate(trajectories):
        value = trajectory.metadata.get(by) if by != "trace" else None
        key = (by, _hashable(value)) if value is not None else ("alone", index)
        groups.setdefault(key, []).append(trajectory)
    out = []
    for (kind, value), members in groups.items():
        metadata = {by: members[0].metadata.get(by)} if kind == by else {}
        out.append(TrajectoryGroup(members, metadata=metadata))
    return out


def _hashable(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool)) else json.dumps(value, sort_keys=True, default=str)


def write_jsonl(path: str | os.PathLike[str], items: Iterable[Trajectory] | Iterable[TrajectoryGroup]) -> int:
    """Write trajectories as JSONL, one ``Trajectory.to_json_dict()`` per line; returns the count.

    Given groups, each row also carries ``"group": <index>``, as the run directory's
    ``trajectories/{split}/{step}.jsonl`` rows do (:func:`read_groups` reads them back).
    The file is written to a temporary name and renamed, so a crash leaves no torn file.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    count = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for index, item in enumerate(items):
            rows = [({"group": index} if isinstance(item, TrajectoryGroup) else {}, t)
                    for t in (item.trajectories if isinstance(item, TrajectoryGroup) else [item])]  # fmt: skip
            for extra, trajectory in rows:
                f.write(json.dumps({**extra, **trajectory.to_json_dict()}, default=str, ensure_ascii=False) + "\n")
                count += 1
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return count


def read_jsonl(path: str | os.PathLike[str]) -> list[Trajectory]:
    """Trajectories from a JSONL file written by :func:`write_jsonl` (or a run directory)."""
    with open(path, encoding="utf-8") as f:
        return [Trajectory.from_json_dict(json.loads(line)) for line in f if line.strip()]


def read_groups(path: str | os.PathLike[str]) -> list[TrajectoryGroup]:
    """Groups from a JSONL file whose rows carry ``"group"`` (rows without one: one group each)."""
    groups: OrderedDict[Any, list[Trajectory]] = OrderedDict()
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f):
            if line.strip():
                row = json.loads(line)
                groups.setdefault(row.get("group", f"row-{number}"), []).append(Trajectory.from_json_dict(row))
    return [TrajectoryGroup(members) for members in groups.values()]
