"""One way to call any judge: LiteLLM's ``acompletion``.

A judge is a LiteLLM model string (any provider: ``"openai/gpt-4.1-mini"``,
``"anthropic/claude-…"``, ``"ollama/qwen3"`` …), a :class:`JudgeEndpoint` (any
OpenAI-compatible ``base_url``, e.g. a vLLM server), or a ``tracerl.Model`` (a model
served by a tracerl backend).  Endpoints go through LiteLLM's OpenAI-compatible
providers, so every judge takes the same code path.  LiteLLM is imported on first use
(it costs seconds), with the bundled price map (no network at import).

Every call is bounded: LiteLLM's ``timeout`` is ``DEFAULT_JUDGE_TIMEOUT`` (180 s) unless
``extra_litellm_params={"timeout": seconds}`` says otherwise (LiteLLM's own default is
6000 s).  It bounds the whole call, the SDK's own retries of transient errors included, so
a judge that does not answer raises :class:`JudgeTimeoutError` after that long.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import Any

from tracerl.errors import JudgeError, JudgeTimeoutError
from tracerl.timeouts import DEFAULT_JUDGE_TIMEOUT, check_timeout, within

_NOT_STRUCTURED: set[str] = set()
"""Judges that rejected ``response_format`` once in this process (not sent again)."""


@dataclass(frozen=True)
class JudgeEndpoint:
    """An OpenAI-compatible chat-completions endpoint used as the judge."""

    base_url: str
    """E.g. ``"http://127.0.0.1:8000/v1"``."""
    model: str
    """The model name that endpoint serves."""
    api_key: str | None = None


@dataclass(frozen=True)
class JudgeTarget:
    """A resolved judge: a label (for cache keys, metrics and errors) and LiteLLM kwargs."""

    label: str
    params: dict[str, Any] = field(default_factory=dict)
    structured: bool = True
    """Whether to ask for a JSON schema via ``response_format``."""
    max_explanation_chars: int | None = None
    """Bound on each explanation in that schema, for self-hosted endpoints: their guided decoding
    (vLLM's xgrammar/outlines) enforces ``maxLength``, so a small judge's answer always closes
    before ``max_tokens`` instead of being cut off mid-explanation.  None for hosted providers,
    whose strict modes may refuse string-length keywords."""
    positional_ids: bool = False
    """Whether the schema pins entry k to the k-th id (``prefixItems``), for self-hosted endpoints
    (see :func:`tracerl.ruler.parse.response_format`); hosted providers get the ``enum`` form."""
    timeout: float | None = DEFAULT_JUDGE_TIMEOUT
    """Seconds per call (LiteLLM's ``timeout``); kept out of ``params`` so that cache keys ignore it."""


@dataclass(frozen=True)
class Completion:
    content: str | None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float | None = None
    """Price of the call where LiteLLM knows the model's price, else None."""
    finish_reason: str | None = None


EXPLANATION_CHARS = 240
"""Explanation bound asked of self-hosted judges (about 60 tokens each)."""


def litellm_module() -> Any:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    litellm.suppress_debug_info = True
    return litellm


def resolve_judge(judge_model: Any, extra_litellm_params: dict[str, Any] | None = None) -> JudgeTarget:
    extra = dict(extra_litellm_params or {})
    if isinstance(judge_model, JudgeEndpoint):
        params = {"model": f"openai/{judge_model.model}", "api_base": judge_model.base_url}
        params["api_key"] = judge_model.api_key or "tracerl"
        label = f"{judge_model.model}@{judge_model.base_url}"
        endpoint = True
    elif hasattr(judge_model, "litellm_completion_params"):  # tracerl.Model (or look-alike)
        params = dict(judge_model.litellm_completion_params())
        params.pop("temperature", None)  # the policy samples at T=1; the judge takes the provider's default
        params.pop("timeout", None)  # the policy's call limit; a judge has its own (DEFAULT_JUDGE_TIMEOUT)
        if "base_url" in params:
            params["api_base"] = params.pop("base_url")
        endpoint = "api_base" in params
        label = params["model"] + (f"@{params['api_base']}" if endpoint else "")
    elif isinstance(judge_model, str) and judge_model:
        params = {"model": judge_model}
        endpoint = any(k in extra for k in ("api_base", "base_url"))
        label = judge_model + (f"@{extra.get('api_base', extra.get('base_url'))}" if endpoint else "")
    else:
        raise JudgeError(
            f"judge_model must be a LiteLLM model string, a JudgeEndpoint or a tracerl.Model, got {judge_model!r}"
        )
    params.update(extra)
    timeout = check_timeout(params.pop("timeout", DEFAULT_JUDGE_TIMEOUT), "the judge's timeout")
    structured = endpoint or _supports_schema(params["model"])
    bound = EXPLANATION_CHARS if endpoint else None
    return JudgeTarget(
        label=label, params=params, structured=structured, max_explanation_chars=bound, positional_ids=endpoint, timeout=timeout
    )


def _supports_schema(model: str) -> bool:
    try:
        return bool(litellm_module().supports_response_schema(model=model))
    except Exception:  # noqa: BLE001 - unknown model: fall back to tolerant parsing
        return False


def _cost(litellm: Any, response: Any) -> float | None:
    try:
        cost = litellm.completion_cost(completion_response=response)
    except Exception:  # noqa: BLE001 - price unknown (local or unmapped model)
        return None
    return float(cost) if cost is not None else None


async def _bounded(call: Any, seconds: float | None) -> Any:
    """``call`` awaited for at most ``seconds`` in all (LiteLLM's ``timeout`` is per attempt)."""
    async with asyncio.timeout(seconds):
        return await call


async def complete(
    target: JudgeTarget, messages: list[dict[str, Any]], response_format: dict[str, Any] | None
) -> Completion:
    """One chat completion; provider errors become :class:`JudgeError` (``raise … from``),
    a call past ``target.params["timeout"]`` seconds :class:`JudgeTimeoutError`."""
    litellm = litellm_module()
    kwargs = dict(target.params, messages=messages)
    if target.timeout is not None:  # None: explicitly unlimited (LiteLLM's own default, 6000 s)
        kwargs["timeout"] = target.timeout
    if "response_format" in target.params:  # the caller's choice wins; None means "do not send one"
        if kwargs["response_format"] is None:
            kwargs.pop("response_format")
    elif response_format is not None and target.structured and target.label not in _NOT_STRUCTURED:
        kwargs["response_format"] = response_format
    try:
        try:
            response = await _bounded(litellm.acompletion(**kwargs), target.timeout)
        except (litellm.BadRequestError, litellm.UnsupportedParamsError):
            if "response_format" not in kwargs:
                raise
            _NOT_STRUCTURED.add(target.label)  # this judge refuses JSON schemas: parse its text instead
            kwargs.pop("response_format")
            response = await _bounded(litellm.acompletion(**kwargs), target.timeout)
    except Exception as error:  # noqa: BLE001 - translated at the boundary
        if isinstance(error, (litellm.Timeout, TimeoutError)):
            raise JudgeTimeoutError(
                f"the judge {target.label} did not answer {within(target.timeout)} "
                '(knob: extra_litellm_params={"timeout": seconds})'
            ) from error
        raise JudgeError(f"the call to judge {target.label} failed: {type(error).__name__}: {error}") from error
    usage = getattr(response, "usage", None)
    choice = response.choices[0] if getattr(response, "choices", None) else None
    content = getattr(getattr(choice, "message", None), "content", None)
    return Completion(
        content=content,
        prompt_tokens=int(getattr(usage, "prompt_tokens", 0) or 0),
        completion_tokens=int(getattr(usage, "completion_tokens", 0) or 0),
        cost_usd=_cost(litellm, response),
        finish_reason=getattr(choice, "finish_reason", None),
    )
