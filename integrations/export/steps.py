"""Each training step on the dashboard: one ``training step`` trace per ``model.log`` call.

``model.log(groups, split=..., step=...)`` (the ART loop calls it after every step) reports
here through ``tracerl.model.on_log``, so users write no extra code: the row it appended to
``history.jsonl`` becomes a trace named ``training step`` (version ``name@step``, tags =
split + model, output = the row) whose every metric is a score (``train/reward``,
``train/loss``…; Langfuse charts scores over time and filters them by trace name, tag and
version), and each logged group whose attempts share a session gets its group scores.
All the steps of one run share a session, ``{project}/{name}`` (Langfuse's session view
lists them in order), and carry the destination's environment and the release of that
step's rollouts (``name@step``, or the configured release), so they filter together.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import context as otel_context

from ..health import guard
from . import otlp, traces
from .langfuse import EVALUATION_EVENT, EVALUATION_NAME, EVALUATION_SCORE
from .scores import send_group_scores, submit

STEP_TRACE_NAME = "training step"


def export_step(model: Any, groups: list[Any], split: str, step: int, row: dict[str, Any]) -> str | None:
    """Send one logged step (the ``model.log`` hook); returns the step trace's id (None: no exporter)."""
    if not otlp.active():
        return None
    from ..processor import get_tracer

    with guard("export_step"):
        for group in groups:
            send_group_scores(group)
        metrics = {k: float(v) for k, v in row.items() if k not in ("step", "time") and _number(v)}
        version = model.get_inference_name(step) if getattr(model, "trainable", False) else getattr(model, "name", None)
        attributes = {"tracerl.step": int(step), "tracerl.split": split}
        span = get_tracer().start_span(f"step {step}", otel_context.Context(), attributes=attributes)
        context = span.get_span_context()
        traces.register(context.trace_id, traces.TraceInfo(
            name=STEP_TRACE_NAME, session_id=run_session(model), tags=[split, str(getattr(model, "name", ""))],
            version=version,
            metadata=traces.flat_metadata({"project": getattr(model, "project", None), "model": getattr(model, "name", None),
                                           "split": split, "step": int(step)}),
            output=traces.text(row), root_span_id=context.span_id,
        ))  # fmt: skip
        for name, value in metrics.items():
            span.add_event(EVALUATION_EVENT, {EVALUATION_NAME: name, EVALUATION_SCORE: value})
        span.end()
        trace_hex = f"{context.trace_id:032x}"
        for name, value in metrics.items():
            body = {"id": f"{trace_hex}-{name}", "traceId": trace_hex, "observationId": f"{context.span_id:016x}"}
            submit({**body, "name": name, "value": value}, None, None)
        return trace_hex
    return None


def run_session(model: Any) -> str | None:
    """The session of a run's step traces: ``{project}/{name}`` (the run directory's two names)."""
    name = getattr(model, "name", None)
    if not name:
        return None
    project = getattr(model, "project", None)
    return f"{project}/{name}" if project else str(name)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) != float("inf")
