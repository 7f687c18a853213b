"""Hook for LangChain / LangGraph: a callback handler attached to every run.

(The handler class is built inside a function so importing this module does not import
LangChain; that is why ``_make_handler_class`` is longer than our usual function.)

Every run becomes a span nested as Langfuse's own LangChain integration nests it
(:mod:`.langchain_runs`: the graph, its nodes, subgraphs, chains, retrievers, agents),
and two kinds carry what trajectories are built from: chat-model calls (``chat {model}``
spans, layer ``langchain``) and tool runs (``execute_tool {name}`` spans with call id,
arguments, result or error).  Chat models that talk to OpenAI-compatible servers are
also seen by the OpenAI hook, which holds the token ids; its span nests under ours and
the converter keeps one of the two (joined by response id).  The handler runs inline,
in the caller's context, so its spans land in the current rollout even inside
LangGraph's thread pools (which copy the context).
"""

from __future__ import annotations

import json
from contextvars import ContextVar
from typing import Any
from uuid import UUID

from opentelemetry import trace

from . import faults, layers
from . import langchain_runs as runs
from . import semconv as sc
from .health import guard
from .model_calls import end_span_with_error
from .processor import get_tracer
from .spans import ChatAnswer, end_chat_span, json_text, start_chat_span

_handler_var: ContextVar[Any] = ContextVar("tracerl_langchain_handler", default=None)
_state: dict[str, Any] = {}


def _openai_messages(messages: Any) -> list[dict[str, Any]]:
    from langchain_core.messages import convert_to_openai_messages

    return list(convert_to_openai_messages(list(messages)))


