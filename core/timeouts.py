"""Every time limit tracerl puts on a call that leaves the process, in one place.

Nothing waits forever: a hung model server, MCP server or judge costs a bounded time,
then raises a typed error (a :class:`~tracerl.errors.TracerlError` that is also a
``TimeoutError``) naming what timed out and the knob below.

| what | default | knob |
|---|---|---|
| one model call (``Model.openai_client()``, ``litellm_completion_params()``) | 600 s | ``Model(inference_timeout=...)`` |
| MCP server start + ``initialize`` | 60 s | ``McpServerSpec(startup_timeout=...)`` |
| one MCP request (tool call, listing) | 120 s | ``McpServerSpec(request_timeout=...)``, ``run_mcp_agent(request_timeout=...)`` |
| one judge / scenario-generator call (LiteLLM) | 180 s | ``extra_litellm_params={"timeout": s}`` (``judge_params`` / ``generator_params`` in MCP•RL) |
| one distillation teacher call (``/v1/completions`` with prompt logprobs) | 120 s | ``CompletionsTeacher(timeout=...)``, ``served_teacher(timeout=...)`` |
| one rollout, all of it | none | ``gather_trajectory_groups(..., rollout_timeout=...)`` |
| ``tracerl serve``'s ``/v1`` proxy waiting on the inference server | 600 s (then 504) | ``tracerl serve --inference-timeout`` |
| ``RemoteBackend`` quick calls (step, checkpoints, health) | 60 s | ``RemoteBackend(timeout=...)`` |
| ``RemoteBackend.train`` / ``register`` | 1800 s, ``train`` retried twice with its request id | ``RemoteBackend(train_timeout=..., train_retries=...)`` |
"""

from __future__ import annotations

import math

from .errors import ConfigError

DEFAULT_INFERENCE_TIMEOUT = 600.0
"""Seconds per model call: a long generation on a busy CPU is slow, a hung server is not."""
DEFAULT_MCP_STARTUP_TIMEOUT = 60.0
"""Seconds to start an MCP server and finish ``initialize`` (a first ``uvx`` run downloads it)."""
DEFAULT_MCP_REQUEST_TIMEOUT = 120.0
"""Seconds per MCP request (a tool call, a listing) before it counts as hung."""
DEFAULT_JUDGE_TIMEOUT = 180.0
"""Seconds per judge call: one call scores a whole group, with explanations."""


def check_timeout(value: float | None, name: str) -> float | None:
    """``value`` if it is a positive finite number of seconds or ``None`` (no limit), else :class:`ConfigError`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive number of seconds or None, got {value!r}")
    return float(value)


def within(seconds: float | None) -> str:
    """``"within 120 s"`` (or ``"in time"`` without a limit), for a timeout's message."""
    return f"within {seconds:g} s" if seconds is not None else "in time"
