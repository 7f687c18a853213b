"""Infrastructure failures seen by capture: classify a failed call, remember it on the rollout.

Agents swallow exceptions: LangGraph's ``ToolNode`` turns a tool exception into a
message, an agent catches a model error and gives up or retries.  A trajectory that
went on after its MCP server died or its inference server failed says nothing about the
policy, so the hooks classify every failed call (:func:`classify`: a dropped or refused
connection, a timeout, a 5xx/429 answer) and note infrastructure failures on the current
rollout; the rollout raises a typed :class:`~tracerl.errors.InfrastructureError` when it
ends (``tracerl.rollout(..., raise_infrastructure_errors=False)`` keeps the trajectory
instead, with the failures in its metadata).

A failure is *forgiven* when the same call (same endpoint and input, or the same tool
with the same arguments) is retried and succeeds before any other model call starts:
the policy never saw the failure, so the trajectory is what it would have been.  Once a
model call with other input starts, the failure is sealed: the agent carried on past it.

Everything here runs inside the hooks' error and start paths and never raises.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from tracerl.errors import (
    InferenceServerError,
    InferenceTimeoutError,
    InfrastructureError,
    McpServerError,
    McpTimeoutError,
    TracerlError,
)

from .health import guard
from .current import current_rollout

Kind = Literal["model", "mcp", "tool"]
Reason = Literal["connection", "timeout", "server_error"]

MCP_CONNECTION_CLOSED = -32000
MCP_TIMEOUT_CODES = (-32001, 408)
"""``mcp`` 2.x answers a read timeout with -32001 (REQUEST_TIMEOUT), 1.x with HTTP's 408."""

_TIMEOUT_CLASSES = {"httpx.TimeoutException", "requests.Timeout", "aiohttp.ServerTimeoutError"}
_CONNECTION_CLASSES = {"openai.APIConnectionError", "httpx.TransportError", "httpcore.NetworkError", "httpcore.RemoteProtocolError",
                       "anyio.ClosedResourceError", "anyio.BrokenResourceError", "anyio.EndOfStream", "requests.ConnectionError",
                       "aiohttp.ClientConnectionError"}  # fmt: skip


def class_names(error: BaseException) -> set[str]:
    """``library.ClassName`` of every class of ``error`` (no library needs importing).

    The library is the top-level module without a version suffix: ``mcp`` 2.x speaks HTTP
    through ``httpx2`` / ``httpcore2``, whose errors count as ``httpx`` / ``httpcore`` ones.
    """
    return {f"{c.__module__.split('.')[0].rstrip('0123456789')}.{c.__name__}" for c in type(error).__mro__}


def _mcp_code(error: BaseException) -> int | None:
    names = class_names(error)
    if "mcp.MCPError" not in names and "mcp.McpError" not in names:
        return None
    code = getattr(getattr(error, "error", None), "code", None)
    return code if isinstance(code, int) else None


def _classify_one(error: BaseException) -> Reason | None:
    if isinstance(error, InfrastructureError):
        return "timeout" if isinstance(error, TimeoutError) else "connection"
    if isinstance(error, TracerlError):
        return None  # our other errors (ConfigError...) are about inputs, not infrastructure
    code = _mcp_code(error)
    if code is not None:  # an MCP error answer: only a closed connection or a timeout is infrastructure
        return "connection" if code == MCP_CONNECTION_CLOSED else "timeout" if code in MCP_TIMEOUT_CODES else None
    names = class_names(error)
    if "openai.APITimeoutError" in names or names & _TIMEOUT_CLASSES or isinstance(error, TimeoutError):
        return "timeout"
    if "openai.APIStatusError" in names:
        status = getattr(error, "status_code", None)
        return "server_error" if isinstance(status, int) and (status >= 500 or status == 429) else None
    if names & _CONNECTION_CLASSES or isinstance(error, ConnectionError):
        return "connection"
    return None


def _causes(error: BaseException, limit: int = 8) -> list[BaseException]:
    """``error``, the leaves of exception groups, and explicit ``raise ... from`` causes."""
    out: list[BaseException] = []
    todo = [error]
    while todo and len(out) < limit:
        item = todo.pop(0)
        if isinstance(item, BaseExceptionGroup):
            todo.extend(item.exceptions)
            continue
        out.append(item)
        if item.__cause__ is not None:
            todo.append(item.__cause__)
    return out


def classify(error: BaseException) -> Reason | None:
    """Why ``error`` is an infrastructure failure (``"connection"``, ``"timeout"``,
    ``"server_error"``), or ``None`` when it is the caller's or the policy's (a 4xx, a
    tool's own error, a bad argument)."""
    for item in _causes(error):
        reason = _classify_one(item)
        if reason is not None:
            return reason
    return None


