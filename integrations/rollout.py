"""The rollout scope: one OpenTelemetry trace per attempt at a task.

``async with rollout(model, task=...) as r:`` opens a root span and makes it (and the
rollout) current through context variables, so everything the agent does inside —
``asyncio.gather``, tasks it creates, ``asyncio.to_thread`` / ``run_in_executor`` with a
copied context (LangChain and LangGraph do this for sync code) — lands in this rollout
and no other.  On exit ``r.trajectory`` is the :class:`~tracerl.Trajectory` built from
the trace's spans.

An infrastructure failure noticed by the hooks during the rollout (the MCP server died,
the inference server dropped the connection or answered 5xx, a call timed out) makes
the exit raise a typed :class:`~tracerl.errors.InfrastructureError` (chained from the
original error), even when the agent swallowed it and carried on, so the attempt lands
in ``group.exceptions`` and is never trained on (see :mod:`.faults`; a retry that
succeeded forgives it).  ``raise_infrastructure_errors=False`` keeps the trajectory
instead, with the failures in ``metadata["infrastructure_errors"]``.

Capture needs no call before the first rollout: entering one turns on the hooks of the
installed libraries (:mod:`.auto`; ``auto_instrument=False`` or ``TRACERL_AUTO_INSTRUMENT=0``
opts out), and a rollout whose code sent model requests that capture did not see warns
with the likely cause (:mod:`.missed`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import uuid
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable

from opentelemetry import context as otel_context
from opentelemetry import trace

from tracerl.errors import InfrastructureError
from tracerl.gather import bounded
from tracerl.types import Trajectory, TrajectoryGroup, current_group_id
from tracerl.validation import finite_reward

from . import auto, semconv, wire
from .current import current as _current
from .current import current_rollout
from .health import guard
from .input_delta import InputHistory
from .outbound import redact_trajectory
from .processor import RolloutBuffer, emit_spans, get_processor, get_tracer

if TYPE_CHECKING:  # pragma: no cover
    from .faults import FaultLog

start_hooks: list[Callable[["Rollout"], None]] = []
"""Called, each guarded, with a rollout just after its root span started (exporters register here)."""
end_hooks: list[Callable[["Rollout"], None]] = []
"""Called, each guarded, with a rollout just before its root span ends (exporters register here)."""


class Rollout:
    """One attempt at a task; usable as ``async with``, ``with``, or a decorator.

    ``name`` names the trace (default: the decorated function, else the model's name, else
    ``"rollout"``); ``group`` defaults to the group being gathered (one id per group, see
    :func:`tracerl.types.current_group_id`); ``split``, ``tags`` and ``user_id`` are shown
    by observability backends (Langfuse: tags, user) and kept in the trajectory's metadata.
    """

    def __init__(
        self,
        model: Any = None,
        *,
        task: Any = None,
        group: Any = None,
        metadata: dict[str, Any] | None = None,
        name: str | None = None,
        split: str | None = None,
        tags: Iterable[str] = (),
        user_id: str | None = None,
        raise_infrastructure_errors: bool = True,
        auto_instrument: bool = True,
    ) -> None:
        self.model = model
        self.auto_instrument = auto_instrument
        """Turn on the installed libraries' capture hooks when entered (see :mod:`.auto`)."""
        self.raise_infrastructure_errors = raise_infrastructure_errors
        """Raise a typed error at exit when an infrastructure failure was noticed (see the module doc)."""
        self.task = task
        self._given_group, self._given_name = group, name  # a decorator re-creates one per call
        self.group = group if group is not None else current_group_id()
        self.name = name or _default_name(model)
        self.split = split
        self.tags = [str(t) for t in tags]
        self.user_id = user_id
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.metrics: dict[str, float | int | bool] = {}
        self._reward = 0.0
        self.output: Any = None
        self.trajectory: Trajectory | None = None
        self.id = uuid.uuid4().hex[:12]
        self._span: Any = None
        self._gateway: tuple[str, str] | None = None
        """(token, base URL) of this rollout's gateway, once opened (:attr:`gateway_url`)."""
        self._buffer: RolloutBuffer | None = None
        self._tokens: list[Any] = []
        self._trace_id: int | None = None
        self.inputs: InputHistory | None = None
        """The recent model-call inputs, so each call's record keeps only its new messages (``input_delta.py``)."""
        self.faults: FaultLog | None = None
        """Infrastructure failures the hooks noticed (and no retry made good); None while there are none."""
        self.seen_requests = wire.SeenRequests()
        """Model requests this rollout's code sent on the wire, captured or not (see :mod:`.wire`)."""
        self.outside_mark = 0
        """Where the list of model requests sent outside every rollout stood when this one started."""

    @property
    def root_span(self) -> Any:
        """The rollout's own span (its trace's root), None before it starts."""
        return self._span

    @property
    def buffer(self) -> RolloutBuffer | None:
        """What capture collected so far: the hooks' records of model calls, the finished spans."""
        return self._buffer

    @property
    def gateway_url(self) -> str:
        """This rollout's own base URL on the model's tracerl endpoint (``.../rollouts/{token}/v1``).

        Give it to an agent in another process or language as its OpenAI base URL (Anthropic's
        SDK: without ``/v1``), with the endpoint's API key: every call made with it joins this
        rollout's trajectory, with token ids.  Opened on first use; closed when the rollout ends
        (later calls with it get a 404).  See :meth:`gateway_env`.
        """
        return self._opened_gateway()[1]

    @property
    def gateway_headers(self) -> dict[str, str]:
        """The header that joins a call on the plain ``/v1`` routes to this rollout (instead of the URL)."""
        from .gateway import ROLLOUT_HEADER

        return {ROLLOUT_HEADER: self._opened_gateway()[0]}

    def _opened_gateway(self) -> tuple[str, str]:
        if self._gateway is None:
            if self._span is None:
                raise RuntimeError("open the rollout (async with / with) before asking for its gateway")
            from .gateway import open_token

            self._gateway = open_token(self.model)
        return self._gateway

    def gateway_env(self) -> dict[str, str]:
        """Environment variables that point an agent's OpenAI and Anthropic SDKs at this rollout's
        gateway: ``subprocess.run(cmd, env={**os.environ, **r.gateway_env()})``."""
        url = self.gateway_url
        key = str(getattr(self.model, "inference_api_key", None) or "")
        return {"OPENAI_BASE_URL": url, "OPENAI_API_KEY": key, "ANTHROPIC_BASE_URL": url.removesuffix("/v1"),
                "ANTHROPIC_API_KEY": key, "TRACERL_ROLLOUT_URL": url}  # fmt: skip

    def _collect_gateway(self) -> None:
        """The gateway's calls become this rollout's records; a failure is an infrastructure failure."""
        if self._gateway is None:
            return
        from . import faults
        from .gateway import GatewayError, close_token, record_calls

        token, url = self._gateway
        try:
            record_calls(close_token(self.model, token), url)
        except Exception as error:  # noqa: BLE001 - lost calls: the rollout must raise, not train on the rest
            faults.note_failure("model", url, error if isinstance(error, GatewayError) else GatewayError(repr(error)))

    @property
    def reward(self) -> float:
        """The reward the trajectory gets; ``r.reward = nan`` raises ``TrajectoryError`` right there,
        in the code that computed it (a bad reward must never become a trajectory to train on)."""
        return self._reward

    @reward.setter
    def reward(self, value: float) -> None:
        self._reward = finite_reward(value, "rollout reward")

    # -- scope ------------------------------------------------------------------------------
    def _enter(self) -> "Rollout":
        if self._span is not None:
            raise RuntimeError("a Rollout object can be entered once; create a new one per attempt")
        with guard("rollout_start"):
            if self.auto_instrument:
                auto.ensure_instrumented()
            if auto.env_allows():
                wire.watch()
            self.outside_mark = wire.mark()
            _note_model_endpoint(self.model)
            attributes = {semconv.ROLLOUT_ID: self.id, semconv.OPERATION_NAME: semconv.OP_INVOKE_AGENT}
            if self.task is not None:
                attributes[semconv.ROLLOUT_TASK] = _short(self.task)
            if self.group is not None:
                attributes[semconv.ROLLOUT_GROUP] = _short(self.group)
            model_name = served_name_of(self.model)
            if model_name:
                attributes[semconv.ROLLOUT_MODEL] = model_name
            # A fresh root: a rollout is one trace, even when started inside another one.
            self._span = get_tracer().start_span(self.name, context=otel_context.Context(), attributes=attributes)
            self._trace_id = self._span.get_span_context().trace_id
            self._buffer = get_processor().begin(self._trace_id)
            if self._buffer is not None:
                self.inputs = InputHistory()
            self._tokens.append(otel_context.attach(trace.set_span_in_context(self._span)))
            for hook in start_hooks:
                with guard("rollout_start_hook"):
                    hook(self)
        self._tokens.append(_current.set(self))
        return self

    def _exit(self, error: BaseException | None) -> None:
        self._collect_gateway()
        _current.reset(self._tokens.pop())
        infrastructure = self._infrastructure_error(error)
        trajectory: Trajectory | None = None
        with guard("rollout_end"):
            if self._tokens:
                otel_context.detach(self._tokens.pop())
            self.inputs = None
            if self._span is not None:
                failed = infrastructure if infrastructure is not None else error
                if failed is not None:
                    self._span.record_exception(failed)
                    self._span.set_status(trace.Status(trace.StatusCode.ERROR, type(failed).__name__))
                for hook in end_hooks:
                    with guard("rollout_end_hook"):
                        hook(self)
                self._span.end()
            buffer = get_processor().end(self._trace_id) if self._trace_id is not None else None
            buffer = buffer or self._buffer
            trajectory = self._convert(buffer)
            if buffer is not None:
                emit_spans(buffer.calls)  # for exporters, when one listens; calls ending later: as they end
        if trajectory is None:
            trajectory = Trajectory(messages_and_choices=[], logs=["tracerl capture failed for this rollout"])
            trajectory.metrics["capture_failed"] = 1
        self._finish(trajectory)
        with guard("rollout_missed_check"):
            from .missed import check

            check(self, trajectory)
        if self.faults:
            trajectory.metadata["infrastructure_errors"] = self.faults.to_json()
            trajectory.metrics["infrastructure_errors"] = len(self.faults.failures)
        if infrastructure is not None:
            raise infrastructure from self.faults.failures[0].error  # type: ignore[union-attr]

    def _infrastructure_error(self, error: BaseException | None) -> InfrastructureError | None:
        """The typed error to raise at exit, or None (no failure, opted out, or already propagating)."""
        if not self.faults or not self.raise_infrastructure_errors:
            return None
        if error is not None and (not isinstance(error, Exception) or isinstance(error, InfrastructureError)):
            return None  # a cancellation, or the typed error itself: let it propagate as it is
        return self.faults.to_error(error)

    def _convert(self, buffer: RolloutBuffer | None) -> Trajectory:
        from .convert import spans_to_trajectory

        if buffer is None:
            return Trajectory(messages_and_choices=[], logs=["rollout was not captured (too many active rollouts)"])
        return spans_to_trajectory(
            buffer.spans,
            dropped_spans=buffer.dropped_spans,
            calls=[ended.call for ended in buffer.calls if ended.call is not None],
            recorded_calls=len(buffer.calls),
        )

    def _finish(self, trajectory: Trajectory) -> None:
        trajectory.reward = self.reward  # finite: checked when it was set
        trajectory.metrics.update(self.metrics)
        trajectory.metadata.update({k: v for k, v in self.metadata.items()})
        if self.task is not None:
            trajectory.metadata.setdefault("task", _jsonable(self.task))
        if self.group is not None:
            trajectory.metadata.setdefault("group", _jsonable(self.group))
        if self.split is not None:
            trajectory.metadata.setdefault("split", self.split)
        trajectory.metadata.setdefault("rollout_id", self.id)
        if self.output is not None:
            with guard("rollout_output"):
                trajectory.metadata.setdefault("output", _jsonable(self.output))
        if self._trace_id is not None:
            trajectory.trace_id = f"{self._trace_id:032x}"
        with guard("rollout_redact"):
            redact_trajectory(trajectory)  # credentials never reach training, files or tracerl serve
        self.trajectory = trajectory

    async def __aenter__(self) -> "Rollout":
        return self._enter()

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self._exit(exc)

    def __enter__(self) -> "Rollout":
        return self._enter()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self._exit(exc)

    # -- decorator ----------------------------------------------------------------------------
    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``@rollout(model, task=...)``: each call runs in a fresh rollout and returns its Trajectory.

        A number returned by ``fn`` becomes the reward; anything else is kept as ``rollout.output``
        (and ``trajectory.metadata["output"]``).
        """
        template = dict(
            model=self.model, task=self.task, group=self._given_group, metadata=self.metadata, split=self.split,
            tags=self.tags, user_id=self.user_id, name=self._given_name or getattr(fn, "__name__", None),
            raise_infrastructure_errors=self.raise_infrastructure_errors, auto_instrument=self.auto_instrument,
        )  # fmt: skip
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def run_async(*args: Any, **kwargs: Any) -> Trajectory:
                async with Rollout(**template) as scope:
                    scope._take_result(await fn(*args, **kwargs))
                return scope.trajectory  # type: ignore[return-value]

            return run_async

        @functools.wraps(fn)
        def run_sync(*args: Any, **kwargs: Any) -> Trajectory:
            with Rollout(**template) as scope:
                scope._take_result(fn(*args, **kwargs))
            return scope.trajectory  # type: ignore[return-value]

        return run_sync

    def _take_result(self, result: Any) -> None:
        if isinstance(result, (int, float)) and not isinstance(result, bool):
            self.reward = float(result)
        else:
            self.output = result


def rollout(
    model: Any = None,
    *,
    task: Any = None,
    group: Any = None,
    metadata: dict[str, Any] | None = None,
    name: str | None = None,
    split: str | None = None,
    tags: Iterable[str] = (),
    user_id: str | None = None,
    raise_infrastructure_errors: bool = True,
    auto_instrument: bool = True,
) -> Rollout:
    """Open a rollout scope (``async with`` / ``with`` / decorator); see :class:`Rollout`.

    ``raise_infrastructure_errors=False``: keep the trajectory of an attempt during which
    the MCP server or the inference server failed (default: raise a typed error at exit).
    ``auto_instrument=False``: do not turn on the installed libraries' capture hooks on entry
    (default: on, idempotent; ``TRACERL_AUTO_INSTRUMENT=0`` turns it off for the process).
    """
    return Rollout(
        model, task=task, group=group, metadata=metadata, name=name, split=split, tags=tags, user_id=user_id,
        raise_infrastructure_errors=raise_infrastructure_errors, auto_instrument=auto_instrument,
    )  # fmt: skip


async def trajectory(
    awaitable: Awaitable[Any],
    model: Any = None,
    *,
    task: Any = None,
    group: Any = None,
    metadata: dict[str, Any] | None = None,
) -> Trajectory:
    """Run ``awaitable`` (e.g. ``agent(question)``) in its own rollout; return the trajectory.

    A number it returns becomes the reward, anything else ``trajectory.metadata["output"]``
    (when JSON-friendly).  Exceptions propagate (``trajectory_group`` records them).
    """
    name = getattr(awaitable, "__name__", None) if inspect.iscoroutine(awaitable) else None
    async with Rollout(model, task=task, group=group, metadata=metadata, name=name) as scope:
        scope._take_result(await awaitable)
    assert scope.trajectory is not None
    return scope.trajectory


async def trajectory_group(
    rollouts: Callable[[], Awaitable[Any]] | Iterable[Awaitable[Any]],
    n: int | None = None,
    *,
    model: Any = None,
    task: Any = None,
    metadata: dict[str, Any] | None = None,
    rollout_timeout: float | None = None,
) -> TrajectoryGroup:
    """Run N attempts at one task concurrently, each in its own rollout, as a group.

    ``rollouts`` is either a zero-argument async function called ``n`` times, or an
    iterable of awaitables.  A failed attempt is kept in ``group.exceptions``.
    ``rollout_timeout``: seconds after which an attempt is cancelled and recorded as a
    :class:`~tracerl.errors.RolloutTimeoutError` (default: the ``rollout_timeout`` of the
    enclosing ``gather_trajectory_groups``, else no limit).
    """
    if callable(rollouts):
        if n is None:
            raise ValueError("trajectory_group(fn, n=...) needs n when given a function")
        awaitables = [rollouts() for _ in range(n)]
    else:
        awaitables = list(rollouts)
    group_id = uuid.uuid4().hex[:8]
    results = await asyncio.gather(
        *(bounded(trajectory(a, model, task=task, group=group_id, metadata=metadata), rollout_timeout) for a in awaitables),
        return_exceptions=True,
    )
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result
    kept = [r for r in results if isinstance(r, Trajectory)]
    errors = [r for r in results if isinstance(r, Exception)]
    return TrajectoryGroup(kept, exceptions=errors, metadata={"task": _jsonable(task)} if task is not None else {})


# -- helpers -------------------------------------------------------------------------------------
def _default_name(model: Any) -> str:
    """The trace name when none is given: the model's (agent's) name, else ``"rollout"``."""
    name = getattr(model, "name", None) if model is not None and not isinstance(model, str) else model
    return str(name) if name else "rollout"


def served_name_of(model: Any) -> str | None:
    if model is None:
        return None
    getter = getattr(model, "get_inference_name", None)
    try:
        return str(getter()) if getter else str(getattr(model, "name", model))
    except Exception:  # noqa: BLE001
        return str(getattr(model, "name", ""))


def _note_model_endpoint(model: Any) -> None:
    """A trainable model's endpoint is ours: hooks ask it for token ids and logprobs."""
    if model is not None and getattr(model, "trainable", False):
        url = getattr(model, "inference_base_url", None)
        if url:
            from .endpoints import register_endpoint

            register_endpoint(url)


def _short(value: Any, limit: int = 500) -> str:
    return (value if isinstance(value, str) else repr(value))[:limit]


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if hasattr(value, "model_dump"):
        try:
            return value.model_dump(mode="json")
        except Exception:  # noqa: BLE001
            pass
    return repr(value)
