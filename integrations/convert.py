"""Model calls and spans of one rollout -> :class:`~tracerl.Trajectory`.

1. Take the hooks' records of model calls (``recorded.py``); read the model calls other
   instrumentors wrote as spans (any GenAI-semconv instrumentor, OpenInference) and the
   tool / MCP calls.
2. Drop calls seen by two layers (same response id; or overlapping in time with the
   same last input and the same output), keeping the layer closest to the wire.
3. Join exact token ids / logprobs by span id or response id.
4. Rebuild conversations: a call whose input starts with an earlier call's input +
   output continues it; any other call starts a new history.  The history holding the
   last call is the trajectory, the others become ``additional_histories``.
5. Tool results the agent produced after its last model call are appended.

Every span is parsed on its own: a malformed one is counted and skipped, never raised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from tracerl.types import Choice, History, Trajectory

from . import semconv as sc
from .health import record_error
from .input_delta import base_of
from .messages import canonical, from_openinference, from_semconv

LAYER_PRIORITY = {"openai": 0, "openai_responses": 0, "openai_completions": 0, "anthropic": 0, "gateway": 0, "litellm": 1, "litellm_responses": 1,
                  "litellm_anthropic": 1, "langchain": 2}  # fmt: skip
"""Which layer's record of a request is kept (closest to the wire first)."""
GENAI_PRIORITY = 3
_OPENINFERENCE_PRIORITY = 4


@dataclass
class ModelCall:
    span_id: int
    start: int
    end: int
    layer: str
    priority: int
    inputs: list[dict[str, Any]]
    output: dict[str, Any]
    finish_reason: str | None = None
    tools: list[dict[str, Any]] | None = None
    model: str | None = None
    response_id: str | None = None
    usage: tuple[int, int] = (0, 0)
    record: Any = None
    keys: list[tuple[Any, ...]] = field(default_factory=list)
    duplicates: int = 0
    alias_span_ids: list[int] = field(default_factory=list)
    base: tuple[int, int] | None = None
    """(span id, prefix length) while ``inputs`` holds only a delta of that earlier call's input."""
    tool_definitions: str | None = None
    """Tool definitions as their JSON, still to read (a hook's record: ``spans.end_chat_span``)."""

    def expected(self) -> list[tuple[Any, ...]]:
        return self.keys + [canonical(self.output)]


@dataclass
class ToolRun:
    name: str | None
    call_id: str | None
    result: str | None
    error: str | None
    start: int
    end: int
    layer: str


def new_model_call(
    *, span_id: int, start: int, end: int, layer: str, inputs: list[dict[str, Any]], output: dict[str, Any],
    finish_reason: Any = None, model: str | None = None, response_id: str | None = None, usage: tuple[int, int] = (0, 0),
    record: Any = None, base: tuple[int, int] | None = None, tools: list[dict[str, Any]] | None = None,
    tool_definitions: str | None = None, priority: int | None = None,
) -> ModelCall:  # fmt: skip
    """The one builder of a :class:`ModelCall`, from a hook's values (``spans.end_chat_span``) or
    a span another instrumentor wrote (:func:`_model_call`): messages in OpenAI shape."""
    output["role"] = "assistant"
    return ModelCall(
        span_id=span_id, start=start, end=end or start, layer=layer, inputs=inputs, output=output,
        priority=LAYER_PRIORITY.get(layer, GENAI_PRIORITY) if priority is None else priority,
        finish_reason=finish_reason, tools=tools, model=model or None, response_id=response_id or None, usage=usage,
        record=record, keys=[canonical(m) for m in inputs], tool_definitions=tool_definitions,
        base=(int(base[0]), int(base[1])) if base is not None else None,
    )  # fmt: skip


