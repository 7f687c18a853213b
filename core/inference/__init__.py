"""Inference servers: an OpenAI chat-completions endpoint over a base model + run-time LoRA adapters.

Light to import: fastapi, torch, transformers and vLLM load only when a server is created.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import InferenceServer, PausableServer, ServerKind, make_server
from .tool_calls import ParsedToolCalls, parse_tool_calls

if TYPE_CHECKING:  # pragma: no cover
    from .transformers_server import TransformersServer
    from .vllm_server import VLLMServer, install_vllm_runtime

__all__ = [
    "InferenceServer",
    "ParsedToolCalls",
    "PausableServer",
    "ServerKind",
    "TransformersServer",
    "VLLMServer",
    "install_vllm_runtime",
    "make_server",
    "parse_tool_calls",
]

_LAZY = {
    "TransformersServer": ".transformers_server",
    "VLLMServer": ".vllm_server",
    "install_vllm_runtime": ".vllm_server",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
