"""The slice of the OpenAI chat-completions protocol that tracerl's servers speak.

Requests are validated by hand so that every problem becomes an OpenAI-style 400 naming the
offending ``param``.  Every answer carries the sampled token ids (vLLM's ``return_token_ids``
shape: top-level ``prompt_token_ids`` and per-choice ``token_ids``) and their logprobs, asked
for or not, as the vLLM proxy does.  vLLM's other extensions are supported: ``top_k``, ``stop_token_ids``,
``ignore_eos``, ``chat_template_kwargs``.  ``stream: true`` is answered once the completion is
done, as server-sent events of the whole result (clients that stream work; tokens are not
delivered incrementally).

The logprobs are those of the distribution each token was sampled from (temperature, top-k,
top-p applied: vLLM's ``processed_logprobs``; raw for greedy decoding), and every choice says
which that was: ``"sampling": {"temperature", "top_p", "top_k"}`` beside its ``token_ids``
(:func:`sampling_field`), the server's defaults (1, 1, 0) included when the request set none.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

from ..net.http_server import OpenAIError
from ..types import GREEDY_BELOW

MAX_N = 64
MAX_TOP_LOGPROBS = 20


@dataclass
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    return_token_ids: bool = False
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def sampling(self) -> dict[str, Any]:
        """The per-choice ``sampling`` field of this request's answer (:func:`sampling_field`)."""
        return sampling_field(self.temperature, self.top_p, self.top_k)


def sampling_field(temperature: float, top_p: float = 1.0, top_k: int = 0) -> dict[str, Any]:
    """The sampling parameters applied to a choice, as tracerl's servers send them beside its ``token_ids``
    (read into :class:`tracerl.SamplingParams` by capture).  Greedy decoding (a temperature below
    :data:`~tracerl.types.GREEDY_BELOW`) applies neither top-p nor top-k: ``{"temperature": 0.0,
    "top_p": 1.0, "top_k": 0}``; a ``top_k`` below 1 (vLLM's -1 included) is off: 0."""
    if temperature < GREEDY_BELOW:
        return {"temperature": 0.0, "top_p": 1.0, "top_k": 0}
    return {"temperature": float(temperature), "top_p": float(top_p), "top_k": max(0, int(top_k))}


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low <= value <= high):
        raise OpenAIError(f"'{key}' must be a number between {low} and {high}, got {value!r}", param=key)
    return float(value)


def _integer(body: dict[str, Any], key: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise OpenAIError(f"'{key}' must be an integer {bound}, got {value!r}", param=key)
    return value


def joined_text(content: Any, where: str, *, param: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """A string, or the text of a list of text parts whose ``type`` is one of ``kinds`` (400 otherwise)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in kinds and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise OpenAIError(f"{where}: only text content is supported here, not {kind!r}", param=param)
        return "".join(texts)
    raise OpenAIError(f"{where}: content must be a string or a list of text parts", param=param)


def _text_content(content: Any, where: str) -> Any:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise OpenAIError(f"{where}.content: only text parts are supported", param="messages")
        return "".join(parts)
    raise OpenAIError(f"{where}.content must be a string or a list of text parts", param="messages")


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise OpenAIError("'messages' must be a non-empty list of messages", param="messages")
    messages = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in {"system", "developer", "user", "assistant", "tool"}:
            raise OpenAIError(f"{where} needs a 'role' of system, user, assistant or tool", param="messages")
        message = dict(message)
        if message["role"] == "developer":
            message["role"] = "system"
        message["content"] = _text_content(message.get("content"), where)
        if message["role"] != "assistant" and not isinstance(message["content"], str):
            raise OpenAIError(f"{where} needs a string 'content'", param="messages")
        messages.append(message)
    return messages


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a chat-completions request body; raises :class:`OpenAIError` (400)."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError("'model' is required", param="model")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise OpenAIError("'tools' must be a list of tool objects", param="tools")
    tools = tools or None
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise OpenAIError("'stop' must be a string or a list of non-empty strings", param="stop")
    stop_token_ids = body.get("stop_token_ids") or []
    if not (isinstance(stop_token_ids, list) and all(isinstance(t, int) for t in stop_token_ids)):
        raise OpenAIError("'stop_token_ids' must be a list of integers", param="stop_token_ids")
    max_tokens = _integer(body, "max_completion_tokens", None, 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", None, 1)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise OpenAIError("'logprobs' must be a boolean", param="logprobs")
    top_logprobs = _integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS) or 0
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise OpenAIError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    top_k = _integer(body, "top_k", 0, -1)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise OpenAIError("'seed' must be an integer", param="seed")
    return ChatRequest(
        model=model,
        messages=_messages(body.get("messages")),
        tools=tools,
        tool_choice=body.get("tool_choice"),
        n=int(_integer(body, "n", 1, 1, MAX_N) or 1),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=max(0, top_k or 0),
        max_tokens=max_tokens,
        stop=stop,
        stop_token_ids=stop_token_ids,
        seed=seed,
        logprobs=True,  # token truth always, as the vLLM proxy asks vLLM for it: a client that did not
        top_logprobs=top_logprobs,  # ask (its hook could not tell the endpoint is ours) still gets it
        return_token_ids=True,
        ignore_eos=bool(body.get("ignore_eos")),
        stream=bool(body.get("stream")),
        include_usage=bool((body.get("stream_options") or {}).get("include_usage")),
        add_generation_prompt=bool(body.get("add_generation_prompt", True)),
        chat_template_kwargs=kwargs,
    )


def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex


def logprob_entry(token: str, logprob: float, top: list[tuple[str, float]]) -> dict[str, Any]:
    """One element of ``choices[i].logprobs.content`` (OpenAI shape)."""
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode("utf-8")),
        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))} for t, lp in top],
    }


def chat_completion(
    *, model: str, prompt_token_ids: list[int], choices: list[dict[str, Any]], completion_tokens: int, include_ids: bool
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": completion_id(),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": len(prompt_token_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt_token_ids) + completion_tokens,
        },
    }
    if include_ids:
        body["prompt_token_ids"] = prompt_token_ids
    return body


def stream_events(completion: dict[str, Any], include_usage: bool) -> Iterator[str]:
    """A finished completion as ``chat.completion.chunk`` server-sent events (then ``[DONE]``).

    The first chunk of each choice carries the whole message (and ``token_ids`` /
    ``prompt_token_ids`` / ``sampling`` when the completion has them); a second one its
    ``finish_reason`` (and ``sampling`` again).
    """
    import json

    head = {key: completion[key] for key in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"
    for choice in completion["choices"]:
        message = choice.get("message") or {}
        delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
        if message.get("reasoning_content") is not None:  # vLLM's field for a reasoning parser's output
            delta["reasoning_content"] = message["reasoning_content"]
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
        first = {"index": choice["index"], "delta": delta, "logprobs": choice.get("logprobs"), "finish_reason": None}
        for key in ("token_ids", "prompt_token_ids", "sampling"):
            if key in choice:
                first[key] = choice[key]
        chunk = {**head, "choices": [first]}
        if "prompt_token_ids" in completion:
            chunk["prompt_token_ids"] = completion["prompt_token_ids"]
        yield f"data: {json.dumps(chunk)}\n\n"
        last = {"index": choice["index"], "delta": {}, "logprobs": None, "finish_reason": choice.get("finish_reason")}
        if "sampling" in choice:
            last["sampling"] = choice["sampling"]
        yield f"data: {json.dumps({**head, 'choices': [last]})}\n\n"
    if include_usage and completion.get("usage"):
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': completion['usage']})}\n\n"
    yield "data: [DONE]\n\n"