def spans_to_trajectory(
    spans: Iterable[Any],
    records: Iterable[Any] = (),
    *,
    dropped_spans: int = 0,
    calls: Iterable[ModelCall] = (),
    recorded_calls: int = 0,
) -> Trajectory:
    """Build the trajectory of one rollout from the hooks' records of its model calls (``calls``, out
    of ``recorded_calls`` ended: a failed call has no record), its finished spans (tool and MCP
    calls, other instrumentors' model calls) and token records.
    """
    spans = list(spans)
    errors_before = _ErrorTally()
    tool_lists: dict[str, list[dict[str, Any]] | None] = {}
    calls = list(calls)
    for call in calls:
        if call.tool_definitions is not None:
            call.tools = _tools(call.tool_definitions, tool_lists)
            call.tool_definitions = None
    tools: list[ToolRun] = []
    mcp_tools: list[dict[str, Any]] | None = None
    for span in spans:
        try:
            attributes = span.attributes or {}
            call = _model_call(span, attributes, tool_lists)
            if call is not None:
                calls.append(call)
                continue
            tool = _tool_run(span, attributes)
            if tool is not None:
                tools.append(tool)
            if sc.MCP_TOOLS in attributes:
                mcp_tools = [_tool_schema(t) for t in json.loads(attributes[sc.MCP_TOOLS])]
        except Exception as error:  # noqa: BLE001 - one bad span must not lose the rollout
            errors_before.add("convert_span", error)
    _resolve_deltas(calls, errors_before)
    unique, duplicates = _dedupe(calls)
    _join_records(unique, records, errors_before)
    unique.sort(key=lambda c: (c.start, c.end))
    chains = _chains(unique)
    tools.sort(key=lambda t: t.start)

    others = [_history(chain, tools) for chain in chains]  # all but the main one, once it is taken out
    main_index = max(range(len(chains)), key=lambda i: chains[i][-1].end, default=None)
    main = History(messages_and_choices=[], tools=mcp_tools) if main_index is None else others.pop(main_index)
    if main.tools is None and mcp_tools:
        main.tools = mcp_tools
    with_ids = sum(1 for c in unique if c.record is not None and c.record.token_ids is not None)
    trajectory = Trajectory(
        messages_and_choices=main.messages_and_choices,
        tools=main.tools,
        additional_histories=others,
        metrics={
            "capture_model_calls": len(unique),
            "capture_duplicate_calls": duplicates,
            "capture_histories": len(chains),
            "capture_turns_with_token_ids": with_ids,
            "capture_turns_without_token_ids": len(unique) - with_ids,
            "capture_tool_runs": len(tools),
            "capture_spans": len(spans) + recorded_calls,
            "capture_spans_dropped": dropped_spans,
            "capture_errors": errors_before.count,
            "capture_input_tokens": sum(c.usage[0] for c in unique),
            "capture_output_tokens": sum(c.usage[1] for c in unique),
        },
    )
    models = sorted({c.model for c in unique if c.model})
    if models:
        trajectory.metadata["models"] = models
    if not unique:
        trajectory.log("capture: no model calls were recorded in this rollout")
    return trajectory


class _ErrorTally:
    def __init__(self) -> None:
        self.count = 0

    def add(self, kind: str, error: BaseException) -> None:
        self.count += 1
        record_error(kind, error)


