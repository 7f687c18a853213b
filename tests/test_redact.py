"""``tracerl.redact``: the one redaction step (rules, structures, registration, logs, records)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Status, StatusCode

import tracerl
from tracerl import redact as r
from tracerl.integrations.outbound import redact_span, redact_trajectory

ROOT = Path(__file__).resolve().parents[1]

SHAPED = [
    "sk-proj-" + "a1B2" * 10, "sk-ant-api03-" + "Zz09" * 8, "sk-" + "x" * 20 + "9", "sk-lf-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0",
    "pk-lf-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0", "AKIAIOSFODNN7EXAMPLE", "AIza" + "Sy0123456789abcdefghijklmnopqrstuvw",
    "ya29." + "a0AfH6SMB" * 3, "hf_" + "AbCdEfGhIj" * 4, "ghp_" + "a1b2c3d4e5" * 4, "github_pat_" + "11AB" * 10,
    "xoxb-" + "1234567890-abcdef", "gsk_" + "q1w2e3r4t5" * 3,
]  # fmt: skip


@pytest.mark.parametrize("key", SHAPED)
def test_known_key_shapes_are_redacted_wherever_they_stand(key):
    for text in (key, f"the key is {key}.", f'{{"k": "{key}"}}', f"'{key}'", f"({key})"):
        assert key not in r.redact_text(text) and r.REDACTED in r.redact_text(text)


@pytest.mark.parametrize(
    "text",
    [
        "Authorization: Bearer abc.def-123456",
        "authorization: Basic cGstbGY6c2stbGY=",
        '{"x-api-key": "unshaped-value-1"}',
        "{'api_key': 'unshaped-value-1', 'model': 'm'}",
        "https://host/v1?api_key=unshaped-value-1&model=m",
        "OPENAI_API_KEY=unshaped-value-1",
        "password: unshaped-value-1",
        r'{\"client_secret\": \"unshaped-value-1\"}',
        "X-Goog-Api-Key=unshaped-value-1",
    ],
)
def test_values_under_sensitive_names_are_redacted(text):
    clean = r.redact_text(text)
    assert "unshaped-value-1" not in clean and "abc.def-123456" not in clean and "cGstbGY6c2stbGY=" not in clean
    assert r.REDACTED in clean


@pytest.mark.parametrize(
    "text",
    [
        "The Bearer of bad news had a basic understanding; Basic Authentication is a scheme.",
        "desk-organizationalstructureplanning and task-sk-likewords",
        '{"token": "Hello", "logprob": -0.5}', "token_ids prompt_token_ids max_tokens=12",
        "the monkey: banana", "keyboard = qwerty layout", "api key rotation is a good practice",
    ],
)
def test_ordinary_text_is_left_alone(text):
    assert r.redact_text(text) is text


def test_structures_redact_sensitive_keys_and_strings_and_share_what_is_clean():
    clean = {"messages": [{"role": "user", "content": "hello"}], "n": 3, "flags": (True, None)}
    assert r.redact(clean) is clean
    dirty = {
        "headers": {"Authorization": "anything", "X-API-Key": "v", "Content-Type": "json"},
        "openai_api_key": "k", "args": ["use " + SHAPED[0]], "token": "Hello", "nested": {"password": {"a": 1}},
    }  # fmt: skip
    out = r.redact(dirty)
    assert out["headers"] == {"Authorization": r.REDACTED, "X-API-Key": r.REDACTED, "Content-Type": "json"}
    assert out["openai_api_key"] == r.REDACTED and out["args"] == ["use " + r.REDACTED]
    assert out["token"] == "Hello" and out["nested"] == {"password": r.REDACTED}
    assert dirty["headers"]["Authorization"] == "anything"  # a copy: the input is not changed
    assert r.is_sensitive_key("http.request.header.authorization") and not r.is_sensitive_key("gen_ai.usage.input_tokens")


def test_registered_secrets_patterns_and_environment():
    r.register_secret("in-house-token-7f3a9", None, "short")
    assert r.redact_text("sent in-house-token-7f3a9 upstream") == f"sent {r.REDACTED} upstream"
    assert r.redact_text("short and sweet") == "short and sweet"  # under MIN_SECRET_LENGTH: ignored
    r.register_pattern(r"ACME-\d{6}")
    assert r.redact_text("ticket ACME-123456") == f"ticket {r.REDACTED}"
    with pytest.raises(ValueError, match="unnamed groups"):
        r.register_pattern(r"(?P<x>y)")
    r.scan_environment({"MISTRAL_API_KEY": "mistral-value-123", "HF_TOKEN": "hf-value-12345", "HOME": "/root-home-dir", "X_TOKEN": "true"})
    assert r.redact_text("mistral-value-123 hf-value-12345 /root-home-dir true") == f"{r.REDACTED} {r.REDACTED} /root-home-dir true"


def test_a_text_seen_before_a_secret_is_registered_is_redacted_after_it():
    """Redaction remembers recent texts; registering a secret or a pattern must forget them."""
    text = "the value lately-seen-value-41 went upstream"
    assert r.redact_text(text) is text and r.redact_text(text) is text  # clean, remembered: the same object
    r.register_secret("lately-seen-value-41")
    assert r.redact_text(text) == f"the value {r.REDACTED} went upstream"
    other = "ticket LATE-778899 raised"
    assert r.redact_text(other) is other
    r.register_pattern(r"LATE-\d{6}")
    assert r.redact_text(other) == f"ticket {r.REDACTED} raised"
    dirty = "use " + SHAPED[0] + " here"
    assert r.redact_text(dirty) == r.redact_text(dirty) == f"use {r.REDACTED} here"  # remembered redacted too


def test_a_structure_is_copied_only_along_what_changed():
    siblings = {"role": "system", "content": "a long and perfectly clean system prompt"}
    value = {"messages": [siblings, {"role": "tool", "content": "key is " + SHAPED[0]}], "tools": [{"name": "lookup"}]}
    out = r.redact(value)
    assert out is not value and out["messages"] is not value["messages"]
    assert out["messages"][0] is siblings and out["tools"] is value["tools"]  # clean parts are shared
    assert out["messages"][1]["content"] == f"key is {r.REDACTED}"
    assert value["messages"][1]["content"] == "key is " + SHAPED[0]  # the input is not changed
    assert r.redact((1, "x", None, 2.5, True)) == (1, "x", None, 2.5, True)


def test_tracerl_serve_and_remote_backend_register_their_token():
    from tracerl.serve.remote_backend import RemoteBackend
    from tracerl.serve.server import create_app

    RemoteBackend("http://127.0.0.1:1", token="client-token-5ad1e")
    create_app(object(), token="server-token-77c0b")
    assert r.redact_text("client-token-5ad1e server-token-77c0b") == f"{r.REDACTED} {r.REDACTED}"


def _logger_names() -> set[str]:
    """Every logger name tracerl's source asks for (``getLogger("…")`` or ``getLogger(__name__)``)."""
    packages = {"core": "tracerl", "integrations": "tracerl.integrations", "ruler": "tracerl.ruler", "mcp_rl": "tracerl.mcp_rl"}
    names = set()
    for folder, package in packages.items():
        for path in (ROOT / folder).rglob("*.py"):
            for argument in re.findall(r"getLogger\(([^)]*)\)", path.read_text()):
                if argument == "__name__":
                    parts = path.relative_to(ROOT / folder).with_suffix("").parts
                    names.add(".".join((package, *parts)))
                elif argument[:1] in "\"'" and argument.strip("\"'").startswith("tracerl"):
                    names.add(argument.strip("\"'"))  # a third-party logger (an example quieting httpx) is not ours
    return names


