"""What Langfuse makes of one OTLP span: a Python port of its ingestion mapping (the parts we use).

Ported from Langfuse's ``packages/shared/src/server/otel/`` (``OtelIngestionProcessor
.processToEvent``, the path taken for ``x-langfuse-ingestion-version: 4``, and
``ObservationTypeMapper``) and the worker's ``createEventRecord``.  With that ingestion
version every span is one event row that carries the trace-level fields itself (trace
name, user, session, tags, release, version, environment), read from that span's own
attributes; usage and cost are read from any span; a span with a model name and no usage
is tokenized by Langfuse when the model is in its price table (``would_tokenize``).
Framework-specific branches we never produce (Vercel AI SDK, Genkit, LiveKit, Flue…) are
left out; the key lists and their order are Langfuse's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from langfuse_tools import normalize_tools

_TYPES = {
    "span", "generation", "event", "embedding", "agent", "tool", "chain", "retriever", "guardrail", "evaluator",
}  # fmt: skip
_OPENINFERENCE_TYPES = {
    "CHAIN": "chain", "RETRIEVER": "retriever", "LLM": "generation", "EMBEDDING": "embedding", "AGENT": "agent",
    "TOOL": "tool", "GUARDRAIL": "guardrail", "EVALUATOR": "evaluator",
}  # fmt: skip
_GENAI_TYPES = {
    "chat": "generation", "completion": "generation", "text_completion": "generation", "generate_content": "generation",
    "generate": "generation", "embeddings": "embedding", "invoke_agent": "agent", "create_agent": "agent",
    "execute_tool": "tool",
}  # fmt: skip
_MODEL_KEYS = (
    "langfuse.observation.model.name", "gen_ai.response.model", "ai.model.id", "gen_ai.request.model",
    "llm.response.model", "llm.model_name", "model",
)  # fmt: skip
_USER_KEYS = (
    "langfuse.user.id", "user.id", "langfuse.observation.metadata.langfuse_user_id",
    "langfuse.trace.metadata.langfuse_user_id",
)  # fmt: skip
_SESSION_KEYS = (
    "langfuse.session.id", "session.id", "gen_ai.conversation.id", "langfuse.observation.metadata.langfuse_session_id",
    "langfuse.trace.metadata.langfuse_session_id",
)  # fmt: skip
_TAG_KEYS = (
    "langfuse.trace.tags", "langfuse.tags", "langfuse.observation.metadata.langfuse_tags",
    "langfuse.trace.metadata.langfuse_tags",
)  # fmt: skip
_ENVIRONMENT_KEYS = ("langfuse.environment", "deployment.environment.name", "deployment.environment")
_USAGE_DROPPED = {
    "prompt_tokens", "input_tokens", "prompt", "completion_tokens", "output_tokens", "completion", "total_tokens", "total",
}  # fmt: skip


@dataclass
class Observation:
    """One Langfuse event row (the fields the tests look at)."""

    id: str
    trace_id: str
    parent_id: str | None
    name: str
    type: str
    trace_name: str | None
    user_id: str | None
    session_id: str | None
    tags: list[str]
    release: str | None
    version: str | None
    environment: str
    model: str | None
    usage: dict[str, float]
    cost: dict[str, float]
    input: Any
    output: Any
    trace_metadata: dict[str, Any] = field(default_factory=dict)
    trace_input: Any = None
    trace_output: Any = None
    metadata: Any = None
    """``{"attributes": <the attributes not used as input/output, as text>, "resourceAttributes", "scope"}``."""
    tool_definitions: dict[str, str] = field(default_factory=dict)
    """Tool name -> ``{"description", "parameters"}`` JSON: the tools Langfuse found offered."""
    tool_call_names: list[str] = field(default_factory=list)

    @property
    def would_tokenize(self) -> bool:
        """Langfuse counts tokens itself for a named model without usage or cost (when it knows the model)."""
        return bool(self.model) and not self.usage and not self.cost


def observation(span: Any) -> Observation:
    """Map one collected span (``otlp_collector.CollectedSpan``) the way Langfuse's ingestion does."""
    a, resource = span.attributes, span.resource
    agent_span = a.get("gen_ai.operation.name") in ("invoke_agent", "agent_step")
    input_, output = _input_output(a, "observation")
    trace_input, trace_output = _input_output(a, "trace")
    sdk_span = str(getattr(span, "scope", "") or "").startswith("langfuse-sdk")
    metadata = {
        **({} if sdk_span else {"attributes": unused_attributes(a)}),
        "resourceAttributes": resource, "scope": {"name": getattr(span, "scope", None)},
        **_metadata(a, "observation"), **_metadata(a, "trace"),
    }  # fmt: skip
    tools = normalize_tools(input_, output, metadata)
    return Observation(
        id=span.span_id, trace_id=span.trace_id, parent_id=span.parent_span_id,
        name=str(a["gen_ai.tool.name"]) if a.get("gen_ai.tool.name") else span.name,
        type=observation_type(a), trace_name=a.get("langfuse.trace.name"),
        user_id=_first(a, _USER_KEYS), session_id=_first(a, _SESSION_KEYS), tags=_tags(a),
        release=a.get("langfuse.release") or resource.get("langfuse.release"),
        version=a.get("langfuse.version") or resource.get("service.version"),
        environment=_first(a, _ENVIRONMENT_KEYS) or _first(resource, _ENVIRONMENT_KEYS) or "default",
        model=None if agent_span else _first(a, _MODEL_KEYS),
        usage={} if agent_span else usage_details(a), cost={} if agent_span else cost_details(a),
        input=tools.input, output=tools.output, trace_metadata=_trace_metadata(a), trace_input=trace_input,
        trace_output=trace_output, metadata=tools.metadata, tool_definitions=tools.tool_definitions,
        tool_call_names=tools.tool_call_names,
    )  # fmt: skip


