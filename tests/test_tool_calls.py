"""Hermes tool-call parsing, and that re-rendering a parsed call reproduces the sampled text."""

from __future__ import annotations

import json

import pytest

from tracerl.inference.tool_calls import parse_tool_calls


def test_plain_text_is_content_only():
    parsed = parse_tool_calls("The answer is 4.")
    assert parsed.content == "The answer is 4."
    assert parsed.tool_calls == []


def test_one_call_parsed_into_openai_shape():
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed.content is None
    (call,) = parsed.tool_calls
    assert call["type"] == "function"
    assert call["id"].startswith("call_") and len(call["id"]) > 10
    assert call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}


def test_arguments_keep_the_models_exact_text():
    odd = '{"b":3,  "a" : [1,2]}'
    text = '<tool_call>\n{"name": "f", "arguments": ' + odd + "}\n</tool_call>"
    (call,) = parse_tool_calls(text).tool_calls
    assert call["function"]["arguments"] == odd


def test_content_and_several_calls():
    text = (
        "Let me check.\n"
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"x": "y"}}\n</tool_call>'
    )
    parsed = parse_tool_calls(text)
    assert parsed.content == "Let me check."
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["a", "b"]
    assert len({c["id"] for c in parsed.tool_calls}) == 2


def test_unterminated_last_block_with_complete_json():
    parsed = parse_tool_calls('<tool_call>\n{"name": "a", "arguments": {"k": 1}}\n')
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["a"]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "a", "arguments": {"k": 1}\n</tool_call>',  # missing brace
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n["a"]\n</tool_call>',
        '<tool_call>\n{"name": "a", "arguments": 3}\n</tool_call>',
    ],
)
def test_malformed_blocks_stay_content(text):
    parsed = parse_tool_calls(text)
    assert parsed.tool_calls == []
    assert parsed.content == text


def test_malformed_block_kept_beside_a_good_one():
    bad = "<tool_call>\n{oops}\n</tool_call>"
    good = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'
    parsed = parse_tool_calls(bad + "\n" + good)
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["a"]
    assert parsed.content == bad


def test_arguments_given_as_a_json_string_pass_through():
    text = '<tool_call>\n{"name": "a", "arguments": "{\\"k\\": 1}"}\n</tool_call>'
    (call,) = parse_tool_calls(text).tool_calls
    assert json.loads(call["function"]["arguments"]) == {"k": 1}


def test_rerendering_a_parsed_turn_reproduces_the_sampled_text():
    """The shipped template writes the arguments string raw: parse → render is the identity."""
    jinja2 = pytest.importorskip("jinja2")
    from tracerl.base_models import tool_chat_template

    sampled = (
        "I will add them.\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 2,"b":  3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    )
    parsed = parse_tool_calls(sampled)
    message = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls}
    env = jinja2.Environment()
    env.filters["tojson"] = lambda value: json.dumps(value)
    rendered = env.from_string(tool_chat_template()).render(
        messages=[{"role": "user", "content": "hi"}, message], add_generation_prompt=False
    )
    assert "<|im_start|>assistant\n" + sampled + "<|im_end|>\n" in rendered


def test_vllm_proxy_asks_for_token_truth_and_parses_tool_calls_itself():
    pytest.importorskip("fastapi")
    from tracerl.inference.turns import TurnReader
    from tracerl.inference.vllm_proxy import finish_chat_body, prepare_chat_body

    body = {"model": "base", "messages": [], "tools": [{"type": "function", "function": {"name": "add"}}]}
    assert prepare_chat_body(body, "agent", {"agent", "base"}) is True
    assert body["model"] == "agent" and body["return_token_ids"] is True and body["logprobs"] is True
    assert body["tool_choice"] == "none"  # vLLM renders the tools; tracerl parses the text
    plain = {"model": "agent@2", "messages": [], "tools": [{"type": "function"}], "tool_choice": "none"}
    assert prepare_chat_body(plain, "agent", {"agent", "base"}) is False and plain["model"] == "agent@2"

    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    result = {
        "prompt_token_ids": [1, 2],
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
    }
    hermes = TurnReader(tokenizer=None, tool_call_format="hermes", reasoning=False)  # the reader of a Hermes template
    (choice,) = finish_chat_body(result, parse_tools=True, turns=hermes)["choices"]
    assert choice["prompt_token_ids"] == [1, 2]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
