"""Attribute names we write and read: OpenTelemetry GenAI / MCP semantic conventions,
OpenInference's names (read from spans other instrumentors emit; the span kind and
metadata also written on LangChain run spans), and ``tracerl.*``.

Only constants live here, so every other module spells a name the same way.
"""

from __future__ import annotations

# -- OpenTelemetry GenAI semantic conventions ---------------------------------------
OPERATION_NAME = "gen_ai.operation.name"
PROVIDER_NAME = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
RESPONSE_ID = "gen_ai.response.id"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
INPUT_MESSAGES = "gen_ai.input.messages"
OUTPUT_MESSAGES = "gen_ai.output.messages"
TOOL_DEFINITIONS = "gen_ai.tool.definitions"
TOOL_NAME = "gen_ai.tool.name"
TOOL_CALL_ID = "gen_ai.tool.call.id"
TOOL_CALL_ARGUMENTS = "gen_ai.tool.call.arguments"
TOOL_CALL_RESULT = "gen_ai.tool.call.result"
CONVERSATION_ID = "gen_ai.conversation.id"
ERROR_TYPE = "error.type"
SERVER_ADDRESS = "server.address"

OP_CHAT = "chat"
OP_EXECUTE_TOOL = "execute_tool"
OP_INVOKE_AGENT = "invoke_agent"
LLM_OPERATIONS = frozenset({"chat", "text_completion", "generate_content"})

# -- MCP semantic conventions --------------------------------------------------------
MCP_METHOD_NAME = "mcp.method.name"

# -- tracerl's own ---------------------------------------------------------------------
ROLLOUT_ID = "tracerl.rollout.id"
ROLLOUT_TASK = "tracerl.rollout.task"
ROLLOUT_GROUP = "tracerl.rollout.group"
ROLLOUT_MODEL = "tracerl.rollout.model"
LAYER = "tracerl.layer"
"""Which tracerl hook wrote a span: ``openai``, ``litellm``, ``langchain``, ``mcp``."""
STREAM = "tracerl.stream"
TOKEN_IDS_REQUESTED = "tracerl.token_ids.requested"
INPUT_BASE_SPAN_ID = "tracerl.input.base_span_id"
"""On a chat span whose ``gen_ai.input.messages`` is a delta: the earlier call it extends (``input_delta.py``)."""
INPUT_PREFIX_LENGTH = "tracerl.input.prefix_length"
"""How many of that earlier call's input messages come before this span's own."""
MCP_TOOLS = "tracerl.mcp.tools"
"""JSON list of the tool schemas an MCP ``tools/list`` returned."""

SCOPE = "tracerl.integrations"
"""Instrumentation scope name of every span tracerl creates."""

# -- OpenInference (read; kind and metadata also written on LangChain run spans) --------
OI_SPAN_KIND = "openinference.span.kind"
OI_MODEL_NAME = "llm.model_name"
OI_INPUT_MESSAGES = "llm.input_messages"
OI_OUTPUT_MESSAGES = "llm.output_messages"
OI_TOOLS = "llm.tools"
OI_OUTPUT_VALUE = "output.value"
OI_INPUT_VALUE = "input.value"
OI_TOOL_NAME = "tool.name"
OI_METADATA = "metadata"
"""OpenInference's span metadata: one JSON object (LangGraph's ``langgraph_node``...)."""
OI_RETRIEVAL_DOCUMENTS = "retrieval.documents"
OI_SESSION_ID = "session.id"