def observation_type(a: Mapping[str, Any]) -> str:
    """``ObservationTypeMapperRegistry``: Langfuse's type, then OpenInference's kind, then GenAI's operation."""
    if a.get("langfuse.observation.type") in _TYPES:
        return a["langfuse.observation.type"]
    if a.get("openinference.span.kind") in _OPENINFERENCE_TYPES:
        return _OPENINFERENCE_TYPES[a["openinference.span.kind"]]
    if a.get("gen_ai.operation.name") in _GENAI_TYPES:
        return _GENAI_TYPES[a["gen_ai.operation.name"]]
    if a.get("gen_ai.tool.name") or a.get("gen_ai.tool.call.id"):
        return "tool"
    return "span"


def usage_details(a: Mapping[str, Any]) -> dict[str, float]:
    """``extractUsageDetails`` / ``extractGenericGenAiUsageDetails`` (any span type)."""
    if "langfuse.observation.usage_details" in a:
        return json.loads(a["langfuse.observation.usage_details"])
    raw: dict[str, float] = {}
    for key, value in a.items():
        if (key.startswith("gen_ai.usage.") and key != "gen_ai.usage.cost") or key.startswith("llm.token_count."):
            try:
                raw[key.replace("gen_ai.usage.", "").replace("llm.token_count.", "")] = float(value)
            except (TypeError, ValueError):
                pass
    if not raw:
        return {}
    out = {k: v for k, v in raw.items() if k not in _USAGE_DROPPED}
    inputs = _first(raw, ("prompt_tokens", "input_tokens", "prompt"))
    outputs = _first(raw, ("completion_tokens", "output_tokens", "completion"))
    total = _first(raw, ("total_tokens", "total"))
    if inputs is not None:
        out["input"] = inputs
    if outputs is not None:
        out["output"] = outputs
    if total is not None:
        out["total"] = total
    return out


def cost_details(a: Mapping[str, Any]) -> dict[str, float]:
    """``extractCostDetails``: cost details, else ``gen_ai.usage.cost``, else OpenInference's total."""
    if "langfuse.observation.cost_details" in a:
        return json.loads(a["langfuse.observation.cost_details"])
    for key in ("gen_ai.usage.cost", "llm.cost.total"):
        if a.get(key) not in (None, ""):
            return {"total": float(a[key])}
    return {}


# ``extractInputAndOutput``: the attribute pairs it tries, in its order (the branches for
# frameworks tracerl never meets are left out); the first pair with a value wins.
_IO_PAIRS = (
    ("mlflow.spanInputs", "mlflow.spanOutputs"),
    ("traceloop.entity.input", "traceloop.entity.output"),
    ("input.value", "output.value"),  # OpenInference (Langfuse: "SmolAgents")
    ("input", "output"),
    ("tool_arguments", "tool_response"),
    ("gen_ai.input.messages", "gen_ai.output.messages"),
    ("gen_ai.tool.call.arguments", "gen_ai.tool.call.result"),
)
# The keys it deletes from the attributes it keeps in metadata (those we can meet).
_IO_KEYS = frozenset({
    "langfuse.trace.input", "langfuse.trace.output", "langfuse.observation.input", "langfuse.observation.output",
    "prompt", "all_messages_events", "events", "final_result", "pydantic_ai.all_messages", "gen_ai.system_instructions",
    *(key for pair in _IO_PAIRS for key in pair),
})  # fmt: skip
_IO_PREFIXES = (
    "gen_ai.prompt", "gen_ai.completion", "llm.input_messages", "llm.output_messages", "langfuse.trace.metadata",
    "langfuse.observation.metadata", "ai.telemetry.metadata",
)  # fmt: skip


def _input_output(a: Mapping[str, Any], domain: str) -> tuple[Any, Any]:
    input_ = a.get("langfuse.trace.input") if domain == "trace" and a.get("langfuse.trace.input") else a.get("langfuse.observation.input")
    output = a.get("langfuse.trace.output") if domain == "trace" and a.get("langfuse.trace.output") else a.get("langfuse.observation.output")
    if input_ is not None or output is not None:
        return input_, output
    for input_key, output_key in _IO_PAIRS:
        if a.get(input_key) or a.get(output_key):  # JavaScript truthiness: "" does not count
            return a.get(input_key), a.get(output_key)
    return None, None


def unused_attributes(a: Mapping[str, Any]) -> dict[str, str]:
    """The span attributes Langfuse keeps in the observation's ``metadata.attributes`` (as text)."""
    return {
        k: v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))  # JSON.stringify
        for k, v in a.items()
        if k not in _IO_KEYS and not k.startswith(_IO_PREFIXES)
    }


def _trace_metadata(a: Mapping[str, Any]) -> dict[str, Any]:
    return _metadata(a, "trace")


def _metadata(a: Mapping[str, Any], domain: str) -> dict[str, Any]:
    """``extractMetadata``: the ``langfuse.{domain}.metadata`` JSON and ``langfuse.{domain}.metadata.*`` keys."""
    key = f"langfuse.{domain}.metadata"
    out = json.loads(a[key]) if isinstance(a.get(key), str) else {}
    prefix = key + "."
    out.update({k[len(prefix) :]: v for k, v in a.items() if k.startswith(prefix)})
    return out


def _tags(a: Mapping[str, Any]) -> list[str]:
    value = next((a[k] for k in _TAG_KEYS if a.get(k)), None)
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    if isinstance(value, str) and value.strip().startswith("["):
        return [str(v) for v in json.loads(value)]
    return [t.strip() for t in str(value).split(",")]


def _first(a: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    return next((a[k] for k in keys if a.get(k) not in (None, "")), None)
