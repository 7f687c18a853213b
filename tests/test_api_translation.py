"""The Responses and Messages translations on their own (no model): every shape, every refusal.

``tests/test_api_protocols.py`` runs them through the vendors' SDKs on the real model; here
each request shape is held against the chat request it must become, and each answer shape
against the chat completion it came from.
"""

from __future__ import annotations

import json

import pytest

from tracerl.inference import messages_api, responses_api
from tracerl.net.http_server import OpenAIError, key_matches, presented_key

CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1,  "b": 2}'}}


def completion(message: dict, finish: str = "stop", **choice_extra) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish, "token_ids": [5, 6, 2],
              "logprobs": {"content": [{"token": t, "logprob": lp} for t, lp in (("a", -0.5), ("b", -0.25), ("", -0.125))]},
              **choice_extra}  # fmt: skip
    usage = {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    return {"id": "chatcmpl-1", "model": "agent", "choices": [choice], "usage": usage, "prompt_token_ids": [1, 2, 3, 4]}


# -- Responses -----------------------------------------------------------------------------------------------
def test_responses_input_items_become_chat_messages():
    store = responses_api.ResponseStore()
    turn = responses_api.chat_request({
        "model": "agent", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0.5, "store": False,
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Add 1 "}, {"type": "input_text", "text": "and 2."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Calling."}]},
            {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 1,  "b": 2}'},
            {"type": "function_call", "call_id": "call_2", "name": "add", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "3"},
        ],
        "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}, "strict": True}], "tool_choice": "required",
    }, store)  # fmt: skip
    assert turn.chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Add 1 and 2."},
        {"role": "assistant", "content": "Calling.", "tool_calls": [
            CALL, {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]  # fmt: skip
    assert turn.chat["tools"] == [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    assert turn.chat["tool_choice"] == "required" and turn.chat["max_tokens"] == 9 and turn.chat["temperature"] == 0.5
    assert turn.chat["logprobs"] is True and turn.chat["return_token_ids"] is True


def test_responses_answer_carries_the_sampled_tokens_and_is_remembered():
    store = responses_api.ResponseStore()
    turn = responses_api.chat_request({"model": "agent", "input": "Add 1 and 2.", "tools": [
        {"type": "function", "name": "add", "parameters": {"type": "object"}}]}, store)  # fmt: skip
    response = responses_api.response_from_chat(completion({"content": None, "tool_calls": [CALL]}, "tool_calls"), turn, store)
    assert [item["type"] for item in response["output"]] == ["function_call"]
    assert response["output"][0]["arguments"] == CALL["function"]["arguments"]  # the model's own text
    assert (response["prompt_token_ids"], response["token_ids"], response["token_logprobs"]) == ([1, 2, 3, 4], [5, 6, 2], [-0.5, -0.25, -0.125])
    assert response["usage"]["input_tokens"] == 4 and response["usage"]["output_tokens"] == 3 and response["status"] == "completed"
    follow = responses_api.chat_request({"model": "agent", "previous_response_id": response["id"],
                                         "input": [{"type": "function_call_output", "call_id": "call_1", "output": "3"}]}, store)  # fmt: skip
    assert follow.chat["messages"] == [{"role": "user", "content": "Add 1 and 2."}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                                       {"role": "tool", "tool_call_id": "call_1", "content": "3"}]  # fmt: skip


def test_a_strict_tool_gets_no_call_whose_arguments_miss_required_keys():
    store = responses_api.ResponseStore()
    tools = [{"type": "function", "name": "add", "parameters": {"type": "object", "required": ["a", "b", "c"]}, "strict": True}]
    turn = responses_api.chat_request({"model": "agent", "input": "x", "tools": tools}, store)
    response = responses_api.response_from_chat(completion({"content": None, "tool_calls": [CALL]}, "tool_calls"), turn, store)
    (item,) = response["output"]
    assert item["type"] == "message"
    assert item["content"][0]["text"] == '<tool_call>\n{"name": "add", "arguments": {"a": 1,  "b": 2}}\n</tool_call>'


def test_a_length_cut_answer_is_incomplete_and_streams_in_the_apis_order():
    store = responses_api.ResponseStore()
    turn = responses_api.chat_request({"model": "agent", "input": "x", "include": ["message.output_text.logprobs"]}, store)
    response = responses_api.response_from_chat(completion({"content": "ab"}, "length"), turn, store)
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [lp["logprob"] for lp in response["output"][0]["content"][0]["logprobs"]] == [-0.5, -0.25, -0.125]
    events = [json.loads(chunk.split("data: ", 1)[1]) for chunk in responses_api.response_events(response)]
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["response"] == response


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"input": "x", "tools": [{"type": "file_search"}]}, "file_search"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "x", "text": {"format": {"type": "json_object"}}}, "json_object"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "seed": 3}, "unsupported field"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "'reasoning' are not supported"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input_image"),
        ({"input": [{"type": "function_call", "name": "add"}]}, "call_id"),
        ({}, "'input' is required"),
    ],
)
def test_responses_refusals_name_the_field(body, says):
    with pytest.raises(OpenAIError, match=says) as raised:
        responses_api.chat_request({"model": "agent", **body}, responses_api.ResponseStore())
    assert raised.value.status == 400