# -- reading spans ---------------------------------------------------------------------------
def _model_call(
    span: Any, attributes: Mapping[str, Any], tool_lists: dict[str, list[dict[str, Any]] | None]
) -> ModelCall | None:
    """``tool_lists``: tool definitions already read in this rollout, by their JSON (an agent sends
    the same list with every call; each history's ``tools`` is still a list of its own)."""
    operation = attributes.get(sc.OPERATION_NAME)
    if operation in sc.LLM_OPERATIONS and sc.OUTPUT_MESSAGES in attributes:
        layer, priority = attributes.get(sc.LAYER) or "genai", None  # None: by layer, in new_model_call
        inputs = [from_semconv(m) for m in attribute_value(attributes.get(sc.INPUT_MESSAGES), [])]
        outputs = attribute_value(attributes[sc.OUTPUT_MESSAGES], [])
        if not outputs:
            return None
        output = from_semconv(outputs[0])
        finish = outputs[0].get("finish_reason")
        tools = _tools(attributes.get(sc.TOOL_DEFINITIONS), tool_lists)
        model = attributes.get(sc.RESPONSE_MODEL) or attributes.get(sc.REQUEST_MODEL)
        response_id = attributes.get(sc.RESPONSE_ID)
        usage = (int(attributes.get(sc.USAGE_INPUT_TOKENS) or 0), int(attributes.get(sc.USAGE_OUTPUT_TOKENS) or 0))
    elif attributes.get(sc.OI_SPAN_KIND) == "LLM":
        layer, priority = "openinference", _OPENINFERENCE_PRIORITY
        inputs = from_openinference(attributes, sc.OI_INPUT_MESSAGES)
        outputs = from_openinference(attributes, sc.OI_OUTPUT_MESSAGES)
        if not outputs:
            return None
        output, finish = outputs[0], None
        tools = _openinference_tools(attributes)
        model = attributes.get(sc.OI_MODEL_NAME)
        response_id = _openinference_response_id(attributes.get(sc.OI_OUTPUT_VALUE))
        usage = (int(attributes.get("llm.token_count.prompt") or 0), int(attributes.get("llm.token_count.completion") or 0))
    else:
        return None
    return new_model_call(
        span_id=span.context.span_id,
        start=span.start_time or 0,
        end=span.end_time or span.start_time or 0,
        layer=str(layer),
        priority=priority,
        inputs=inputs,
        output=output,
        finish_reason=finish,
        tools=tools,
        model=str(model) if model else None,
        response_id=str(response_id) if response_id else None,
        usage=usage,
        base=base_of(attributes) if layer != "openinference" else None,
    )


def _tools(definitions: Any, tool_lists: dict[str, list[dict[str, Any]] | None]) -> list[dict[str, Any]] | None:
    """A call's tool definitions (semconv, JSON or parsed) as OpenAI schemas, a list of its own;
    a JSON text already read in this rollout is not parsed again."""
    if isinstance(definitions, str) and definitions in tool_lists:
        tools = tool_lists[definitions]
    else:
        tools = [_tool_schema(t) for t in attribute_value(definitions, [])] or None
        if isinstance(definitions, str):
            tool_lists[definitions] = tools
    return list(tools) if tools else None


def _tool_run(span: Any, attributes: Mapping[str, Any]) -> ToolRun | None:
    if attributes.get(sc.OPERATION_NAME) != sc.OP_EXECUTE_TOOL or sc.LAYER not in attributes:
        return None
    result = attributes.get(sc.TOOL_CALL_RESULT)
    return ToolRun(
        name=attributes.get(sc.TOOL_NAME),
        call_id=attributes.get(sc.TOOL_CALL_ID),
        result=result if result is None or isinstance(result, str) else json.dumps(result),
        error=attributes.get(sc.ERROR_TYPE),
        start=span.start_time or 0,
        end=span.end_time or 0,
        layer=str(attributes.get(sc.LAYER)),
    )


def attribute_value(value: Any, default: Any) -> Any:
    """A JSON-valued attribute, parsed (a value already parsed is returned as it is)."""
    if value is None:
        return default
    return json.loads(value) if isinstance(value, str) else value


def _tool_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """Semconv tool definition (flat) -> OpenAI tool schema."""
    if "function" in tool:
        return dict(tool)
    function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": tool.get("type", "function"), "function": function}


