"""The legacy ``/v1/completions`` route of the transformers server, as vLLM speaks it.

Why it exists: on-policy distillation (:mod:`tracerl.train.distill`) asks a teacher for the logprob of
every token the student sampled, and the only OpenAI-compatible way to get a model's logprobs
on *given* tokens is a completion over those tokens with prompt logprobs.  vLLM answers
``prompt_logprobs: k`` (its extension: ``choices[0].prompt_logprobs``, a list with ``None`` for
the first token and ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` for each later one)
and the OpenAI-style ``echo: true`` with ``logprobs: k`` (``choices[0].logprobs.token_logprobs``
over prompt and completion).  This server answers both the same way, so one teacher client
works against vLLM, this server, and any endpoint that speaks either form.

``prompt`` is a string or a list of token ids (one prompt per request); ``max_tokens`` tokens
are then generated (0 is allowed with ``echo`` or ``prompt_logprobs``: scoring only) with
``temperature``, ``top_p`` and ``top_k``.  Prompt logprobs are the model's raw ones; the generated
tokens' logprobs are those of the distribution they were sampled from, and the choice carries
that distribution's ``sampling`` parameters, as on chat completions (:mod:`.protocol`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..net.http_server import OpenAIError
from .protocol import sampling_field

MAX_LOGPROBS = 20


@dataclass
class CompletionRequest:
    model: str
    prompt: str | list[int]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_token_ids: bool = False

    @property
    def sampling(self) -> dict[str, Any]:
        """The choice's ``sampling`` field (:func:`~tracerl.inference.protocol.sampling_field`)."""
        return sampling_field(self.temperature, self.top_p, self.top_k)


def _optional_int(body: dict[str, Any], key: str, low: int, high: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise OpenAIError(f"'{key}' must be an integer between {low} and {high}, got {value!r}", param=key)
    return value


def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a completions request body; raises :class:`OpenAIError` (400) naming the ``param``."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError("'model' is required", param="model")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    if not (isinstance(prompt, str) or is_ids) or not prompt:
        raise OpenAIError("'prompt' must be a non-empty string or a non-empty list of token ids (one prompt)", param="prompt")
    if bool(body.get("stream")):
        raise OpenAIError("'stream' is not supported on /v1/completions by this server", param="stream")
    n = body.get("n", 1)
    if n != 1:
        raise OpenAIError("'n' must be 1 on /v1/completions by this server", param="n")
    echo = bool(body.get("echo"))
    prompt_logprobs = _optional_int(body, "prompt_logprobs", 0, MAX_LOGPROBS)
    max_tokens = _optional_int(body, "max_tokens", 0, 1 << 20)
    max_tokens = 16 if max_tokens is None else max_tokens
    if max_tokens == 0 and not echo and prompt_logprobs is None:
        raise OpenAIError("'max_tokens' may be 0 only with 'echo' or 'prompt_logprobs' (scoring a prompt)", param="max_tokens")
    temperature = body.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0.0 <= temperature <= 2.0:
        raise OpenAIError(f"'temperature' must be a number between 0 and 2, got {temperature!r}", param="temperature")
    top_p = body.get("top_p")
    top_p = 1.0 if top_p is None else top_p
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise OpenAIError(f"'top_p' must be a number in (0, 1], got {top_p!r}", param="top_p")
    top_k = body.get("top_k")
    top_k = 0 if top_k is None else top_k
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
        raise OpenAIError(f"'top_k' must be an integer >= -1 (0 or -1: off), got {top_k!r}", param="top_k")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise OpenAIError("'seed' must be an integer", param="seed")
    return CompletionRequest(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=max(0, top_k),
        seed=seed,
        echo=echo,
        logprobs=_optional_int(body, "logprobs", 0, MAX_LOGPROBS),
        prompt_logprobs=prompt_logprobs,
        return_token_ids=bool(body.get("return_token_ids")),
    )


def vllm_prompt_logprobs(scored: list[Any], token_text: Any) -> list[dict[str, dict[str, Any]] | None]:
    """Scored prompt tokens (``PromptLogprob`` or None) in vLLM's JSON shape."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for entry in scored:
        if entry is None:
            out.append(None)
            continue
        row = {str(entry.token_id): {"logprob": entry.logprob, "rank": entry.rank, "decoded_token": token_text(entry.token_id)}}
        for rank, (token, logprob) in enumerate(entry.top, start=1):
            row.setdefault(str(token), {"logprob": logprob, "rank": rank, "decoded_token": token_text(token)})
        out.append(row)
    return out


def legacy_logprobs(
    token_ids: list[int], logprobs: list[float | None], tops: list[list[tuple[int, float]] | None], token_text: Any
) -> dict[str, Any]:
    """OpenAI's completions ``logprobs`` object (tokens, token_logprobs, top_logprobs, text_offset)."""
    tokens = [token_text(t) for t in token_ids]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": [None if top is None else {token_text(t): lp for t, lp in top} for top in tops],
        "text_offset": offsets,
    }


def completion_body(
    *, model: str, choice: dict[str, Any], prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    return {
        "id": "cmpl-" + uuid.uuid4().hex,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
