"""Scores: rewards and RULER verdicts per trace, group scores per session, to every destination.

For any OTLP backend a score is a ``gen_ai.evaluation.result`` event (on the rollout's root,
or on a short ``evaluation {name}`` span under it, see ``evaluations.py``); for Langfuse it
is also JSON to ``/api/public/scores`` (Langfuse's ``CreateScoreRequest``: ``traceId`` with
the ``observationId`` the score belongs to — the rollout's root for ``reward``, the
``evaluation {name}`` observation for a judge's verdict, the step's span for a step metric —
or ``sessionId`` alone for group scores; ``environment`` = the destination's), sent from
one background thread.
Score ids are ``{trace_id}-{name}`` / ``{session}-{name}`` and Langfuse upserts on id.
Rewards are sent when a rollout ends, RULER scores when ``apply_scores`` runs, group
scores when a group is scored or logged (hooks below); :func:`export_scores` sends later
changes.  Failures never reach the agent or the trainer: logged once per kind and counted.
"""

from __future__ import annotations

import contextlib
import queue
import statistics
import threading
import time
from collections import OrderedDict
from typing import Any, Iterable, Mapping, TypeVar

import httpx

from tracerl.types import Trajectory, TrajectoryGroup

from ..health import record_error
from . import otlp, traces
from .langfuse import EVALUATION_EVENT, EVALUATION_NAME, EVALUATION_SCORE, SCORES_PATH

_REMEMBERED = 10_000  # last sent scores kept, per process
T = TypeVar("T")


class ScoreSender:
    """POSTs Langfuse scores from one daemon thread, so a slow or absent Langfuse never blocks training."""

    def __init__(self, host: str, headers: Mapping[str, str], timeout_s: float, max_queue: int = 10_000) -> None:
        self.url = host + SCORES_PATH
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
            record_error("langfuse_scores_dropped", otlp.ExportError(f"score queue full; dropped score {body['name']}"))

    def _run(self) -> None:
        from opentelemetry import context

        from tracerl.net.untraced import suppressed_context

        context.attach(suppressed_context())  # this thread's requests are tracerl's own: never spans
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
        record_error(kind, otlp.ExportError(f"Langfuse at {self.url} {error}"))

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


_lock = threading.Lock()
_last_sent: OrderedDict[tuple[str, str], tuple[float, str | None]] = OrderedDict()


def export_scores(items: T) -> T:
    """Send the scores of a group, a trajectory, or a list of either; returns ``items``.

    Per trajectory: ``reward``, and after RULER ``ruler`` (comment: the judge's explanation)
    and ``independent_reward``; per group whose attempts share a session: ``group_reward``
    and ``group_reward_std_dev``.  Scores unchanged since last sent are skipped; usable as
    ``after_each`` in :func:`tracerl.gather_trajectory_groups`.  Never raises.
    """
    try:
        if not otlp.active():
            record_error("export_not_configured", otlp.ExportError("export_scores: call export_to_langfuse/_otlp first"))
            return items
        for trajectory in _trajectories(items):
            if not trajectory.trace_id:
                record_error("export_scores_no_trace", otlp.ExportError(f"trajectory {trajectory.id} has no trace_id"))
                continue
            for name, value, comment, metadata in _scores_of(trajectory):
                emit(trajectory.trace_id, name, value, comment, metadata, on_root=name == "reward")
        for group in _groups(items):
            send_group_scores(group)
    except Exception as error:  # noqa: BLE001 - exporting must never break training
        record_error("export_scores", error)
    return items


def emit(trace_hex: str, name: str, value: float, comment: str | None = None, metadata: dict[str, Any] | None = None,
         *, evaluation_span: bool = True, on_root: bool = False) -> None:  # fmt: skip
    """One trace score, unless it is what was last sent for (trace, name): evaluation span + Langfuse score.

    The Langfuse score names the observation it belongs to: the rollout's root when
    ``on_root`` and the root is known (a rollout of this process), else the evaluation span.
    """
    if not _changed((trace_hex, name), value, comment):
        return
    trace_id = int(trace_hex, 16)
    info = traces.lookup(trace_id)
    observation = info.root_span_id if info is not None and (on_root or not evaluation_span) else None
    if evaluation_span:
        from .evaluations import evaluation_span as make_span

        made = make_span(trace_id, name, value, comment, (metadata or {}).get("judge_trace_id"))
        observation = observation or made
    body: dict[str, Any] = {"id": f"{trace_hex}-{name}", "traceId": trace_hex, "name": name, "value": value}
    if observation:
        body["observationId"] = f"{observation:016x}"
    submit(body, comment, metadata)