def _openinference_tools(attributes: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools: list[dict[str, Any]] = []
    while (key := f"{sc.OI_TOOLS}.{len(tools)}.tool.json_schema") in attributes:
        tools.append(_tool_schema(json.loads(attributes[key])))
    return tools or None


def _openinference_response_id(value: Any) -> str | None:
    """The chat-completion id inside OpenInference's ``output.value`` JSON, when there."""
    if not isinstance(value, str) or not value.startswith("{"):
        return None
    try:
        data = json.loads(value)
    except ValueError:
        return None
    if isinstance(data, dict) and "choices" in data and isinstance(data.get("id"), str):
        return data["id"]
    return _find_response_metadata_id(data, depth=0)


def _find_response_metadata_id(data: Any, depth: int) -> str | None:
    if depth > 8:
        return None
    if isinstance(data, dict):
        metadata = data.get("response_metadata")
        if isinstance(metadata, dict) and isinstance(metadata.get("id"), str):
            return metadata["id"]
        values: Iterable[Any] = data.values()
    elif isinstance(data, list):
        values = data
    else:
        return None
    return next(filter(None, (_find_response_metadata_id(value, depth + 1) for value in values)), None)


# -- dedupe, join, chains ---------------------------------------------------------------------
def _resolve_deltas(calls: list[ModelCall], tally: _ErrorTally) -> None:
    """Full inputs for calls whose span stored a delta (``input_delta.py``): base prefix + own tail.

    Iterative (a chain is as long as the rollout); inputs and keys of a chain share their items.
    Calls usually come in call order, their base resolved already: one lookup each.
    """
    by_span = {call.span_id: call for call in calls}
    for call in calls:
        if call.base is None:
            continue
        base = by_span.get(call.base[0])
        if base is not None and base.base is None:
            _apply_base(call, base, tally)
            continue
        chain = []
        current: ModelCall | None = call
        while current is not None and current.base is not None and current not in chain:
            chain.append(current)
            current = by_span.get(current.base[0])
        for link in reversed(chain):
            _apply_base(link, by_span.get(link.base[0]), tally)  # type: ignore[index]


def _apply_base(call: ModelCall, base: ModelCall | None, tally: _ErrorTally) -> None:
    """``call``'s full input: the first ``prefix`` messages of its (resolved) base's, then its own."""
    prefix = call.base[1]  # type: ignore[index]
    call.base = None
    if base is None or base.base is not None or prefix > len(base.inputs):
        tally.add("capture_input_base_missing", LookupError(f"span {call.span_id:016x}: base input unavailable"))
        return
    call.inputs = base.inputs[:prefix] + call.inputs
    call.keys = base.keys[:prefix] + call.keys


def _same_call(a: ModelCall, b: ModelCall) -> bool:
    if a.response_id and b.response_id:
        return a.response_id == b.response_id
    if a.start > b.end or b.start > a.end:
        return False
    if canonical(a.output) != canonical(b.output):
        return False
    return not a.keys or not b.keys or a.keys[-1] == b.keys[-1]


def _dedupe(calls: list[ModelCall]) -> tuple[list[ModelCall], int]:
    """Calls seen by two layers, kept once (the layer closest to the wire): each call's twin is the
    first kept call :func:`_same_call` says it is.

    Indexed so a long rollout is not quadratic: two calls that both have a response id are the
    same call exactly when the ids are equal (one dict lookup); only kept calls without an id are
    compared one by one.
    """
    kept: list[ModelCall] = []
    by_id: dict[str, int] = {}  # response id -> the first kept call with it
    without_id: list[int] = []  # kept calls with no response id, in order
    duplicates = 0
    for call in sorted(calls, key=lambda c: c.priority):
        if call.response_id:
            index = by_id.get(call.response_id)
            for other in without_id:
                if index is not None and other > index:
                    break
                if _same_call(kept[other], call):
                    index = other
                    break
        else:
            index = next((i for i, k in enumerate(kept) if _same_call(k, call)), None)
        if index is None:
            if call.response_id:
                by_id.setdefault(call.response_id, len(kept))
            else:
                without_id.append(len(kept))
            kept.append(call)
            continue
        twin = kept[index]
        duplicates += 1
        twin.duplicates += 1
        twin.tools = twin.tools or call.tools
        if not twin.response_id and call.response_id:  # the twin is compared by this id from now on
            twin.response_id = call.response_id
            without_id.remove(index)
            if by_id.get(call.response_id, index + 1) > index:
                by_id[call.response_id] = index
        twin.finish_reason = twin.finish_reason or call.finish_reason
        twin.alias_span_ids.append(call.span_id)
    return kept, duplicates


def _join_records(calls: list[ModelCall], records: Iterable[Any], tally: _ErrorTally) -> None:
    by_span: dict[int, Any] = {}
    by_response: dict[str, Any] = {}
    for record in records:
        if record.span_id is not None:
            by_span[record.span_id] = record
        if record.response_id:
            by_response.setdefault(record.response_id, record)
    for call in calls:
        record = call.record or by_span.get(call.span_id)  # set already on a hook's record
        for alias in call.alias_span_ids:
            record = record or by_span.get(alias)
        if record is None and call.response_id:
            record = by_response.get(call.response_id)
        if record is not None and record.token_ids is not None and record.logprobs is not None:
            if len(record.token_ids) != len(record.logprobs):
                tally.add("token_record_length", ValueError("token_ids and logprobs differ in length"))
        call.record = record


def _chains(calls: list[ModelCall]) -> list[list[ModelCall]]:
    """Group calls (in time order) into conversations: a call joins the longest chain whose
    last call's input + output its own input starts with.

    A chain's continuation always starts with its first call's first message, so chains are
    indexed by that key: a call is compared only with the chains it could continue."""
    chains: list[list[ModelCall]] = []
    expected_of: list[list[tuple[Any, ...]]] = []  # each chain's last call's expected(), computed once
    by_first: dict[Any, list[int]] = {}
    for call in calls:
        best = -1
        best_length = -1
        for index in by_first.get(_index_key(call.keys[0]), ()) if call.keys else ():
            expected = expected_of[index]
            if len(expected) > best_length and call.keys[: len(expected)] == expected:
                best, best_length = index, len(expected)
        if best < 0:
            chains.append([call])
            expected_of.append(call.expected())
            by_first.setdefault(_index_key(expected_of[-1][0]), []).append(len(chains) - 1)
        else:
            chains[best].append(call)
            expected_of[best] = call.expected()
    return chains


def _index_key(key: tuple[Any, ...]) -> Any:
    """A message's comparison key as a dict key (a malformed span may hold an unhashable name)."""
    try:
        hash(key)
    except TypeError:
        return repr(key)
    return key


def _choice(call: ModelCall) -> Choice:
    record = call.record
    return Choice(
        message=call.output,
        token_ids=getattr(record, "token_ids", None),
        prompt_token_ids=getattr(record, "prompt_token_ids", None),
        logprobs=getattr(record, "logprobs", None),
        sampling=getattr(record, "sampling", None),
        finish_reason=call.finish_reason,
        response_id=call.response_id,
        model=call.model,
    )


def _history(chain: list[ModelCall], tools: list[ToolRun]) -> History:
    last = chain[-1]
    items: list[Any] = [dict(m) for m in last.inputs]
    for call in chain[:-1]:
        position = len(call.inputs)
        if position < len(items):
            items[position] = _choice(call)
    items.append(_choice(last))
    items.extend(_trailing_tool_messages(last, tools))
    return History(messages_and_choices=items, tools=last.tools)


def _trailing_tool_messages(last: ModelCall, tools: list[ToolRun]) -> list[dict[str, Any]]:
    """Tool results produced after the last model call, for the tool calls it made."""
    wanted = [
        (call.get("id"), (call.get("function") or {}).get("name")) for call in last.output.get("tool_calls") or ()
    ]
    if not wanted:
        return []
    messages: list[dict[str, Any]] = []
    seen_ids: set[str] = set()
    for run in tools:
        if run.start < last.end or not wanted:
            continue
        match = next((w for w in wanted if run.call_id and w[0] == run.call_id), None)
        if match is None and not run.call_id:
            match = next((w for w in wanted if w[1] == run.name), None)
        if match is None or (match[0] and match[0] in seen_ids):
            continue
        wanted.remove(match)
        if match[0]:
            seen_ids.add(match[0])
        content = run.result if run.error is None else f"Error: {run.error}: {run.result or ''}".rstrip(": ")
        messages.append({"role": "tool", "tool_call_id": match[0], "content": content or ""})
    return messages
