"""``redact.redact_message``: the inline check of a chat message gives :func:`redact`'s answer, object
identity included (an unchanged message is returned as itself), on random messages of every shape."""

from __future__ import annotations

import copy
import random

from tracerl import redact as r

KEY = "sk-proj-" + "a1B2" * 10
TEXTS = [
    "be brief", "What is the capital of France?", "ok", "", "assistant", f"use {KEY} now", "api_key=abcd1234efgh",
    "Authorization: Bearer abcdef123456789", "the key to the city", "token budget left: 5", "x" * 300, "call_5866eb4ba3",
    '{"query": "weather in Paris"}', '{"password": "hunter2hunter2"}', "résumé naïve ünïcödé", "tab\tand\nnewline",
]  # fmt: skip


def _text(rng: random.Random) -> str:
    text = rng.choice(TEXTS)
    return text + str(rng.randrange(10**6)) if rng.random() < 0.3 else text  # fresh texts, not only remembered ones


def _value(rng: random.Random) -> object:
    return rng.choice([_text(rng), None, 0, 1.5, True, [_text(rng)], {"text": _text(rng)}, ""])


def _call(rng: random.Random) -> object:
    shape = rng.random()
    if shape < 0.05:
        return _text(rng)  # not a dict
    call: dict = {"id": _text(rng), "type": "function"}
    arguments = rng.choice([_text(rng), None, {"q": _text(rng)}, 3])
    function = {"name": rng.choice(["lookup", "get_secret", _text(rng)]), "arguments": arguments}
    if rng.random() < 0.1:
        function[rng.choice(["description", "api_key", "strict"])] = _value(rng)
    call["function"] = function if rng.random() > 0.05 else _text(rng)
    if rng.random() < 0.1:
        call[rng.choice(["index", "token", "extra"])] = _value(rng)
    if rng.random() < 0.05:
        del call["id"]
    return call


def _message(rng: random.Random) -> object:
    if rng.random() < 0.03:
        return rng.choice([_text(rng), [{"role": "user", "content": _text(rng)}], None, 7])
    message: dict = {"role": rng.choice(["system", "user", "assistant", "tool", "assistant_with_long_role"])}
    message["content"] = rng.choice([_text(rng), None, [{"type": "text", "text": _text(rng)}], 5])
    if rng.random() < 0.4:
        message["tool_calls"] = [_call(rng) for _ in range(rng.randrange(0, 3))] if rng.random() > 0.05 else _text(rng)
    for key in rng.sample(["name", "tool_call_id", "refusal", "api_key", "password", "index", "metadata", "audio"], rng.randrange(0, 3)):
        message[key] = _value(rng)
    return message


def _check(message: object) -> None:
    before = copy.deepcopy(message)
    expected = r.redact(copy.deepcopy(message))
    reference_unchanged = r.redact(message) is message
    got = r.redact_message(message)
    assert got == expected, (message, got, expected)
    assert (got is message) == reference_unchanged, message
    assert message == before  # the input is never changed in place


def test_redact_message_matches_redact_on_random_messages():
    rng = random.Random(13)
    for _ in range(4000):
        _check(_message(rng))


def test_redact_message_matches_redact_with_a_registered_secret_and_pattern():
    rng = random.Random(14)
    r.register_secret("in-house-value-0042")
    TEXTS.append("sent in-house-value-0042 along")
    try:
        for _ in range(1000):
            _check(_message(rng))
        r.register_pattern(r"MSG-\d{5}")
        TEXTS.append("ticket MSG-12345 open")
        for _ in range(1000):
            _check(_message(rng))
    finally:
        del TEXTS[-2:]


def test_a_clean_assistant_turn_with_tool_calls_is_returned_as_itself():
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_0123456789", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "Paris"}'}}],
    }
    assert r.redact_message(message) is message
    dirty = copy.deepcopy(message)
    dirty["tool_calls"][0]["function"]["arguments"] = f'{{"q": "{KEY}"}}'
    out = r.redact_message(dirty)
    assert out is not dirty and KEY not in str(out) and r.REDACTED in out["tool_calls"][0]["function"]["arguments"]
