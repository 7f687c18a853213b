"""Langfuse as a destination: its attribute mapping, its keys, and its SDK beside ours.

Names are the Langfuse SDK's (``langfuse/_client/attributes.py``) and what Langfuse's OTel
ingestion reads (``packages/shared/src/server/otel/OtelIngestionProcessor.ts``, ingestion
version 4, which reads the trace-level fields from *each* span):

* every span of a trace tracerl started: ``langfuse.trace.name``, ``session.id`` (the
  group), ``user.id``, ``langfuse.trace.tags`` (split, model, the user's), ``langfuse.version``
  and ``langfuse.release`` (the checkpoint, ``name@step``), ``langfuse.trace.metadata.*``,
  and ``langfuse.environment`` (this destination's);
* the root: input = the task, output = the final answer (trace and observation);
* ``langfuse.observation.type``: ``generation`` for the model call, ``tool``, ``agent`` (the
  rollout), ``evaluator`` (judges, scores); an *outer layer* of a model call (see
  ``integrations/layers.py``) becomes a plain ``span`` without model or usage, since
  Langfuse reads usage from any span and prices (or tokenizes) any span naming a model;
* cost (``langfuse.observation.cost_details`` and ``gen_ai.usage.cost``) where tracerl knows
  the price: zero for models served by tracerl, or the user's prices; hosted models are
  left to Langfuse's price table (by model name).

Attributes already on a span win (except on outer layers, whose model and usage go).
"""

from __future__ import annotations

import base64
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping
from urllib.parse import urlsplit

import httpx
from opentelemetry.sdk.trace import ReadableSpan

from tracerl.errors import ConfigError

from .. import semconv as sc
from ..health import record_error
from ..layers import is_outer_layer
from . import traces
from .traces import TraceInfo

OTEL_PATH = "/api/public/otel/v1/traces"
SCORES_PATH = "/api/public/scores"
PROJECTS_PATH = "/api/public/projects"
DEFAULT_HOST = "https://cloud.langfuse.com"
OBSERVATION_TYPE = "langfuse.observation.type"
ENVIRONMENT = "langfuse.environment"
# GenAI semconv names for judge results (written by scores.py, read here).
EVALUATION_EVENT = "gen_ai.evaluation.result"
EVALUATION_NAME = "gen_ai.evaluation.name"
EVALUATION_SCORE = "gen_ai.evaluation.score.value"
EVALUATION_EXPLANATION = "gen_ai.evaluation.explanation"
OUTER_LAYER_OF = "tracerl.outer_layer"
"""Set on an outer layer as exported: the model and usage are on the model-call span below it."""

_TYPES = {**dict.fromkeys(sc.LLM_OPERATIONS, "generation"), sc.OP_EXECUTE_TOOL: "tool", sc.OP_INVOKE_AGENT: "agent"}
_MODEL_KEYS = frozenset({
    "langfuse.observation.model.name", "gen_ai.response.model", "ai.model.id", "gen_ai.request.model",
    "llm.response.model", "llm.model_name", "model", "langfuse.observation.usage_details",
    "langfuse.observation.cost_details",
})  # fmt: skip
_USAGE_PREFIXES = ("gen_ai.usage.", "llm.token_count.", "llm.cost.")
_ENVIRONMENT_PATTERN = re.compile(r"^(?!langfuse)[a-z0-9_-]{1,40}$")  # the SDK's rule


@dataclass(frozen=True)
class Destination:
    """What one exporter adds to what it sends (knobs of ``export_to_langfuse`` / ``export_to_otlp``)."""

    environment: str | None = None
    release: str | None = None
    prices: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    """Model name -> (USD per million input tokens, USD per million output tokens)."""


def destination(environment: str | None, release: str | None, prices: Mapping[str, Any] | None) -> Destination:
    """Resolve the knobs like the Langfuse SDK: ``LANGFUSE_TRACING_ENVIRONMENT``, ``LANGFUSE_RELEASE``."""
    environment = environment or os.environ.get("LANGFUSE_TRACING_ENVIRONMENT") or None
    if environment is not None and not _ENVIRONMENT_PATTERN.fullmatch(environment):
        raise ConfigError(
            f"environment {environment!r}: use lowercase letters, digits, '-' or '_' (at most 40), not starting with 'langfuse'"
        )
    checked: dict[str, tuple[float, float]] = {}
    for model, price in (prices or {}).items():
        try:
            input_price, output_price = (float(p) for p in price)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"prices[{model!r}] must be (USD per 1M input tokens, USD per 1M output tokens)") from error
        if min(input_price, output_price) < 0:
            raise ConfigError(f"prices[{model!r}] must not be negative")
        checked[str(model)] = (input_price, output_price)
    return Destination(environment, release or os.environ.get("LANGFUSE_RELEASE") or None, checked)


