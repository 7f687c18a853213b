"""Each family's tool-call format read from text (``tracerl.inference.tool_formats``): what is not a
valid call stays text; the real templates' own turns are read back in ``test_family_matrix.py``."""

from __future__ import annotations

import json

import pytest

from tracerl.inference.tool_formats import parse_turn


def _calls(parsed):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls]


def test_hermes_with_reasoning_and_text():
    parsed = parse_turn('<think>\nplan\n</think>\n\nLooking.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "hermes")
    assert (parsed.reasoning_content, parsed.content, _calls(parsed)) == ("plan", "Looking.", [("f", {"a": 1})])
    assert parse_turn("<think>x</think>Just text.<|im_end|>", "hermes", end_markers=("<|im_end|>",)).content == "Just text."


def test_llama3_json_calls_and_what_is_not_one():
    assert _calls(parse_turn('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', "llama3")) == [
        ("f", {"a": 1}), ("g", {})]  # fmt: skip
    for text in ('{"name": "f", "parameters": {"a": 1}', "{not json}", '{"parameters": {}}', "Hello {there}"):
        parsed = parse_turn(text, "llama3")
        assert parsed.tool_calls == [] and parsed.content == text


def test_mistral_calls_keep_their_ids_and_the_text_before():
    parsed = parse_turn('Sure. [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}, "id": "abcdefghi"}]</s>', "mistral", end_markers=("</s>",))
    assert (parsed.content, _calls(parsed), parsed.tool_calls[0]["id"]) == ("Sure.", [("f", {"a": 1})], "abcdefghi")
    broken = '[TOOL_CALLS][{"name": "f", "arguments": "not an object"}]'
    assert parse_turn(broken, "mistral").tool_calls == [] and parse_turn(broken, "mistral").content == broken


def test_harmony_final_answer_call_and_malformed_arguments():
    final = "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>"
    parsed = parse_turn(final, "harmony")
    assert (parsed.reasoning_content, parsed.content, parsed.tool_calls) == ("think", "Done.", [])
    call = '<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"a": 1}<|call|>'
    assert _calls(parse_turn(call, "harmony")) == [("f", {"a": 1})]
    bad = call.replace('{"a": 1}', "{oops")
    assert parse_turn(bad, "harmony").tool_calls == [] and parse_turn(bad, "harmony").content == bad
    assert parse_turn("plain words", "harmony").content == "plain words"


def test_an_unknown_format_is_named():
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'.*hermes, llama3, mistral, harmony"):
        parse_turn("x", "xml")  # type: ignore[arg-type]


def test_a_semicolon_inside_an_argument_is_not_a_separator():
    parsed = parse_turn('{"name": "f", "parameters": {"q": "a;b"}};{"name": "g", "parameters": {}}', "llama3")
    assert _calls(parsed) == [("f", {"q": "a;b"}), ("g", {})]


def test_the_servers_reader_splits_reasoning_only_where_the_template_reads_it_back():
    """``TurnReader`` (both servers): text without calls or reasoning is returned as sampled; a ``<think>``
    block is reasoning only for a reasoning template, else it stays where the model wrote it."""
    from tracerl.inference.turns import TurnReader

    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    thinking = TurnReader(tokenizer=None, tool_call_format="hermes", reasoning=True)
    plain = TurnReader(tokenizer=None, tool_call_format="hermes", reasoning=False)
    assert plain.message([], "  Hi there. ", parse_tools=True) == {"role": "assistant", "content": "  Hi there. "}
    said = thinking.message([], "<think>plan</think>\n" + call, parse_tools=True)
    assert (said["reasoning_content"], said["content"], said["tool_calls"][0]["function"]["name"]) == ("plan", None, "f")
    kept = plain.message([], "<think>plan</think>\n" + call, parse_tools=True)
    assert "reasoning_content" not in kept and kept["content"] == "<think>plan</think>" and len(kept["tool_calls"]) == 1
    assert thinking.message([], "<think>a</think>Paris.", parse_tools=False) == {
        "role": "assistant", "content": "Paris.", "reasoning_content": "a"}  # fmt: skip
    assert plain.message([], call, parse_tools=False)["content"] == call  # tool_choice "none": calls stay text
