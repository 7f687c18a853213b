"""Evaluator observations: a score inside the trace it scores, and the RULER judge call itself.

RULER judges a whole group in one call, so the call is one trace of its own, named
``ruler``, in the group's session (next to the attempts it scored, its tokens and cost
counted once), linked to the root of each trace it scored.  Each scored trace gets an
``evaluation ruler`` observation (score, explanation, a link to the judge's trace).  The
judge's model calls nest under its span when the LiteLLM/OpenAI hooks are on (the model
call then carries the usage); with the hooks off the judge span carries the judge's
tokens and cost itself.
"""

from __future__ import annotations

import contextlib
import random
from typing import Any, Callable, Iterator

from opentelemetry import context as otel_context
from opentelemetry import trace

from tracerl.types import TrajectoryGroup

from .. import layers
from .. import semconv as sc
from . import otlp, traces
from .langfuse import EVALUATION_EXPLANATION, EVALUATION_NAME, EVALUATION_SCORE, EVALUATION_EVENT

JUDGE_TRACE_NAME = "ruler"
JUDGED_TRACES = "tracerl.ruler.trace_ids"


def evaluation_span(trace_id: int, name: str, value: float, comment: str | None, judge_trace_id: str | None) -> int:
    """A short ``evaluation {name}`` span under the rollout's root (which has ended by now);
    returns its span id (the observation the score is attached to).

    A rollout from another process has no known root id: the span then hangs off the trace.
    """
    from ..processor import get_tracer

    info = traces.lookup(trace_id)
    parent_id = (info.root_span_id if info else None) or random.getrandbits(64)
    sampled = trace.TraceFlags(trace.TraceFlags.SAMPLED)
    context = trace.set_span_in_context(trace.NonRecordingSpan(trace.SpanContext(trace_id, parent_id, True, sampled)))
    attributes: dict[str, Any] = {EVALUATION_NAME: name, EVALUATION_SCORE: value}
    if comment:
        attributes[EVALUATION_EXPLANATION] = comment
    links = []
    if judge_trace_id:
        attributes["tracerl.judge.trace_id"] = judge_trace_id
        judge = traces.lookup(int(judge_trace_id, 16))
        if judge is not None and judge.root_span_id:
            links.append(trace.Link(_context_of(int(judge_trace_id, 16), judge.root_span_id)))
    span = get_tracer().start_span(f"evaluation {name}", context, attributes=attributes, links=links)
    span.add_event(EVALUATION_EVENT, attributes)
    span.end()
    return span.get_span_context().span_id


@contextlib.contextmanager
def judge_observation(group: TrajectoryGroup) -> Iterator[Callable[[Any], str | None]]:
    """The RULER judge call as an evaluator trace; yields ``record(scores) -> judge trace id``."""
    from ..processor import get_tracer

    scored = [int(t.trace_id, 16) for t in group.trajectories if t.trace_id]
    infos = [traces.for_trajectory(t) for t in group.trajectories if t.trace_id]
    sessions = {i.session_id for i in infos if i is not None}
    session = next(iter(sessions)) if len(sessions) == 1 else None
    links = [trace.Link(_context_of(tid, i.root_span_id)) for tid, i in zip(scored, infos) if i and i.root_span_id]
    attributes = {EVALUATION_NAME: "ruler", JUDGED_TRACES: [f"{t:032x}" for t in scored]}
    span = get_tracer().start_span(JUDGE_TRACE_NAME, otel_context.Context(), attributes=attributes, links=links)
    context = span.get_span_context()
    task = group.metadata.get("task") if group.metadata.get("task") is not None else group.metadata.get("name")
    traces.register(context.trace_id, traces.TraceInfo(
        name=JUDGE_TRACE_NAME, session_id=session, tags=["ruler"], root_span_id=context.span_id,
        metadata=traces.flat_metadata({"trajectories": len(group.trajectories), "task": task}),
        input=traces.text(task) if task is not None else None,
    ))  # fmt: skip
    trace_hex = f"{context.trace_id:032x}"

    def record(scores: Any) -> str | None:
        _record(span, scores)
        return trace_hex if otlp.active() else None

    try:
        with trace.use_span(span, end_on_exit=False, record_exception=True, set_status_on_exception=True):
            yield record
    finally:
        span.end()


def _record(span: Any, scores: Any) -> None:
    metrics = dict(getattr(scores, "metrics", None) or {})
    judge = next((s.judge for s in scores if getattr(s, "judge", None)), None)
    attributes: dict[str, Any] = {f"tracerl.{k}": float(v) for k, v in metrics.items()}
    if judge:
        attributes["tracerl.ruler.judge"] = judge
    info = traces.lookup(span.get_span_context().trace_id)
    if info is not None:
        info.output = traces.text({str(s.trajectory_id): s.score for s in scores})
    if not layers.has_model_call_child(span.get_span_context().span_id):  # no hook saw the judge's calls
        attributes[sc.USAGE_INPUT_TOKENS] = int(metrics.get("ruler_judge_prompt_tokens", 0))
        attributes[sc.USAGE_OUTPUT_TOKENS] = int(metrics.get("ruler_judge_completion_tokens", 0))
        if "ruler_judge_cost_usd" in metrics:
            attributes["gen_ai.usage.cost"] = float(metrics["ruler_judge_cost_usd"])
        if judge:
            attributes[sc.REQUEST_MODEL] = judge.split("@", 1)[0]
    span.set_attributes(attributes)


def _context_of(trace_id: int, span_id: int) -> trace.SpanContext:
    return trace.SpanContext(trace_id, span_id, True, trace.TraceFlags(trace.TraceFlags.SAMPLED))
