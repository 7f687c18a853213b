"""Merged serving's wiring, without a model: flags, name aliases, and what LocalBackend refuses."""

from __future__ import annotations

import pytest

import tracerl
from tracerl.errors import ConfigError
from tracerl.inference.vllm_proxy import prepare_chat_body
from tracerl.inference.vllm_server import VLLMServer


def test_lora_flags_follow_the_settings() -> None:
    assert VLLMServer("/m", enable_lora=False, python="/py").lora_args() == []
    tuned = VLLMServer("/m", max_lora_rank=8, max_loras=1, max_cpu_loras=2, python="/py").lora_args()
    assert tuned == ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1", "--max-cpu-loras", "2"]
    command = VLLMServer("/m", enable_lora=False, python="/py").command(1234)
    assert "--enable-lora" not in command and "--model" in command


def test_a_step_alias_is_sent_to_vllm_as_the_served_model() -> None:
    body = {"model": "agent@3", "messages": []}
    prepare_chat_body(body, "agent", {"agent", "base"} | {"agent@3"})
    assert body["model"] == "agent" and body["return_token_ids"] is True
    other = {"model": "agent@1", "messages": []}
    prepare_chat_body(other, "agent", {"agent", "base", "agent@3"})
    assert other["model"] == "agent@1"  # not served: vLLM answers 404


@pytest.mark.parametrize("inference", ["transformers", None])
def test_serve_merged_needs_a_vllm_server(inference) -> None:
    with pytest.raises(ConfigError, match="serve_merged"):
        tracerl.LocalBackend(inference=inference, serve_merged=True)
