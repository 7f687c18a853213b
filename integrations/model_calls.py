"""One hooked model call, as the fault log and the OpenTelemetry context see it (shared by every hook)."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from opentelemetry import context as otel_context

from . import faults
from .health import guard, record_error
from .patching import InitArgument
from .spans import end_with_error

RESOURCE_CLIENT = InitArgument("client")
"""The client behind an SDK resource (``client.chat.completions``, ``client.messages``...): its base
URL says whether the endpoint is tracerl's, its timeout goes to the fault log.  Read through the
resource's public constructor, ``Resource(client)`` (the OpenAI and Anthropic SDKs alike), patched
when the hook is enabled.  A resource made before (an agent framework builds its client's resources
with the agent, often before the first rollout enables the hooks) is unknown: its calls still get
token ids from tracerl's endpoint, which always answers with them."""

_in_model_call: ContextVar[bool] = ContextVar("tracerl_in_model_call", default=False)
"""Set while a hooked model call runs: LiteLLM's call through the OpenAI SDK is one call, not two."""


class CallRecord:
    """One model call as the fault log sees it: where it went, its input, its time limit.

    ``returned()`` must follow the library call (it clears the "in a model call" mark);
    ``failed`` / ``ended`` report the outcome.  A call made inside another hooked call
    (LiteLLM's own OpenAI SDK call) reports nothing: the outer call does.
    """

    __slots__ = ("target", "kwargs", "timeout", "knob", "nested", "_mark")

    def __init__(self, target: Any, kwargs: dict[str, Any], timeout: Any, knob: str) -> None:
        self.target, self.kwargs, self.timeout, self.knob = target, kwargs, timeout, knob  # str() when it fails
        self.nested = _in_model_call.get()
        self._mark = _in_model_call.set(True)
        if not self.nested:
            faults.note_start("model", self.key)

    def key(self) -> int:
        return faults.call_key(str(self.target), self.kwargs.get("model"), self.kwargs.get("messages"))

    def returned(self) -> None:
        try:  # try/except rather than ``guard`` on the per-call path: three Python calls fewer
            _in_model_call.reset(self._mark)
        except Exception as error:  # noqa: BLE001 - capture never raises into the call
            record_error("model_call_mark", error)

    def failed(self, error: BaseException) -> None:
        if not self.nested:
            faults.note_failure("model", str(self.target), error, self.key, timeout=self.timeout, knob=self.knob)

    def ended(self, error: BaseException | None = None) -> None:
        if error is not None:
            self.failed(error)
        elif not self.nested:
            faults.note_success("model", self.key)


def detach_context(token: Any) -> None:
    if token is not None:
        try:
            otel_context.detach(token)
        except Exception as error:  # noqa: BLE001 - as ``guard``
            record_error("openai_detach", error)


def end_span_with_error(span: Any, error: BaseException, where: str = "openai_error") -> None:
    if span is not None:
        with guard(where):
            end_with_error(span, error)
