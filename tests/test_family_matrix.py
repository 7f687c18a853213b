"""The supported-models matrix, token level: each family's real tokenizer and template (issue 32).

For each family a multi-turn conversation is forced: every assistant turn is the template's own
rendering of it after the generation prompt, up to the family's end-of-turn token (what the model
would sample to say it).  Tokenized for training, the pinned outcome per family is asserted:

- how the template wants tool-call arguments (objects, or strings kept verbatim);
- whether the turns extend one another (one sequence), or where the template rewrites history
  (a new sequence, counted by cause) — within tool rounds, and after a second user question;
- and, for every family, that the trained tokens are exactly the sampled ones, none drifted.

``docs/supported-models.md`` shows the same cells; the last test keeps it true to :data:`EXPECTED`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tracerl
from family_helpers import family_conversation, forced_turns
from tracerl.families.files import is_installed, last_failure
from tracerl.inference.chat_template import wants_object_arguments
from tracerl.train.tokenization import TokenizeStats, render_ids, tokenize_trajectory

pytest.importorskip("transformers")

DOC = Path(__file__).resolve().parents[1] / "docs" / "supported-models.md"
EXPECTED = {
    # family: (arguments the template wants, breaks within the tool rounds, breaks after a second question)
    "qwen3": ("string", {}, {"sampled_tokens_rerendered": 1}),
    "qwen2.5": ("object", {}, {}),
    "gemma3": (None, {}, {}),
    "gptoss": ("object", {}, {"sampled_tokens_rerendered": 1}),
    "llama3": ("object", {}, {}),
    "mistral": ("object", {"context_rewritten": 1}, {"context_rewritten": 2}),
}
"""Gemma 3's template has no tool format (``None``): its conversation is plain turns."""
CELLS = {"string": "strings, verbatim", "object": "objects", None: "no tool format"}
REASONING = {"qwen3": "`<think>` → `reasoning_content`", "gptoss": "analysis channel → `reasoning_content`"}
"""The families whose replies' reasoning the servers split off (the template writes it back); the rest: none."""


@pytest.fixture(scope="module", params=list(EXPECTED))
def family(request):
    name = request.param
    if not is_installed(name):
        pytest.skip(f"{name}'s files are not installed ({last_failure(name) or 'make install-model-files'})")
    from tracerl.families.files import family_dir
    from transformers import AutoTokenizer

    return name, AutoTokenizer.from_pretrained(family_dir(name))


def test_tool_call_arguments_are_given_as_the_template_writes_them(family):
    name, tokenizer = family
    wanted = EXPECTED[name][0]
    if wanted is not None:
        assert wants_object_arguments(tokenizer) == (wanted == "object")
        messages, tools = family_conversation(name, follow_up=False)
        history = tokenizer.decode(render_ids(tokenizer, messages, tools, add_generation_prompt=False))
        assert '{"city": "Paris"}' in history and '\\"city\\"' not in history  # never a quoted, escaped string


@pytest.mark.parametrize("follow_up", [False, True], ids=["tool rounds", "second question"])
def test_turns_extend_each_other_or_break_by_cause_and_nothing_drifts(family, follow_up):
    name, tokenizer = family
    messages, tools = family_conversation(name, follow_up=follow_up)
    trajectory = tracerl.Trajectory(messages_and_choices=forced_turns(tokenizer, name, messages, tools), tools=tools, reward=0)
    stats = TokenizeStats()
    sequences = tokenize_trajectory(trajectory, tokenizer, stats=stats)
    assert dict(stats.breaks) == EXPECTED[name][2 if follow_up else 1]
    assert len(sequences) == 1 + sum(stats.breaks.values())
    sampled = [t for c in trajectory.messages_and_choices if isinstance(c, tracerl.Choice) for t in c.token_ids]
    assert [t for s in sequences for t, w in zip(s.token_ids, s.weights) if w > 0] == sampled
    assert stats.sampled_tokens == len(sampled) and not stats.dropped_tokens


def test_the_documented_matrix_is_the_tested_one():
    rows = {line.split("|")[1].strip().strip("`"): line for line in DOC.read_text().splitlines() if line.startswith("| `")}
    for name, (arguments, rounds, second) in EXPECTED.items():
        row = rows[name]
        assert CELLS[arguments] in row and (f"`{FORMATS[name]}`" if FORMATS[name] else "| none |") in row, (name, row)
        assert f"| {REASONING.get(name, 'none')} |" in row, (name, row)
        for breaks in (rounds, second):
            assert ("kept" if not breaks else ", ".join(f"{cause} ×{n}" for cause, n in breaks.items())) in row, (name, row)


