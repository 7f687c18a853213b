"""The proxy in front of a vLLM subprocess (see :mod:`tracerl.inference.vllm_server`).

vLLM runs with ``--logprobs-mode processed_logprobs``, so its logprobs are those of the
distribution it sampled from (after temperature, top-k and top-p; raw for greedy decoding).
The proxy sees each chat and completions request, so it fills vLLM's neutral sampling values in
where the request left them out (:data:`NEUTRAL_SAMPLING`: otherwise vLLM takes them from the
model's ``generation_config.json``, e.g. Qwen3's temperature 0.6 and top-k 20, and the server's
default would not be the transformers server's 1) and adds each choice's ``sampling`` field
(:func:`~tracerl.inference.protocol.sampling_field`): the parameters actually applied.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..net.http_server import BearerAuth, OpenAIError, install_error_handlers
from ..net.untraced import untraced_fastapi
from .api_routes import add_api_routes
from .policy_gate import PolicyGate
from .protocol import sampling_field, stream_events
from .turns import TurnReader


class ProxiedServer(Protocol):
    """What the proxy reads of its vLLM server (:class:`~tracerl.inference.vllm_server.VLLMServer`)."""

    api_key: str
    vllm_url: str
    """The subprocess itself, ``http://127.0.0.1:PORT``."""
    served_name: str
    model_path: Path
    aliases: set[str]
    """Further names of the base model, added while the server runs (merged policies)."""
    turns: TurnReader | None
    """How replies are read into messages (set when the server starts)."""
    gate: PolicyGate
    """Requests against weight reloads; ``gate.policy``: the merged policy now loaded, the ``model`` an answer to an alias names."""


def _vllm_error(content: bytes) -> tuple[dict[str, Any] | None, str]:
    """vLLM's error body: (its OpenAI-shaped ``{"error": {...}}`` when it wrote one, else None; its message)."""
    import json

    try:
        body = json.loads(content)
    except ValueError:
        return None, content.decode(errors="replace")
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body, str(body["error"].get("message"))
    return None, str(body.get("message") if isinstance(body, dict) else body)


def _error_response(status: int, content: bytes) -> JSONResponse:
    """vLLM's error, in OpenAI's shape whatever vLLM's version wrote."""
    body, message = _vllm_error(content)
    if body is not None:
        body["error"].setdefault("param", None)
        body["error"].setdefault("code", status)
        return JSONResponse(body, status_code=status)
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    return JSONResponse(OpenAIError(message, status=status, type=kind, code=status).body(), status_code=status)


NEUTRAL_SAMPLING: dict[str, Any] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
    "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
}  # fmt: skip
"""vLLM's own defaults for the sampling knobs it otherwise reads from a model's generation config."""


def fill_sampling(body: dict[str, Any]) -> dict[str, Any]:
    """Give every sampling knob the request left out (or null) its neutral value; returns the
    ``sampling`` field of the answer's choices (what vLLM will apply)."""
    for key, value in NEUTRAL_SAMPLING.items():
        if body.get(key) is None:
            body[key] = value
    temperature, top_p, top_k = body["temperature"], body["top_p"], body["top_k"]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (temperature, top_p, top_k)):
        return {}  # vLLM answers a 400 for it
    return sampling_field(float(temperature), float(top_p), int(top_k))


def add_sampling(choices: Any, sampling: dict[str, Any]) -> None:
    """Each choice's ``sampling`` field (none when the request's values were not numbers)."""
    if sampling and isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict):
                choice["sampling"] = dict(sampling)


def prepare_chat_body(body: dict[str, Any], served_name: str, base_names: set[str]) -> bool:
    """Ask for token ids and logprobs; fill in neutral sampling (:func:`fill_sampling`); let tracerl
    parse tool calls. Returns whether to parse them."""
    if body.get("model") in base_names:
        body["model"] = served_name
    fill_sampling(body)
    body["return_token_ids"] = True
    if not body.get("logprobs"):
        body["logprobs"] = True
    tool_choice = body.get("tool_choice")
    parse = bool(body.get("tools")) and tool_choice in (None, "auto")
    if parse:
        body["tool_choice"] = "none"  # vLLM still renders the tools; we parse the text
    return parse