def send_group_scores(group: TrajectoryGroup) -> None:
    """Session scores for a group whose attempts share one session (group id): mean and spread of rewards."""
    infos = [traces.for_trajectory(t) for t in group.trajectories]
    sessions = {info.session_id if info is not None else None for info in infos}
    session = next(iter(sessions)) if len(sessions) == 1 else None
    if not session or not group.trajectories:
        return
    rewards = [float(t.reward) for t in group.trajectories]
    for name, value in (("group_reward", statistics.fmean(rewards)), ("group_reward_std_dev", statistics.pstdev(rewards))):
        if _changed((f"session:{session}", name), value, None):
            submit({"id": f"{session}-{name}", "sessionId": session, "name": name, "value": value}, None, None)


def submit(body: dict[str, Any], comment: str | None, metadata: dict[str, Any] | None) -> None:
    """To every Langfuse destination, each with its own environment."""
    body = {**body, "dataType": "NUMERIC", **{k: v for k, v in (("comment", comment), ("metadata", metadata)) if v}}
    for processor in otlp.active():
        if processor.scores is not None:
            processor.scores.submit({**body, "environment": processor.where.environment or "default"})


def on_rollout_start(scope: Any) -> None:
    if otlp.active():
        traces.register(scope.root_span.get_span_context().trace_id, traces.from_rollout(scope))


def on_rollout_end(scope: Any) -> None:
    """Before the root span ends: the trace's output, the reward on the root and to Langfuse."""
    if not otlp.active():
        return
    context = scope.root_span.get_span_context()
    info = traces.lookup(context.trace_id)
    if info is not None:
        buffer = scope.buffer
        info.output = traces.final_answer(scope, buffer.calls if buffer else (), buffer.spans if buffer else ())
    reward = float(scope.reward)
    scope.root_span.add_event(EVALUATION_EVENT, {EVALUATION_NAME: "reward", EVALUATION_SCORE: reward})
    emit(f"{context.trace_id:032x}", "reward", reward, evaluation_span=False)  # the event above is in the trace


def on_scores_applied(group: TrajectoryGroup) -> None:
    if otlp.active():
        export_scores(group)


def _changed(key: tuple[str, str], value: float, comment: str | None) -> bool:
    with _lock:
        if _last_sent.get(key) == (value, comment):
            return False
        _last_sent[key] = (value, comment)
        _last_sent.move_to_end(key)
        while len(_last_sent) > _REMEMBERED:
            _last_sent.popitem(last=False)
    return True


def _trajectories(items: Any) -> Iterable[Trajectory]:
    if isinstance(items, Trajectory):
        yield items
    elif isinstance(items, TrajectoryGroup):
        yield from items.trajectories
    elif isinstance(items, (list, tuple)):
        for item in items:
            yield from _trajectories(item)


def _groups(items: Any) -> Iterable[TrajectoryGroup]:
    if isinstance(items, TrajectoryGroup):
        yield items
    elif isinstance(items, (list, tuple)):
        for item in items:
            yield from _groups(item)


def _scores_of(t: Trajectory) -> list[tuple[str, float, str | None, dict[str, Any] | None]]:
    out: list[tuple[str, float, str | None, dict[str, Any] | None]] = [("reward", float(t.reward), None, None)]
    ruler = t.metadata.get("ruler")
    if isinstance(ruler, dict) and isinstance(ruler.get("score"), (int, float)):
        keys = ("judge", "rubric_version", "scores_by_order", "judge_trace_id")
        metadata = {k: ruler[k] for k in keys if ruler.get(k) is not None}
        out.append(("ruler", float(ruler["score"]), str(ruler.get("explanation") or "") or None, metadata))
        independent = t.metrics.get("independent_reward")
        if isinstance(independent, (int, float)):
            out.append(("independent_reward", float(independent), None, None))
    return out
