"""The stand-in's port of Langfuse's tool normalisation (``tests/langfuse_tools.py``) gives what
Langfuse's own tests expect: cases taken from Langfuse's ``worker/src/__tests__/extractToolsBackend
.test.ts`` (``normalizeToolsForObservation``), so the export tests check tracerl against Langfuse's
behaviour, not against our reading of it."""

from __future__ import annotations

import json

from langfuse_tools import normalize_tools

WEATHER = {"type": "function", "name": "get_weather", "description": "Get weather.", "inputSchema": {"type": "object"}}


def test_ai_sdk_tools_move_from_metadata_to_the_input():
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is the weather in Berlin?"}]}]
    metadata = {"tools": [WEATHER], "attributes": {"ai.prompt.tools": json.dumps([WEATHER]), "custom.attribute": "keep-me"}}
    result = normalize_tools(messages, None, metadata)
    assert result.input == {"messages": messages, "tools": [WEATHER]}
    assert result.metadata == {"attributes": {"custom.attribute": "keep-me"}}


def test_metadata_tools_merge_with_the_inputs_own():
    docs = {"type": "function", "name": "search_docs", "description": "Search docs.", "inputSchema": {"type": "object"}}
    given = {"messages": [{"role": "user", "content": "Need weather and docs"}], "tools": [docs]}
    result = normalize_tools(given, None, {"tools": [WEATHER]})
    assert result.input == {"messages": given["messages"], "tools": [docs, WEATHER]} and result.metadata == {}


def test_indexed_openinference_tools_in_stringified_attributes():
    tool = {"name": "calculator", "description": "Do math.", "parameters": {"type": "object"}}
    messages = [{"role": "user", "content": "Need a calculation"}]
    metadata = {"attributes": json.dumps({"llm.tools.0.tool.json_schema": tool, "custom.attribute": "keep-me"})}
    result = normalize_tools(messages, None, metadata)
    assert result.input == {"messages": messages, "tools": [tool]}
    assert result.metadata == {"attributes": {"custom.attribute": "keep-me"}}


def test_stringified_attributes_without_tool_keys_are_left_as_they_are():
    attributes = json.dumps({"custom.attribute": "mentions model_request_parameters in the value"})
    messages = [{"role": "user", "content": "Need weather"}]
    result = normalize_tools(messages, None, {"tools": [WEATHER], "attributes": attributes})
    assert result.input == {"messages": messages, "tools": [WEATHER]} and result.metadata == {"attributes": attributes}


def test_string_inputs_become_a_prompt_with_tools_and_json_strings_are_parsed():
    metadata = {"attributes": {"ai.prompt.tools": [WEATHER], "custom.attribute": "keep-me"}}
    assert normalize_tools("What is the weather?", None, metadata).input == {"prompt": "What is the weather?", "tools": [WEATHER]}
    messages = [{"role": "user", "content": "Need weather"}]
    assert normalize_tools(json.dumps(messages), None, {"attributes": {"ai.prompt.tools": [WEATHER]}}).input == {
        "messages": messages, "tools": [WEATHER]
    }  # fmt: skip


def test_what_is_not_a_tool_definition_stays_in_the_metadata():
    messages = [{"role": "user", "content": "Need weather"}]
    kept = normalize_tools(messages, None, {"tools": ["hammer"], "attributes": {"ai.prompt.tools": [WEATHER], "x": "y"}})
    assert kept.input == {"messages": messages, "tools": [WEATHER]} and kept.metadata == {"tools": ["hammer"], "attributes": {"x": "y"}}
    generic = {"tools": [{"id": "hammer"}, {"type": "manual"}], "attributes": {"x": "y"}}
    result = normalize_tools(messages, None, generic)
    assert (result.input, result.metadata, result.tool_definitions) == (messages, generic, {})
    unnamed = {"attributes": {"gen_ai.tool.definitions": [{"type": "manual"}], "x": "y"}}
    result = normalize_tools(messages, None, unnamed)
    assert (result.input, result.metadata, result.tool_definitions) == (messages, unnamed, {})


def test_unnamed_provider_tools_stay_in_the_input_but_only_named_ones_are_indexed():
    provider = {"type": "web_search_preview"}
    messages = [{"role": "user", "content": "Need current weather"}]
    result = normalize_tools(messages, None, {"attributes": {"ai.prompt.tools": [WEATHER, provider], "x": "y"}})
    assert result.input == {"messages": messages, "tools": [WEATHER, provider]}
    assert result.metadata == {"attributes": {"x": "y"}} and list(result.tool_definitions) == ["get_weather"]


def test_definitions_from_openai_tools_otel_attributes_and_langgraph_tool_messages():
    openai = {"type": "function", "function": {"name": "get_weather", "description": "Get current weather",
                                               "parameters": {"type": "object", "properties": {"location": {"type": "string"}}}}}  # fmt: skip
    compact = {"separators": (",", ":")}  # JSON.stringify
    assert normalize_tools({"tools": [openai]}, None, {}).tool_definitions == {
        "get_weather": json.dumps({"description": "Get current weather",
                                   "parameters": json.dumps(openai["function"]["parameters"], **compact)}, **compact)
    }  # fmt: skip
    otel = {"attributes": {"gen_ai.tool.definitions": [{"name": "calculator", "description": "Do math", "parameters": {"type": "object"}}]}}
    assert list(normalize_tools(None, None, otel).tool_definitions) == ["calculator"]
    indexed = {"attributes": {f"llm.tools.{i}.tool.json_schema": {"name": f"tool{i + 1}"} for i in range(2)}}
    assert list(normalize_tools(None, None, indexed).tool_definitions) == ["tool1", "tool2"]
    langgraph = [{"role": "user", "content": "Search"}, {"role": "tool", "content": {**openai, "function": {**openai["function"], "name": "web_search"}}}]
    assert list(normalize_tools(langgraph, None, {}).tool_definitions) == ["web_search"]
    assert normalize_tools({"messages": [{"tools": [{"name": "search"}]}, {"tools": [{"name": "search"}]}]}, None, {}).tool_definitions.keys() == {"search"}


def test_tool_calls_from_openai_choices_anthropic_parts_and_langchain_kwargs():
    choices = {"choices": [{"message": {"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}]}
    assert normalize_tools(None, choices, {}).tool_call_names == ["f"]
    anthropic = {"content": [{"type": "tool_use", "id": "t1", "name": "g", "input": {"a": 1}}]}
    result = normalize_tools(None, anthropic, {})
    assert result.tool_call_names == ["g"] and json.loads(result.tool_calls[0])["arguments"] == '{"a":1}'
    kwargs = {"additional_kwargs": {"tool_calls": [{"id": "c2", "function": {"name": "h", "arguments": "{}"}}]}}
    assert normalize_tools(None, kwargs, {}).tool_call_names == ["h"]
    assert normalize_tools(None, [{"id": "x", "name": "not a call"}], {}).tool_call_names == []
