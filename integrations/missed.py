"""A rollout that called a model but captured no model call says why, once per cause.

Compares what the capture hooks recorded (the trajectory's ``capture_*`` metrics) with the
model requests seen on the wire (:mod:`.wire`), and only warns on evidence:

- ``hooks_off`` / ``no_hook``: requests to a generation route were sent from inside the
  rollout, yet no model call was captured: the capture hooks are off, or the client that
  sent them is one tracerl has no hook for;
- ``thread``: the rollout captured nothing and sent nothing from its context, but requests
  to its model's endpoint (or to a tracerl-served one) were sent outside every rollout
  while it was open: the agent called the model on a thread that did not copy the context;
- ``not_served``: model calls were captured, none with sampled token ids, in a rollout of a
  trainable model: the endpoint that answered is not served by tracerl.

Each finding is written into the trajectory (``trajectory.logs``,
``metrics["capture_missed_model_requests"]`` or ``metrics["capture_unserved_model_calls"]``)
every time, and raised as a :class:`CaptureWarning` the first time per cause in the process.
"""

from __future__ import annotations

import sys
import threading
import warnings
from typing import Any

from tracerl.types import Trajectory

from . import auto, wire
from .endpoints import is_tracerl_url

_lock = threading.Lock()
_warned: set[str] = set()

HOOKED_CLIENTS = (
    "the OpenAI SDK's chat.completions / completions / responses, the Anthropic SDK's messages, litellm, LangChain "
    "chat models (ChatOpenAI, init_chat_model...), the MCP client; any other client through the rollout's gateway"
)


class CaptureWarning(UserWarning):
    """A rollout's code called a model, but the call did not become part of its trajectory."""


def check(rollout: Any, trajectory: Trajectory) -> None:
    """Record and warn about model calls ``rollout`` (the ``Rollout`` ending) made but did not capture (never raises)."""
    captured = int(trajectory.metrics.get("capture_model_calls", 0) or 0)
    seen = rollout.seen_requests
    if captured == 0 and seen.count:
        opted_out = not rollout.auto_instrument or not auto.env_allows()
        kind = "hooks_off" if opted_out and not _hooks_on() else "no_hook"
        _report(trajectory, kind, _no_capture_message(kind, seen.count, seen.urls), missed=seen.count)
    elif captured == 0:
        outside = [url for url in wire.outside_since(rollout.outside_mark) if _is_model_endpoint(rollout.model, url)]
        if outside:
            _report(trajectory, "thread", _thread_message(outside), missed=len(outside))
    elif (
        getattr(rollout.model, "trainable", False)
        and int(trajectory.metrics.get("capture_turns_with_token_ids", 0) or 0) == 0
    ):
        urls = [u for u in seen.urls if not is_tracerl_url(u)]
        _report(trajectory, "not_served", _not_served_message(captured, urls), unserved=captured)


def reset() -> None:
    """Warn again for every cause (tests)."""
    with _lock:
        _warned.clear()


def _report(trajectory: Trajectory, kind: str, message: str, *, missed: int = 0, unserved: int = 0) -> None:
    if missed:
        trajectory.metrics["capture_missed_model_requests"] = missed
    if unserved:
        trajectory.metrics["capture_unserved_model_calls"] = unserved
    trajectory.log(message)
    with _lock:
        first = kind not in _warned
        _warned.add(kind)
    if first:
        warnings.warn(message + " (warned once per cause; every trajectory carries it in .logs)", CaptureWarning, stacklevel=5)


def _hooks_on() -> list[str]:
    """The capture hooks that are on (only those whose library is imported: nothing is imported here)."""
    on = []
    for name, (library, module) in auto.HOOKS.items():
        hook = sys.modules.get(f"{__package__}{module}")
        if library in sys.modules and hook is not None and hook.is_instrumented():
            on.append(name)
    return on


def _is_model_endpoint(model: Any, url: str) -> bool:
    base = getattr(model, "inference_base_url", None) if model is not None else None
    if base:
        base = str(base).rstrip("/")
        return url == base or url.startswith(base + "/") or url.startswith(base.removesuffix("/v1") + "/")
    return is_tracerl_url(url)


def _urls(urls: list[str]) -> str:
    return ", ".join(urls) if urls else "an unknown URL"


def _no_capture_message(kind: str, count: int, urls: list[str]) -> str:
    head = f"tracerl: this rollout sent {count} model request(s) ({_urls(urls)}) but captured no model call, so its trajectory has no turns."
    if kind == "hooks_off":
        cause = (
            "the capture hooks are off (the rollout was opened with auto_instrument=False or TRACERL_AUTO_INSTRUMENT=0, "
            "and tracerl.integrations.instrument() was not called)"
        )
    else:
        cause = (
            f"the client that sent them has no tracerl hook (hooked: {HOOKED_CLIENTS}; on now: {', '.join(_hooks_on()) or 'none'}). "
            "Call the model through one of them, or build the turns yourself with tracerl.Choice.from_openai"
        )
    unserved = [u for u in urls if not is_tracerl_url(u)]
    tail = f" Also, {_urls(unserved)} is not served by tracerl, so captured turns would carry no sampled token ids."
    return f"{head} Likely cause: {cause}.{tail if unserved else ''}"


def _thread_message(urls: list[str]) -> str:
    return (
        f"tracerl: while this rollout was open, {len(urls)} model request(s) to its model's endpoint ({_urls(urls[:wire.MAX_URLS])}) "
        "were sent outside every rollout's context, and this rollout captured no model call. Likely cause: the agent "
        "called the model on a thread that did not copy the context (a bare threading.Thread or loop.run_in_executor); "
        "run the function with contextvars.copy_context().run(fn, ...) or asyncio.to_thread, which copy it."
    )


def _not_served_message(count: int, urls: list[str]) -> str:
    return (
        f"tracerl: this rollout captured {count} model call(s), none with sampled token ids: the endpoint that answered "
        f"({_urls(urls)}) is not served by tracerl, so backend.train refuses these turns (allow_retokenize=True rebuilds "
        "them from the chat template, an approximation). Point the client at model.inference_base_url "
        "(model.openai_client(), ti.langgraph.init_chat_model(model)), or ti.register_endpoint(url) for a tracerl "
        "endpoint behind a proxy."
    )