def _make_handler_class() -> type:
    from langchain_core.callbacks import BaseCallbackHandler

    control_flow = runs.control_flow_errors()

    class TracerlCallbackHandler(BaseCallbackHandler):
        """Records LangChain runs as nested spans; chat models and tools as GenAI spans."""

        run_inline = True
        raise_error = False

        def __init__(self) -> None:
            self._runs = runs.RunSpans()

        # -- graphs, nodes, chains, retrievers ----------------------------------------------------
        def on_chain_start(
            self, serialized: dict[str, Any], inputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
            tags: list[str] | None = None, metadata: dict[str, Any] | None = None, **kwargs: Any,
        ) -> None:  # fmt: skip
            if not _state.get("enabled"):
                return
            with guard("langchain_chain_start"):
                name = runs.run_name(serialized, kwargs)
                kind, described = runs.chain_kind(serialized, name), runs.run_metadata(metadata, tags)
                self._runs.start(run_id, parent_run_id, lambda: runs.start_run_span(name, kind, described))

        def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
            with guard("langchain_chain_end"):
                runs.end_run_span(self._runs.close(run_id))

        def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
            with guard("langchain_chain_error"):
                runs.end_run_span(self._runs.close(run_id), error, control_flow=control_flow)

        def on_agent_action(self, action: Any, *, run_id: UUID, **kwargs: Any) -> None:
            span = self._runs.get(run_id)  # Langfuse marks a run that takes agent actions an agent
            if span is not None:
                with guard("langchain_agent"):
                    span.set_attribute(sc.OI_SPAN_KIND, runs.KIND_AGENT)

        on_agent_finish = on_agent_action

        def on_retriever_start(
            self, serialized: dict[str, Any], query: str, *, run_id: UUID, parent_run_id: UUID | None = None,
            tags: list[str] | None = None, metadata: dict[str, Any] | None = None, **kwargs: Any,
        ) -> None:  # fmt: skip
            if not _state.get("enabled"):
                return
            with guard("langchain_retriever_start"):
                name = runs.run_name(serialized, kwargs)
                described, extra = runs.run_metadata(metadata, tags), {sc.OI_INPUT_VALUE: str(query)}
                self._runs.start(run_id, parent_run_id, lambda: runs.start_run_span(name, runs.KIND_RETRIEVER, described, extra))

        def on_retriever_end(self, documents: Any, *, run_id: UUID, **kwargs: Any) -> None:
            span = self._runs.close(run_id)
            if span is not None:
                with guard("langchain_retriever_end"):
                    span.set_attributes(runs.retrieved_documents(list(documents or ())))
                    span.end()

        def on_retriever_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
            with guard("langchain_retriever_error"):
                runs.end_run_span(self._runs.close(run_id), error, control_flow=control_flow)

        # -- chat models ------------------------------------------------------------------------
        def on_chat_model_start(
            self, serialized: dict[str, Any], messages: list[list[Any]], *, run_id: UUID,
            parent_run_id: UUID | None = None, **kwargs: Any,
        ) -> None:  # fmt: skip
            if not _state.get("enabled"):
                return
            with guard("langchain_chat_start"):
                params = dict(kwargs.get("invocation_params") or {})
                model = params.get("model") or params.get("model_name") or (kwargs.get("metadata") or {}).get("ls_model_name")
                request = {"model": model, "tools": params.get("tools"), "temperature": params.get("temperature")}
                provider = (kwargs.get("metadata") or {}).get("ls_provider") or "langchain"
                sent = _openai_messages(messages[0] if messages else [])
                span = self._runs.start(
                    run_id, parent_run_id, lambda: start_chat_span("langchain", request, provider=str(provider), messages=sent)
                )
                layers.langchain_run_started(run_id, span)

        def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
            span = self._runs.close(run_id)
            if span is None:
                return
            with guard("langchain_chat_end"):
                layers.langchain_run_ended(run_id, span)
                generations = response.generations[0] if response.generations else []
                answer = ChatAnswer([], [], (response.llm_output or {}).get("id"), (response.llm_output or {}).get("model_name"))
                for generation in generations:
                    message = getattr(generation, "message", None)
                    if message is None:
                        continue
                    info = dict(generation.generation_info or {})
                    metadata = dict(getattr(message, "response_metadata", None) or {})
                    answer.response_id = answer.response_id or metadata.get("id")
                    answer.model = answer.model or metadata.get("model_name")
                    answer.messages.append({**_openai_messages([message])[0], "role": "assistant"})
                    answer.finishes.append(info.get("finish_reason") or metadata.get("finish_reason"))
                    usage = getattr(message, "usage_metadata", None) or {}
                    answer.input_tokens = answer.input_tokens or usage.get("input_tokens")
                    answer.output_tokens = answer.output_tokens or usage.get("output_tokens")
                end_chat_span(span, answer)

        def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
            span = self._runs.close(run_id)
            layers.langchain_run_ended(run_id, span)
            end_span_with_error(span, error, "langchain_error")
            faults.note_failure("model", "a LangChain chat model", error)  # e.g. a provider without our SDK hook

        # -- tools -----------------------------------------------------------------------------------
        def on_tool_start(
            self, serialized: dict[str, Any], input_str: str, *, run_id: UUID, parent_run_id: UUID | None = None,
            **kwargs: Any,
        ) -> None:  # fmt: skip
            if not _state.get("enabled"):
                return
            with guard("langchain_tool_start"):
                name = (serialized or {}).get("name") or kwargs.get("name") or "tool"
                inputs = kwargs.get("inputs")
                attributes = {sc.OPERATION_NAME: sc.OP_EXECUTE_TOOL, sc.LAYER: "langchain", sc.TOOL_NAME: str(name),
                              sc.TOOL_CALL_ARGUMENTS: json_text(inputs) if inputs is not None else str(input_str)}  # fmt: skip
                if kwargs.get("tool_call_id"):
                    attributes[sc.TOOL_CALL_ID] = str(kwargs["tool_call_id"])
                context = trace.set_span_in_context(parent) if (parent := self._runs.parent(parent_run_id)) else None
                span = get_tracer().start_span(
                    f"execute_tool {name}", context=context, kind=trace.SpanKind.INTERNAL, attributes=attributes
                )
                self._runs.open(run_id, span, parent_run_id)

        def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
            span = self._runs.close(run_id)
            if span is None:
                return
            with guard("langchain_tool_end"):
                content = getattr(output, "content", output)
                if getattr(output, "tool_call_id", None) and not span.attributes.get(sc.TOOL_CALL_ID):
                    span.set_attribute(sc.TOOL_CALL_ID, str(output.tool_call_id))
                if getattr(output, "status", None) == "error":
                    span.set_attribute(sc.ERROR_TYPE, "ToolError")
                span.set_attribute(sc.TOOL_CALL_RESULT, content if isinstance(content, str) else json.dumps(content, default=str))
                span.end()

        def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
            end_span_with_error(self._runs.close(run_id), error, "langchain_error")
            faults.note_failure("tool", "of a LangChain tool", error)  # ToolNode may turn it into a message

    return TracerlCallbackHandler


def instrument() -> bool:
    """Attach the handler to every LangChain run (via ``register_configure_hook``); idempotent."""
    try:
        from langchain_core.tracers.context import register_configure_hook
    except ImportError:
        return False
    if "handler" not in _state:
        global _handler_var
        handler = _make_handler_class()()
        _handler_var = ContextVar("tracerl_langchain_handler", default=handler)
        register_configure_hook(_handler_var, True)
        _state["handler"] = handler
        _state["var"] = _handler_var
    _state["enabled"] = True
    return True


def uninstrument() -> None:
    """Stop recording (LangChain keeps the hook registered; the handler goes quiet)."""
    _state["enabled"] = False


def is_instrumented() -> bool:
    return bool(_state.get("enabled"))


def handler() -> Any:
    """The callback handler (to pass explicitly as ``config={"callbacks": [...]}`` if wanted)."""
    instrument()
    return _state["handler"]