def langfuse_view(span: ReadableSpan, where: Destination) -> ReadableSpan:
    """The span as Langfuse should read it (a copy; the span itself is not touched)."""
    attributes = dict(span.attributes or {})
    outer = is_outer_layer(span.context.span_id)
    if outer:
        attributes = {k: v for k, v in attributes.items() if k not in _MODEL_KEYS and not k.startswith(_USAGE_PREFIXES)}
        attributes[OBSERVATION_TYPE] = "span"
        attributes[OUTER_LAYER_OF] = True
    for key, value in langfuse_attributes(span, where, outer=outer).items():
        attributes.setdefault(key, value)
    return ReadableSpan(
        name=span.name, context=span.context, parent=span.parent, resource=span.resource, attributes=attributes,
        events=span.events, links=span.links, kind=span.kind, status=span.status, start_time=span.start_time,
        end_time=span.end_time, instrumentation_scope=span.instrumentation_scope,
    )  # fmt: skip


def langfuse_attributes(span: ReadableSpan, where: Destination | None = None, *, outer: bool = False) -> dict[str, Any]:
    """The ``langfuse.*`` (and ``session.id`` / ``user.id``) attributes tracerl adds to one span."""
    where = where or Destination()
    attributes = span.attributes or {}
    out: dict[str, Any] = {}
    kind = _TYPES.get(attributes.get(sc.OPERATION_NAME))  # type: ignore[arg-type]
    if kind is None and EVALUATION_NAME in attributes:
        kind = "evaluator"
    if kind and not outer:
        out[OBSERVATION_TYPE] = kind
    if where.environment:
        out[ENVIRONMENT] = where.environment
    info = traces.lookup(span.context.trace_id)
    if info is not None:
        out.update(trace_attributes(info, where))
        if span.context.span_id == info.root_span_id:
            out.update(_root_io(info))
    if kind == "generation" and not outer:
        out.update(_cost(attributes, where))
    return out


def trace_attributes(info: TraceInfo, where: Destination) -> dict[str, Any]:
    """What every span of the trace carries, as the Langfuse SDK's ``propagate_attributes`` writes it."""
    out: dict[str, Any] = {"langfuse.trace.name": info.name}
    if info.session_id:
        out["session.id"] = info.session_id
    if info.user_id:
        out["user.id"] = info.user_id
    if info.tags:
        out["langfuse.trace.tags"] = list(info.tags)
    if info.version:
        out["langfuse.version"] = info.version
    if where.release or info.version:
        out["langfuse.release"] = where.release or info.version
    out.update({f"langfuse.trace.metadata.{k}": v for k, v in info.metadata.items()})
    return out


def _root_io(info: TraceInfo) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if info.input is not None:
        out["langfuse.trace.input"] = out["langfuse.observation.input"] = info.input
    if info.output is not None:
        out["langfuse.trace.output"] = out["langfuse.observation.output"] = info.output
    return out


def _cost(attributes: Mapping[str, Any], where: Destination) -> dict[str, Any]:
    """Cost where tracerl knows the price: the user's prices, else zero on a tracerl-served model."""
    model = str(attributes.get(sc.RESPONSE_MODEL) or attributes.get(sc.REQUEST_MODEL) or "")
    price = where.prices.get(model) or where.prices.get(model.split("@", 1)[0])
    if price is None and not attributes.get(sc.TOKEN_IDS_REQUESTED):
        return {}  # a hosted model: Langfuse prices it by name
    input_price, output_price = price or (0.0, 0.0)
    details = {
        "input": int(attributes.get(sc.USAGE_INPUT_TOKENS) or 0) * input_price / 1e6,
        "output": int(attributes.get(sc.USAGE_OUTPUT_TOKENS) or 0) * output_price / 1e6,
    }
    details["total"] = details["input"] + details["output"]
    return {"langfuse.observation.cost_details": json.dumps(details), "gen_ai.usage.cost": details["total"]}