def test_the_response_store_is_bounded_and_says_what_to_do():
    store = responses_api.ResponseStore(max_items=2)
    for name in ("a", "b", "c"):
        store.put(name, [{"role": "user", "content": name}])
    assert store.get("c") == [{"role": "user", "content": "c"}]
    with pytest.raises(OpenAIError, match="remembers its last 2 responses.*send the conversation as input") as raised:
        store.get("a")
    assert raised.value.status == 404


# -- Messages ------------------------------------------------------------------------------------------------
def test_messages_blocks_become_chat_messages_with_the_written_arguments():
    calls = messages_api.CallTexts()
    calls.put("call_1", CALL["function"]["arguments"])  # what the model wrote (two spaces)
    turn = messages_api.chat_request({
        "model": "agent", "max_tokens": 8, "system": [{"type": "text", "text": "Be brief."}], "stop_sequences": ["\n\n"],
        "tools": [{"name": "add", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"}, "top_k": 5,
        "messages": [
            {"role": "user", "content": "Add 1 and 2."},
            {"role": "assistant", "content": [{"type": "text", "text": "Calling."},
                                              {"type": "tool_use", "id": "call_1", "name": "add", "input": {"a": 1, "b": 2}},
                                              {"type": "tool_use", "id": "call_9", "name": "add", "input": {"a": 5}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": [{"type": "text", "text": "3"}]},
                                         {"type": "tool_result", "tool_use_id": "call_9", "content": "5"},
                                         {"type": "text", "text": "Thanks."}]},
        ],
    }, calls)  # fmt: skip
    assert turn.chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add 1 and 2."},
        {"role": "assistant", "content": "Calling.", "tool_calls": [
            CALL, {"id": "call_9", "type": "function", "function": {"name": "add", "arguments": '{"a": 5}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
        {"role": "tool", "tool_call_id": "call_9", "content": "5"},
        {"role": "user", "content": "Thanks."},
    ]  # fmt: skip
    assert turn.chat["tool_choice"] == "required" and turn.chat["stop"] == ["\n\n"] and turn.chat["top_k"] == 5
    changed = messages_api.chat_request({"model": "agent", "max_tokens": 8, "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "add", "input": {"a": 2, "b": 2}}]}]}, calls)  # fmt: skip
    assert changed.chat["messages"][0]["tool_calls"][0]["function"]["arguments"] == '{"a": 2, "b": 2}'  # edited: not the old text


def test_messages_answer_and_its_events():
    calls = messages_api.CallTexts()
    turn = messages_api.chat_request({"model": "agent", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}, calls)
    message = messages_api.message_from_chat(completion({"content": "Sure.", "tool_calls": [CALL]}, "tool_calls"), turn, calls)
    assert message["content"] == [{"type": "text", "text": "Sure."}, {"type": "tool_use", "id": "call_1", "name": "add", "input": {"a": 1, "b": 2}}]
    assert message["stop_reason"] == "tool_use" and message["token_ids"] == [5, 6, 2] and message["prompt_token_ids"] == [1, 2, 3, 4]
    assert calls.arguments("call_1", {"a": 1, "b": 2}) == CALL["function"]["arguments"]
    stopped = messages_api.chat_request({"model": "agent", "max_tokens": 8, "stop_sequences": ["END"], "messages": [{"role": "user", "content": "x"}]}, calls)
    assert messages_api.message_from_chat(completion({"content": "a"}, stop_reason="END"), stopped, calls)["stop_reason"] == "stop_sequence"
    assert messages_api.message_from_chat(completion({"content": "a"}, "length"), turn, calls)["stop_reason"] == "max_tokens"
    events = [chunk.split("\n")[0].removeprefix("event: ") for chunk in messages_api.message_events(message)]
    assert events == ["message_start", "content_block_start", "content_block_delta", "content_block_stop", "content_block_start",
                      "content_block_delta", "content_block_stop", "message_delta", "message_stop"]  # fmt: skip


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"seed": 1}, "unsupported field"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "'document' blocks"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "y", "input": {}}]}]}, "'tool_use' blocks"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "client tools"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ],
)
def test_messages_refusals_name_the_field(body, says):
    base = {"model": "agent", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(OpenAIError, match=says):
        messages_api.chat_request({**base, **body}, messages_api.CallTexts())
    error = OpenAIError("nope", status=401)
    assert messages_api.error_body(error) == {"type": "error", "error": {"type": "authentication_error", "message": "nope"}}


def test_either_sdks_key_header_is_accepted():
    assert presented_key([(b"authorization", b"Bearer k1")]) == "k1"
    assert presented_key({"x-api-key": "k2"}) == "k2"
    assert presented_key({}) == ""
    assert key_matches([(b"x-api-key", b"secret")], "secret") and not key_matches([(b"x-api-key", b"secreT")], "secret")
    assert not key_matches([(b"authorization", b"Basic secret")], "secret")
