"""A rollout's gateway, from the rollout's side: an address on tracerl's endpoint for agents the
rollout does not run in its own process (a subprocess, a Node or LangGraph.js agent, ``curl``).

``Rollout.gateway_url`` opens a token on the model's endpoint (``core/inference/gateway.py``, also
through ``tracerl serve``); when the rollout ends the calls made with it are collected and become
records like any hooked call's (the chat request as sampled, the completion with its token ids).
A failure to collect them is an infrastructure failure of the rollout: it raises, and no
trajectory missing those calls reaches training.
"""

from __future__ import annotations

from typing import Any

import httpx

from .spans import finish_chat_span, start_chat_span

ROLLOUT_HEADER = "X-Tracerl-Rollout"
TIMEOUT_S = 30.0


class GatewayError(ConnectionError):
    """The gateway's calls could not be opened or collected (an infrastructure failure)."""


def _endpoint(model: Any) -> tuple[str, dict[str, str], float]:
    base = getattr(model, "inference_base_url", None)
    if not base:
        raise GatewayError("a rollout's gateway needs the model's tracerl endpoint: pass rollout(model=...) "
                           "with a served model (model.inference_base_url is not set)")  # fmt: skip
    key = getattr(model, "inference_api_key", None)
    timeout = getattr(model, "inference_timeout", None) or TIMEOUT_S
    return str(base).rstrip("/"), ({"Authorization": f"Bearer {key}"} if key else {}), min(float(timeout), TIMEOUT_S)


def open_token(model: Any) -> tuple[str, str]:
    """A new gateway token on ``model``'s endpoint and the base URL that carries it."""
    base, headers, timeout = _endpoint(model)
    try:
        name = getattr(model, "name", None)  # through tracerl serve: whose inference server holds the token
        response = httpx.post(f"{base}/tracerl/rollouts", json={"model": name} if name else {}, headers=headers, timeout=timeout)
        response.raise_for_status()
        token = response.json()["token"]
    except (httpx.HTTPError, ValueError, KeyError) as error:
        raise GatewayError(f"could not open a gateway on {base}: {error}") from error
    return token, f"{base.removesuffix('/v1')}/rollouts/{token}/v1"


def close_token(model: Any, token: str) -> list[dict[str, Any]]:
    """The calls made with ``token`` (closed from now on: later calls get a 404)."""
    base, headers, timeout = _endpoint(model)
    try:
        response = httpx.delete(f"{base}/tracerl/rollouts/{token}", headers=headers, timeout=timeout)
        response.raise_for_status()
        answer = response.json()
    except (httpx.HTTPError, ValueError) as error:
        raise GatewayError(f"could not collect the gateway's calls from {base}: {error}") from error
    if answer.get("dropped_calls"):
        raise GatewayError(f"the gateway on {base} dropped {answer['dropped_calls']} calls of this rollout (past its limit)")
    return list(answer.get("calls") or [])


def record_calls(calls: list[dict[str, Any]], base_url: str) -> None:
    """Each collected call as the current rollout's record (the same route as a hooked call's)."""
    for call in calls:
        request = call["request"]
        span = start_chat_span("gateway", request, provider="tracerl", base_url=base_url, token_ids_requested=True)
        span.start_ns = int(call["start_ns"])
        finish_chat_span(span, call["completion"], end_ns=int(call["end_ns"]))