def finish_chat_body(
    result: dict[str, Any], parse_tools: bool, turns: TurnReader, sampling: dict[str, Any] | None = None
) -> dict[str, Any]:
    """vLLM's answer with each reply read by ``turns`` (tool calls, reasoning) from its token ids, and
    each choice's ``sampling`` (the request's, as :func:`fill_sampling` returned it)."""
    prompt_ids = result.get("prompt_token_ids")
    add_sampling(result.get("choices"), sampling or {})
    for choice in result.get("choices", []):
        if prompt_ids is not None:
            choice.setdefault("prompt_token_ids", prompt_ids)
        message = choice.get("message") or {}
        if isinstance(message.get("content"), str):
            read = turns.message(choice.get("token_ids") or [], message["content"], parse_tools=parse_tools)
            message.update(read)
            if read.get("tool_calls") and choice.get("finish_reason") != "length":
                choice["finish_reason"] = "tool_calls"
    return result


def build_proxy(server: ProxiedServer) -> Any:
    import httpx

    app = untraced_fastapi(title="tracerl vLLM proxy")
    install_error_handlers(app)
    app.add_middleware(BearerAuth, key=server.api_key)  # the same key as vLLM's, forwarded below
    clients: dict[str, httpx.AsyncClient] = {}

    def client() -> httpx.AsyncClient:
        if "c" not in clients:  # created lazily inside the proxy's own event loop
            headers = {"Authorization": f"Bearer {server.api_key}"}
            clients["c"] = httpx.AsyncClient(base_url=server.vllm_url, timeout=httpx.Timeout(3600, connect=10), headers=headers)
        return clients["c"]

    base_names = {server.served_name, "base", str(server.model_path)}

    async def complete_chat(body: dict[str, Any]) -> dict[str, Any]:
        """A chat request through vLLM; vLLM's error as ours (its body kept for the chat route)."""
        asked_for_policy = body.get("model") in server.aliases
        parse = prepare_chat_body(body, server.served_name, base_names | server.aliases)
        sampling = fill_sampling(body)
        async with server.gate.request() as policy:  # no reload until the answer is back: one policy per answer
            response = await client().post("/v1/chat/completions", json=body)
        if response.status_code != 200:
            error = OpenAIError(_vllm_error(response.content)[1], status=response.status_code)
            error.upstream = response.content
            raise error
        assert server.turns is not None  # set by start(), before the proxy serves
        result = finish_chat_body(response.json(), parse, server.turns, sampling)
        if asked_for_policy and policy:
            result["model"] = policy  # a straggler asking for agent@3 was answered by agent@4's weights
        return result

    gated = add_api_routes(app, complete_chat)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError as error:
            raise OpenAIError(f"the request body is not valid JSON: {error}") from error
        if not isinstance(body, dict):
            raise OpenAIError("the request body must be a JSON object")
        stream = bool(body.pop("stream", False))  # answered as events of the finished completion
        include_usage = bool((body.pop("stream_options", None) or {}).get("include_usage"))
        try:
            completion = await gated(body)
        except OpenAIError as error:
            if error.upstream is None:
                raise
            return _error_response(error.status, error.upstream)  # vLLM's own error body, as it sent it
        if stream:
            return StreamingResponse(stream_events(completion, include_usage), media_type="text/event-stream")
        return completion

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def forward(path: str, request: Request) -> Any:
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        body = await request.body()
        sampling: dict[str, Any] = {}
        if request.method == "POST" and path == "v1/completions":
            body, sampling = _completions_body(body)
        async with server.gate.request():  # /v1/completions and the rest generate too: not across a reload
            response = await client().request(request.method, "/" + path, content=body, headers=headers, params=request.query_params)
        if response.status_code >= 400:
            return _error_response(response.status_code, response.content)
        media = response.headers.get("content-type", "application/json")
        content = _with_sampling(response.content, sampling) if sampling else response.content
        return Response(content, status_code=response.status_code, media_type=media)

    return app


def _completions_body(body: bytes) -> tuple[bytes, dict[str, Any]]:
    """A ``/v1/completions`` request with neutral sampling filled in, and its choices' ``sampling``
    (none for a body that is not a JSON object: vLLM answers it)."""
    import json

    try:
        request = json.loads(body)
    except ValueError:
        return body, {}
    if not isinstance(request, dict):
        return body, {}
    sampling = fill_sampling(request)
    return json.dumps(request).encode(), sampling


def _with_sampling(content: bytes, sampling: dict[str, Any]) -> bytes:
    """vLLM's completions answer (JSON, or server-sent events) with ``sampling`` on every choice."""
    import json

    def patched(text: str) -> str:
        data = json.loads(text)
        if isinstance(data, dict):
            add_sampling(data.get("choices"), sampling)
        return json.dumps(data)

    try:
        if not content.lstrip().startswith(b"data:"):
            return patched(content.decode()).encode()
        lines = content.decode().split("\n")
        for i, line in enumerate(lines):
            if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                lines[i] = "data: " + patched(line[5:].strip())
        return "\n".join(lines).encode()
    except ValueError:  # not what vLLM writes: passed on as it came
        return content