def test_every_tracerl_logger_redacts_its_records(caplog):
    assert _logger_names() <= set(r.LOGGERS), "add new loggers to tracerl.redact.LOGGERS"
    assert all(any(isinstance(f, r.RedactingLogFilter) for f in logging.getLogger(n).filters) for n in r.LOGGERS)
    key = SHAPED[0]
    with caplog.at_level(logging.WARNING, logger="tracerl"):
        try:
            raise RuntimeError(f"upstream rejected {key}")
        except RuntimeError as error:
            logging.getLogger("tracerl.serve").error("call failed with %s", key, exc_info=error)
    formatted = logging.Formatter().format(caplog.records[-1])
    assert key not in formatted and "call failed with [REDACTED]" in formatted and "RuntimeError: upstream rejected [REDACTED]" in formatted


def test_exception_records_are_redacted():
    try:
        raise PermissionError(f"401 from upstream: {{'authorization': 'Bearer {SHAPED[0]}'}}")
    except PermissionError as error:
        record = tracerl.ExceptionRecord.from_exception(error)
    assert SHAPED[0] not in record.message and SHAPED[0] not in record.traceback
    assert record.type == "PermissionError" and "Bearer [REDACTED]" in record.message


def test_trajectory_and_span_redaction():
    key = SHAPED[2]
    choice = tracerl.Choice(
        message={"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": json.dumps({"api_key": "raw-value-42"})}}]},
        token_ids=[1, 2], logprobs=[-0.1, -0.2],
    )  # fmt: skip
    trajectory = tracerl.Trajectory(
        messages_and_choices=[{"role": "user", "content": f"key {key}"}, choice, {"role": "tool", "tool_call_id": "c", "content": key}],
        additional_histories=[tracerl.History(messages_and_choices=[{"role": "user", "content": key}])],
        metadata={"task": key}, logs=[f"saw {key}"],
    )  # fmt: skip
    text = json.dumps(redact_trajectory(trajectory).to_json_dict())
    assert key not in text and "raw-value-42" not in text and trajectory.messages_and_choices[1].token_ids == [1, 2]

    span = TracerProvider().get_tracer("t").start_span(f"call {key}", attributes={"llm.invocation_parameters": json.dumps({"headers": {"Authorization": key}})})
    span.record_exception(RuntimeError(f"echo {key}"))
    span.set_status(Status(StatusCode.ERROR, f"failed: {key}"))
    span.end()
    clean = redact_span(span)
    dump = str((clean.name, dict(clean.attributes), [dict(e.attributes) for e in clean.events], clean.status.description))
    assert key not in dump and dump.count(r.REDACTED) >= 5