def call_key(*parts: Any) -> int:
    """A fingerprint of one call (endpoint + input), to recognise a retry of it."""
    return hash(json.dumps(parts, default=str, sort_keys=True))


@dataclass
class Failure:
    """One infrastructure failure noted during a rollout."""

    kind: Kind
    reason: Reason
    target: str
    """What failed, for the message: an endpoint URL, ``"tools/call 'add'"``..."""
    error: BaseException
    key: int | None = None
    detail: str = ""
    """E.g. ``"after 600 s (knob: Model(inference_timeout=...))"``."""
    sealed: bool = False

    def describe(self) -> str:
        what = {"model": "the model call to", "mcp": "the MCP request", "tool": "the tool call"}[self.kind]
        how = {"connection": "lost its connection", "timeout": "timed out", "server_error": "got a server error"}[self.reason]
        detail = f" {self.detail}" if self.detail else ""
        return f"{what} {self.target} {how}{detail}: {type(self.error).__name__}: {str(self.error).rstrip('.')}"

    def error_class(self) -> type[InfrastructureError]:
        timeout = self.reason == "timeout"
        if self.kind == "model":
            return InferenceTimeoutError if timeout else InferenceServerError
        if self.kind == "mcp":
            return McpTimeoutError if timeout else McpServerError
        return InfrastructureError


@dataclass
class FaultLog:
    """The infrastructure failures of one rollout that no retry has made good."""

    failures: list[Failure] = field(default_factory=list)

    def add(self, failure: Failure) -> None:
        if not any(f.error is failure.error for f in self.failures):  # two hooks may see one error
            self.failures.append(failure)

    def started(self, kind: Kind, key: int | None) -> None:
        """A call starts: a model call with other input seals every failure before it."""
        if kind != "model":
            return
        for f in self.failures:
            if not (f.kind == "model" and f.key == key):
                f.sealed = True

    def succeeded(self, kind: Kind, key: int | None) -> None:
        if key is not None:  # a failure without a key (a LangChain callback's) is never forgiven
            self.failures = [f for f in self.failures if f.sealed or f.kind != kind or f.key != key]

    def __bool__(self) -> bool:
        return bool(self.failures)

    def to_error(self, body_error: BaseException | None) -> InfrastructureError:
        first = self.failures[0]
        more = f" (and {len(self.failures) - 1} more)" if len(self.failures) > 1 else ""
        carried_on = "" if body_error is not None else "; the agent carried on without it"
        return first.error_class()(
            f"{first.describe()}{more}{carried_on}. This attempt is an infrastructure failure, not the "
            "policy's: it is recorded as an exception, never trained on "
            "(tracerl.rollout(..., raise_infrastructure_errors=False) keeps such trajectories)"
        )

    def to_json(self) -> list[dict[str, str]]:
        return [{"kind": f.kind, "reason": f.reason, "target": f.target, "error": f"{type(f.error).__name__}: {f.error}"} for f in self.failures]


# -- called by the hooks -------------------------------------------------------------------------
def note_failure(
    kind: Kind,
    target: str,
    error: BaseException,
    key: Callable[[], int | None] | None = None,
    *,
    timeout: Any = None,
    knob: str | None = None,
) -> None:
    """A call of the current rollout failed: remember it if it is an infrastructure failure.

    ``timeout`` (seconds, or an ``httpx.Timeout``) and ``knob`` name the limit in the
    message when the failure is a timeout.
    """
    scope = current_rollout()
    if scope is None:
        return
    with guard("faults_note_failure"):
        reason = classify(error)
        if reason is None:
            return
        detail = _timeout_detail(timeout, knob) if reason == "timeout" else ""
        if scope.faults is None:
            scope.faults = FaultLog()
        scope.faults.add(Failure(kind, reason, target, error, key() if key is not None else None, detail))


def note_start(kind: Kind, key: Callable[[], int | None]) -> None:
    """A call of the current rollout starts (cheap unless a failure is outstanding)."""
    scope = current_rollout()
    if scope is not None and scope.faults:
        with guard("faults_note_start"):
            scope.faults.started(kind, key())


def note_success(kind: Kind, key: Callable[[], int | None]) -> None:
    """A call of the current rollout succeeded: a retry of a failed call forgives it."""
    scope = current_rollout()
    if scope is not None and scope.faults:
        with guard("faults_note_success"):
            scope.faults.succeeded(kind, key())


def _timeout_detail(seconds: Any, knob: str | None) -> str:
    """``"after 600 s (knob: ...)"`` for a timeout's message."""
    value = getattr(seconds, "read", seconds)  # httpx.Timeout -> its read timeout
    shown = f"after {value:g} s" if isinstance(value, (int, float)) and not isinstance(value, bool) else ""
    return " ".join(part for part in (shown, f"(knob: {knob})" if knob else "") if part)