def test_arguments_that_are_not_a_json_object_stay_strings(family):
    from tracerl.inference.chat_template import template_messages

    name, tokenizer = family
    plain = [{"role": "user", "content": "hi"}]
    assert template_messages(tokenizer, plain) is plain  # nothing to convert: the same list
    calls = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call00001", "type": "function", "function": {"name": "f", "arguments": text}} for text in ("not json", "[1]", '{"a": 1}')]}]  # fmt: skip
    arguments = [c["function"]["arguments"] for c in template_messages(tokenizer, calls)[0]["tool_calls"]]
    assert arguments == ["not json", "[1]", {"a": 1} if EXPECTED[name][0] == "object" else '{"a": 1}']
    assert calls[0]["tool_calls"][2]["function"]["arguments"] == '{"a": 1}'  # the caller's messages are not changed


FORMATS = {"qwen3": "hermes", "qwen2.5": "hermes", "gemma3": None, "gptoss": "harmony", "llama3": "llama3", "mistral": "mistral"}
"""The tool-call format each family's template renders (``tracerl.inference.tool_formats.detect_format``)."""


def test_each_sampled_turn_reads_back_as_the_message_it_was(family):
    """Each forced turn, read by the servers' own reader (its token ids, and their text as the server
    decodes it) comes back as its message: the calls' names and arguments, the text, and the reasoning
    where the family writes it back (Qwen3's ``<think>``, gpt-oss's analysis channel), nowhere else."""
    import json

    from tracerl.families.models import stop_token_ids
    from tracerl.inference.tool_formats import detect_format
    from tracerl.inference.turns import TurnReader

    name, tokenizer = family
    assert detect_format(tokenizer) == FORMATS[name]
    reader = TurnReader.for_tokenizer(tokenizer, end_ids=set(stop_token_ids(tokenizer, name)))
    assert reader.settings == {"tool_call_parser": FORMATS[name] or "hermes", "reasoning": name in REASONING}
    messages, tools = family_conversation(name, follow_up=False)
    for choice in (c for c in forced_turns(tokenizer, name, messages, tools) if isinstance(c, tracerl.Choice)):
        shown = tokenizer.decode(choice.token_ids[:-1], skip_special_tokens=True)  # the engine's text: the end token dropped
        read = reader.message(choice.token_ids, shown, parse_tools=tools is not None)
        message, raw = choice.message, tokenizer.decode(choice.token_ids, skip_special_tokens=False)
        wanted = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in read.get("tool_calls", [])] == wanted, raw
        assert (read["content"] or "") == (message.get("content") or ""), raw
        assert read.get("reasoning_content") == (message.get("reasoning_content") or message.get("thinking") if reader.reasoning else None), raw


def test_the_vllm_proxy_reads_a_reply_with_the_same_reader(family):
    """vLLM is asked for text and token ids; its proxy reads the reply from the ids as the transformers
    server does, so a family's tool calls come back as ``tool_calls`` from either server."""
    from tracerl.families.models import stop_token_ids
    from tracerl.inference.turns import TurnReader
    from tracerl.inference.vllm_proxy import finish_chat_body

    name, tokenizer = family
    messages, tools = family_conversation(name, follow_up=False)
    if tools is None:
        pytest.skip(f"{name}'s template renders no tool calls")
    reader = TurnReader.for_tokenizer(tokenizer, end_ids=set(stop_token_ids(tokenizer, name)))
    choice = next(c for c in forced_turns(tokenizer, name, messages, tools) if isinstance(c, tracerl.Choice))
    body = {"prompt_token_ids": choice.prompt_token_ids, "choices": [{
        "index": 0, "finish_reason": "stop", "token_ids": choice.token_ids,
        "message": {"role": "assistant", "content": tokenizer.decode(choice.token_ids, skip_special_tokens=True)}}]}  # fmt: skip
    answer = finish_chat_body(body, True, reader)["choices"][0]
    assert answer["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in answer["message"]["tool_calls"]] == ["get_weather"]
    assert answer["prompt_token_ids"] == choice.prompt_token_ids
    untouched = finish_chat_body({"choices": [{"index": 0, "finish_reason": "stop", "token_ids": choice.token_ids,
                                               "message": {"role": "assistant", "content": "plain"}}]}, False, reader)  # fmt: skip
    assert "tool_calls" not in untouched["choices"][0]["message"]  # tool_choice "none": calls stay text
