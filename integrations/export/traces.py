"""What tracerl knows about each trace it starts, for exporters to put on every span of it.

Langfuse's ingestion (v4) reads the trace-level fields (name, session, user, tags, version,
metadata) from each span it receives, and a trace's spans leave in batches while the
rollout still runs; so the fields are registered when the rollout (or the RULER judge,
or a training step) starts, keyed by trace id, and the exporter adds them to every span
of that trace on its way out.  The trace's output (the final answer) is added when the
rollout ends.  Bounded: the oldest traces are forgotten first.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable

from tracerl.types import Trajectory

from .. import semconv as sc
from ..convert import attribute_value

_REMEMBERED = 10_000
AttributeValue = str | bool | int | float


@dataclass
class TraceInfo:
    """The trace-level fields of one trace (what Langfuse shows on the trace and filters by)."""

    name: str
    session_id: str | None = None
    user_id: str | None = None
    tags: list[str] = field(default_factory=list)
    version: str | None = None
    """The checkpoint that produced the trace (``name@step``) or the model's name."""
    metadata: dict[str, AttributeValue] = field(default_factory=dict)
    input: str | None = None
    output: str | None = None
    root_span_id: int | None = None


_lock = threading.Lock()
_traces: OrderedDict[int, TraceInfo] = OrderedDict()


def register(trace_id: int, info: TraceInfo) -> TraceInfo:
    with _lock:
        _traces[trace_id] = info
        _traces.move_to_end(trace_id)
        while len(_traces) > _REMEMBERED:
            _traces.popitem(last=False)
    return info


def lookup(trace_id: int) -> TraceInfo | None:
    return _traces.get(trace_id)


def for_trajectory(trajectory: Trajectory) -> TraceInfo | None:
    """The registered fields of a trajectory's trace, else what its metadata tells (another process)."""
    if not trajectory.trace_id:
        return None
    known = lookup(int(trajectory.trace_id, 16))
    if known is not None:
        return known
    meta = trajectory.metadata
    group = meta.get("group")
    return TraceInfo(
        name="rollout",
        session_id=_short(group) if group is not None else None,
        metadata=flat_metadata({k: meta[k] for k in ("rollout_id", "task", "group") if k in meta}),
    )


def from_rollout(scope: Any) -> TraceInfo:
    """The fields of a rollout's trace: name, session = group, tags = split + model + given tags."""
    from ..rollout import served_name_of

    model = scope.model
    version = served_name_of(model)
    base_name = getattr(model, "name", None) if model is not None and not isinstance(model, str) else model
    split = scope.split if scope.split is not None else scope.metadata.get("split")
    tags = _unique([*([str(split)] if split else []), *([str(base_name)] if base_name else []), *scope.tags])
    metadata: dict[str, Any] = {"rollout_id": scope.id}
    if scope.task is not None:
        metadata["task"] = scope.task
    if scope.group is not None:
        metadata["group"] = scope.group
    if version:
        metadata["model"] = version
    metadata.update(scope.metadata)
    user = scope.user_id if scope.user_id is not None else scope.metadata.get("user_id")
    return TraceInfo(
        name=scope.name, session_id=_short(scope.group) if scope.group is not None else None,
        user_id=str(user) if user is not None else None, tags=tags, version=version,
        metadata=flat_metadata(metadata), input=text(scope.task) if scope.task is not None else None,
        root_span_id=scope.root_span.get_span_context().span_id,
    )  # fmt: skip


def final_answer(scope: Any, calls: Iterable[Any], spans: Iterable[Any]) -> str | None:
    """``rollout.output`` when set, else the text of the last assistant message the rollout produced:
    the last of the hooks' records (``calls``), else of model-call spans other instrumentors wrote."""
    if scope.output is not None:
        return text(scope.output)
    answered = [ended for ended in calls if ended.call is not None]
    if answered:
        content = max(answered, key=lambda ended: ended.end_ns or 0).call.output.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return content or None
    last: tuple[int, str] | None = None
    for span in spans:
        attributes = span.attributes or {}
        if attributes.get(sc.OPERATION_NAME) in sc.LLM_OPERATIONS and sc.OUTPUT_MESSAGES in attributes:
            if last is None or (span.end_time or 0) >= last[0]:
                last = (span.end_time or 0, attributes[sc.OUTPUT_MESSAGES])
    if last is None:
        return None
    try:
        parts = attribute_value(last[1], [])[0].get("parts") or []
    except (ValueError, IndexError, AttributeError, TypeError):
        return None
    texts = [str(p.get("content")) for p in parts if isinstance(p, dict) and p.get("type") == "text"]
    return "".join(texts) or None


def flat_metadata(values: dict[str, Any], limit: int = 2_000) -> dict[str, AttributeValue]:
    """Metadata as span attribute values (on every span: kept short): numbers as they are, else text."""
    out: dict[str, AttributeValue] = {}
    for key, value in values.items():
        if value is not None:
            out[str(key)] = value if isinstance(value, (bool, int, float)) else _short(value, limit)
    return out


def text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)


def _short(value: Any, limit: int = 200) -> str:
    return (value if isinstance(value, str) else text(value))[:limit]


def _unique(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(v for v in values if v))


def forget() -> None:
    """Drop everything registered (tests)."""
    with _lock:
        _traces.clear()
