"""``messages.openai_message`` is the semconv round trip (``from_semconv(to_semconv(m))``), built directly.

Every combination of role, content, tool calls, arguments and name below is compared, key order
included (trajectories are written as JSON): a call recorded without its span must read exactly
as the same call read back from its span.
"""

from __future__ import annotations

import itertools
import json

from openai.types.chat import ChatCompletionMessage

from tracerl.integrations.messages import from_semconv, openai_message, to_semconv

ROLES = ["user", "assistant", "system", "tool", None, "missing"]
CONTENTS = ["hello", "", None, "missing", [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u"}}], 7]
CALLS = [
    "missing",
    None,
    [],
    [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
    [{"id": "c2", "function": {"name": "g", "arguments": {"y": [1, 2]}}}, {"function": {"name": "h"}}],
    [{"id": "c3", "function": None}],
    ["not a call"],
]
NAMES = ["missing", "", "bob"]


def _message(role, content, calls, name):
    message = {}
    for key, value in (("role", role), ("content", content), ("tool_calls", calls), ("name", name)):
        if value != "missing":
            message[key] = value
    if role == "tool":
        message["tool_call_id"] = "c1"
    return message


def _round_trip(message):
    try:
        return json.dumps(from_semconv(to_semconv(message)))
    except Exception as error:  # noqa: BLE001 - the same error is expected from both
        return type(error).__name__


def _direct(message):
    try:
        return json.dumps(openai_message(message))
    except Exception as error:  # noqa: BLE001
        return type(error).__name__


def test_every_shape_reads_as_the_round_trip():
    shapes = 0
    for role, content, calls, name in itertools.product(ROLES, CONTENTS, CALLS, NAMES):
        message = _message(role, content, calls, name)
        assert _direct(message) == _round_trip(message), message
        shapes += 1
    assert shapes == len(ROLES) * len(CONTENTS) * len(CALLS) * len(NAMES)


def test_sdk_objects_read_as_the_round_trip():
    message = ChatCompletionMessage(role="assistant", content="hi", refusal=None)
    assert openai_message(message) == from_semconv(to_semconv(message)) == {"role": "assistant", "content": "hi"}
