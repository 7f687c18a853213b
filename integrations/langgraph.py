"""LangGraph / LangChain helpers: a chat model bound to a (trainable) tracerl model."""

from __future__ import annotations

from typing import Any


def init_chat_model(model: Any, *, step: int | None = None, temperature: float = 1.0, **kwargs: Any) -> Any:
    """A ``ChatOpenAI`` that talks to ``model``'s endpoint (served name ``name@step``).

    Also enables the OpenAI and LangChain hooks and marks the endpoint as tracerl-served,
    so calls made inside a rollout carry exact token ids and logprobs.  Extra keyword
    arguments go to ``ChatOpenAI``.
    """
    from langchain_openai import ChatOpenAI

    from .endpoints import register_endpoint
    from .instrument import instrument

    base_url = getattr(model, "inference_base_url", None)
    if not base_url:
        raise ValueError(
            f"model {getattr(model, 'name', model)!r} has no inference endpoint: call `await model.register(backend)` first"
        )
    if getattr(model, "trainable", False):
        register_endpoint(base_url)
    instrument("openai", "langchain")
    name = model.get_inference_name(step) if step is not None else model.get_inference_name()
    return ChatOpenAI(
        model=name,
        base_url=base_url,
        api_key=getattr(model, "inference_api_key", None) or "tracerl",
        temperature=temperature,
        **kwargs,
    )