def langfuse_span_filter(span: ReadableSpan) -> bool:
    """``should_export_span`` for the Langfuse SDK: its default filter plus every tracerl span.

    The default keeps spans with a ``gen_ai.*`` attribute (tracerl's rollout, chat, tool and
    evaluation spans have one) but drops MCP protocol spans such as ``tools/list``.
    """
    from langfuse.span_filter import is_default_export_span

    scope = span.instrumentation_scope
    return (scope is not None and scope.name == sc.SCOPE) or is_default_export_span(span)


# -- the SDK beside our exporter ------------------------------------------------------------------
def langfuse_sdk_own_spans(span: ReadableSpan) -> bool:
    """``should_export_span`` for a Langfuse SDK client that shares a provider with
    ``export_to_langfuse``: the SDK sends only its own spans (its default filter among them),
    tracerl's exporter sends the rest in Langfuse's mapping, each span once.

    ``Langfuse(..., should_export_span=langfuse_sdk_own_spans)``: the SDK's public option; an SDK
    client created without it also sends tracerl's spans (twice, the second copy unmapped).
    """
    from langfuse.span_filter import is_default_export_span

    return is_sdk_span(span) and is_default_export_span(span)


def is_sdk_span(span: ReadableSpan) -> bool:
    scope = span.instrumentation_scope
    return scope is not None and scope.name.startswith("langfuse-sdk")


# -- host and keys (the exporter's and the importer's) ---------------------------------------------------
def check_url(url: str, what: str) -> str:
    parts = urlsplit(url or "")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{what} {url!r} is not an http(s) URL (e.g. http://localhost:3000)")
    return url


def langfuse_host(host: str | None) -> str:
    """``host``, else ``LANGFUSE_BASE_URL`` / ``LANGFUSE_HOST``, else Langfuse Cloud; checked, no trailing ``/``."""
    host = host or os.environ.get("LANGFUSE_BASE_URL") or os.environ.get("LANGFUSE_HOST") or DEFAULT_HOST
    return check_url(host.rstrip("/"), "Langfuse host")


def langfuse_keys(public_key: str | None, secret_key: str | None, needed_by: str) -> tuple[str, str, str]:
    """(public key, secret key, ``Basic ...`` header value) from the arguments or the environment, or
    :class:`ConfigError` naming the missing ones."""
    public_key = public_key or os.environ.get("LANGFUSE_PUBLIC_KEY")
    secret_key = secret_key or os.environ.get("LANGFUSE_SECRET_KEY")
    if not public_key or not secret_key:
        given = (("LANGFUSE_PUBLIC_KEY", public_key), ("LANGFUSE_SECRET_KEY", secret_key))
        missing = " and ".join(name for name, value in given if not value)
        raise ConfigError(f"{needed_by} needs API keys: pass public_key=/secret_key= or set {missing}")
    return public_key, secret_key, "Basic " + base64.b64encode(f"{public_key}:{secret_key}".encode()).decode("ascii")


def auth_headers(public_key: str | None, secret_key: str | None) -> dict[str, str]:
    """Langfuse's headers (Basic auth, ingestion version 4), or :class:`ConfigError` for missing/swapped keys."""
    public_key, secret_key, authorization = langfuse_keys(public_key, secret_key, "export_to_langfuse")
    if public_key.startswith("sk-lf-") or secret_key.startswith("pk-lf-"):
        raise ConfigError("Langfuse keys look swapped: the public key starts with pk-lf-, the secret key with sk-lf-")
    return {"Authorization": authorization, "x-langfuse-public-key": public_key, "x-langfuse-ingestion-version": "4"}


def check_keys(host: str, headers: Mapping[str, str], timeout_s: float) -> None:
    from opentelemetry import context

    from tracerl.net.untraced import suppressed_context

    token = context.attach(suppressed_context())  # tracerl's own request: no span in the user's trace
    try:
        response = httpx.get(host + PROJECTS_PATH, headers=dict(headers), timeout=timeout_s)
    except httpx.HTTPError as error:
        raise ConfigError(f"cannot reach Langfuse at {host}: {error!r}") from error
    finally:
        context.detach(token)
    if response.status_code in (401, 403):
        raise ConfigError(f"Langfuse at {host} rejected the keys ({response.status_code}): check public_key/secret_key")
    if response.status_code >= 400:
        raise ConfigError(f"Langfuse at {host} answered {response.status_code} to the key check: {response.text[:200]}")
