"""Inference servers: an OpenAI chat-completions endpoint over a base model + run-time LoRA adapters.

Light to import: torch, transformers and vLLM load only when a server starts.
"""

from __future__ import annotations

from .base import InferenceServer, ServerKind, make_server
from .tool_calls import ParsedToolCalls, parse_tool_calls

__all__ = ["InferenceServer", "ParsedToolCalls", "ServerKind", "make_server", "parse_tool_calls"]
