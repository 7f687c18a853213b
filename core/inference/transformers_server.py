"""An OpenAI chat-completions server over a transformers model with run-time peft adapters.

The fallback where vLLM cannot run, and the fast path for tests.  It runs in-process: uvicorn
on a background thread with its own event loop, listening on 127.0.0.1 (a free port by
default), and a generation worker thread that batches concurrent requests
(see :mod:`tracerl.inference.engine`).  It speaks what the trainer needs from vLLM:
``return_token_ids``, the sampled distribution's logprobs with each choice's ``sampling``
parameters (:mod:`tracerl.inference.engine`), ``n > 1``, Hermes tool calls, vLLM's
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``, and ``/v1/completions`` with prompt
logprobs (what an on-policy distillation teacher is asked, :mod:`.completions`).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..errors import ConfigError, InferenceServerError, InsufficientMemoryError
from ..net.http_server import BackgroundUvicorn, BearerAuth, OpenAIError, install_error_handlers, new_api_key
from ..net.untraced import untraced_fastapi
from ..redact import register_secret
from .api_routes import add_api_routes
from .chat_template import template_messages
from .protocol import ChatRequest, chat_completion, logprob_entry, parse_chat_request, stream_events
from .turns import TurnReader

if TYPE_CHECKING:  # pragma: no cover
    from .completions import CompletionRequest

BASE_ALIASES = ("base",)


class TransformersServer:
    """``InferenceServer`` over transformers + peft, in this process (fp32 on CPU, bf16 on CUDA).

    ``served_name`` (and ``"base"`` and the model path) serve the base model; adapters are
    served under the names given to :meth:`load_adapter` (e.g. ``"agent@3"``).
    Every route but ``/health`` needs ``Authorization: Bearer <api_key>`` (random per server unless
    given): ``LocalBackend`` hands it to the model (``model.inference_api_key``).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        served_name: str = "base",
        host: str = "127.0.0.1",
        port: int = 0,
        max_batch_rows: int = 16,
        batch_wait_s: float = 0.02,
        num_threads: int | None = None,
        default_max_tokens: int | None = None,
        device: str | None = None,
        dtype: Any = None,
        api_key: str | None = None,
        tool_call_parser: str | None = "auto",
        reasoning_parser: str | None = "auto",
    ) -> None:
        """``device``/``dtype``: where and in what format the model runs (default: CUDA in bf16 when
        visible, else CPU in fp32); ``max_batch_rows``: rows decoded together at most;
        ``tool_call_parser``/``reasoning_parser``: how replies are read (:mod:`tracerl.inference.turns`)."""
        self.model_path = Path(model_path)
        self.api_key = api_key or new_api_key()
        register_secret(self.api_key)
        self.served_name = served_name
        self.host = host
        self._port = port
        self._engine_options = {
            "max_batch_rows": max_batch_rows,
            "batch_wait_s": batch_wait_s,
            "num_threads": num_threads,
            "device": device,
            "dtype": dtype,
        }
        self.default_max_tokens = default_max_tokens
        self._parsers = {"tool_call_parser": tool_call_parser, "reasoning_parser": reasoning_parser}
        self.turns: TurnReader | None = None
        """How replies are read into messages; set by :meth:`start` from the model's template."""
        self.answer_as: dict[str, str] = {}
        """Served name -> the model name its answers carry, for a proxy that renames requests
        (``tracerl serve --tinker`` serves each tenant's ``agent@3`` under a unique name)."""
        self.engine: Any = None
        self._http: BackgroundUvicorn | None = None
        self.base_url = ""

    # --- InferenceServer -------------------------------------------------------------
    async def start(self) -> None:
        if self._http is not None and self._http.running:
            return
        await asyncio.to_thread(self._start_blocking)

    def _start_blocking(self) -> None:
        from .engine import GenerationEngine

        self.turns = TurnReader.for_model(self.model_path, **self._parsers)  # a parser the template contradicts: before loading
        try:
            self.engine = GenerationEngine(self.model_path, **self._engine_options)
        except InsufficientMemoryError:  # already explains itself (free vs needed GPU memory)
            raise
        except Exception as error:  # noqa: BLE001 - translated at the boundary
            raise InferenceServerError(f"could not load {self.model_path}: {type(error).__name__}: {error}") from error
        self.engine.start()
        self._http = BackgroundUvicorn(build_app(self), host=self.host, port=self._port, name="tracerl-transformers")
        port = self._http.start()
        self.base_url = f"http://{self.host}:{port}/v1"

    async def load_adapter(self, name: str, path: str | Path) -> None:
        self._require_started()
        if name in self.base_names:
            raise ConfigError(f"adapter name {name!r} is taken by the base model")
        await asyncio.to_thread(self.engine.load_adapter, name, path)

    async def unload_adapter(self, name: str) -> None:
        self._require_started()
        await asyncio.to_thread(self.engine.unload_adapter, name)

    async def health(self) -> bool:
        if self._http is None or not self._http.running or self.engine is None or not self.engine.alive:
            return False
        import httpx

        try:
            async with httpx.AsyncClient(timeout=5) as client:  # /health needs no key
                return (await client.get(self.base_url.removesuffix("/v1") + "/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def stop(self) -> None:
        await asyncio.to_thread(self._stop_blocking)

    def _stop_blocking(self) -> None:
        if self._http is not None:
            self._http.stop()
            self._http = None
        if self.engine is not None:
            self.engine.stop()

    # --- sharing the cores with a trainer --------------------------------------------
    async def pause(self) -> None:
        """Hold generation (running batches at their next decode step) so a trainer can have the cores."""
        if self.engine is not None:
            self.engine.pause()

    async def resume(self) -> None:
        if self.engine is not None:
            self.engine.resume()

    # --- helpers ---------------------------------------------------------------------
    @property
    def base_names(self) -> set[str]:
        return {self.served_name, *BASE_ALIASES, str(self.model_path)}

    def model_names(self) -> list[str]:
        return [self.served_name, *(self.engine.adapter_names if self.engine else [])]

    def _require_started(self) -> None:
        if self.engine is None or self._http is None:
            raise InferenceServerError("the server is not started: call `await server.start()` first")

    def resolve_model(self, name: str) -> str | None:
        """``None`` for the base model, else the adapter name; 404 when unknown."""
        if name in self.base_names:
            return None
        if self.engine.has_adapter(name):
            return name
        known = ", ".join(repr(n) for n in self.model_names())
        raise OpenAIError(
            f"The model `{name}` does not exist. Served models: {known}",
            status=404,
            type="not_found_error",
            param="model",
            code="model_not_found",
        )

    def render_prompt(self, request: ChatRequest) -> list[int]:
        tokenizer = self.engine.tokenizer
        try:
            text = tokenizer.apply_chat_template(
                template_messages(tokenizer, request.messages),
                tools=request.tools,
                add_generation_prompt=request.add_generation_prompt,
                tokenize=False,
                **request.chat_template_kwargs,
            )
        except Exception as error:  # noqa: BLE001 - a template error is the request's fault
            raise OpenAIError(f"the chat template failed on these messages: {error}", param="messages") from error
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    async def complete(self, request: ChatRequest) -> dict[str, Any]:
        from .engine import GenerationJob

        adapter = self.resolve_model(request.model)
        prompt_ids = self.render_prompt(request)
        room = self.engine.max_model_len - len(prompt_ids)
        if room <= 0:
            raise OpenAIError(
                f"the prompt has {len(prompt_ids)} tokens; the model's context is {self.engine.max_model_len}",
                param="messages",
            )
        max_tokens = request.max_tokens or self.default_max_tokens or room
        if max_tokens > room:
            raise OpenAIError(
                f"max_tokens={max_tokens} plus the {len(prompt_ids)} prompt tokens exceeds the model's "
                f"context of {self.engine.max_model_len}",
                param="max_tokens",
            )
        job = GenerationJob(
            prompt_ids=prompt_ids,
            adapter=adapter,
            n=request.n,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            max_tokens=max_tokens,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            seed=request.seed,
            top_logprobs=request.top_logprobs,
            ignore_eos=request.ignore_eos,
        )
        try:
            results = await asyncio.wrap_future(self.engine.submit(job))
        except ConfigError as error:  # the adapter was unloaded while the request waited
            raise OpenAIError(str(error), status=404, type="not_found_error", param="model") from error
        choices = [self._choice(index, result, request, prompt_ids) for index, result in enumerate(results)]
        return chat_completion(
            model=self.answer_as.get(request.model, request.model),
            prompt_token_ids=prompt_ids,
            choices=choices,
            completion_tokens=sum(len(r.token_ids) for r in results),
            include_ids=request.return_token_ids,
        )

    async def complete_prompt(self, request: "CompletionRequest") -> dict[str, Any]:
        """``/v1/completions``: score the prompt (``prompt_logprobs`` / ``echo``) and generate ``max_tokens``."""
        from .completions import completion_body, legacy_logprobs, vllm_prompt_logprobs
        from .engine import GenerationJob

        adapter = self.resolve_model(request.model)
        tokenizer = self.engine.tokenizer
        if isinstance(request.prompt, str):
            prompt_ids = list(tokenizer(request.prompt, add_special_tokens=False)["input_ids"])
        else:
            prompt_ids = list(request.prompt)
        vocab = self.engine.vocab_size
        if any(t >= vocab for t in prompt_ids):
            raise OpenAIError(f"a prompt token id is outside the vocabulary [0, {vocab})", param="prompt")
        if len(prompt_ids) + request.max_tokens > self.engine.max_model_len:
            raise OpenAIError(
                f"the {len(prompt_ids)} prompt tokens plus max_tokens={request.max_tokens} exceed the model's "
                f"context of {self.engine.max_model_len}",
                param="max_tokens",
            )
        top = max(request.prompt_logprobs or 0, request.logprobs or 0)
        scored = None
        result = None
        if request.prompt_logprobs is not None or (request.echo and request.logprobs is not None):
            try:
                scored, last = await asyncio.to_thread(self.engine.prompt_logprobs, prompt_ids, adapter, top)
            except ConfigError as error:  # the adapter was unloaded meanwhile
                raise OpenAIError(str(error), status=404, type="not_found_error", param="model") from error
            if request.max_tokens == 1:  # what a teacher asks: the one token comes from the same pass
                result = self.engine.one_token(last, request.temperature, request.seed, request.logprobs or 0,
                                               top_p=request.top_p, top_k=request.top_k)  # fmt: skip
        if request.max_tokens > 0 and result is None:
            job = GenerationJob(
                prompt_ids=prompt_ids,
                adapter=adapter,
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=request.top_k,
                max_tokens=request.max_tokens,
                seed=request.seed,
                top_logprobs=request.logprobs or 0,
            )
            try:
                result = (await asyncio.wrap_future(self.engine.submit(job)))[0]
            except ConfigError as error:
                raise OpenAIError(str(error), status=404, type="not_found_error", param="model") from error
        text_of = self.engine.token_text
        generated = result.token_ids if result is not None else []
        text = result.text if result is not None else ""
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": result.finish_reason if result else "length"}
        if request.logprobs is not None:
            ids: list[int] = list(generated)
            lps: list[float | None] = list(result.logprobs) if result is not None else []
            tops: list[Any] = list(result.top_logprobs) if result is not None and request.logprobs else [None] * len(ids)
            if request.echo:
                assert scored is not None
                ids = prompt_ids + ids
                lps = [None if e is None else e.logprob for e in scored] + lps
                tops = [None if e is None else e.top[: request.logprobs] for e in scored] + tops
            choice["logprobs"] = legacy_logprobs(ids, lps, tops, text_of)
        if request.echo:
            choice["text"] = tokenizer.decode(prompt_ids) + text
        if request.prompt_logprobs is not None:
            assert scored is not None
            for entry in scored:
                if entry is not None:
                    entry.top = entry.top[: request.prompt_logprobs]
            choice["prompt_logprobs"] = vllm_prompt_logprobs(scored, text_of)
        if request.return_token_ids:
            choice["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = list(generated)
        if result is not None:
            choice["sampling"] = request.sampling
        return completion_body(model=self.answer_as.get(request.model, request.model), choice=choice, prompt_tokens=len(prompt_ids), completion_tokens=len(generated))

    def _choice(self, index: int, result: Any, request: ChatRequest, prompt_ids: list[int]) -> dict[str, Any]:
        message = self.turns.message(result.token_ids, result.text, parse_tools=request.parse_tools)
        finish = result.finish_reason
        if message.get("tool_calls") and finish != "length":
            finish = "tool_calls"
        choice: dict[str, Any] = {"index": index, "message": message, "logprobs": None, "finish_reason": finish}
        if request.logprobs:
            text = self.engine.token_text
            content = []
            for j, (token, logprob) in enumerate(zip(result.token_ids, result.logprobs)):
                top = result.top_logprobs[j] if result.top_logprobs else []
                content.append(logprob_entry(text(token), logprob, [(text(t), lp) for t, lp in top]))
            choice["logprobs"] = {"content": content}
        if request.return_token_ids:
            choice["token_ids"] = result.token_ids
            choice["prompt_token_ids"] = prompt_ids
        choice["sampling"] = request.sampling  # what the logprobs above are the distribution of
        return choice


def build_app(server: TransformersServer) -> Any:
    """The FastAPI app of ``server`` (OpenAI routes + vLLM's adapter routes)."""
    app = untraced_fastapi(title="tracerl transformers server")
    install_error_handlers(app)
    app.add_middleware(BearerAuth, key=server.api_key)

    async def json_body(request: Request) -> Any:
        try:
            return await request.json()
        except ValueError as error:
            raise OpenAIError(f"the request body is not valid JSON: {error}") from error

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        now = int(time.time())
        data = [
            {"id": name, "object": "model", "created": now, "owned_by": "tracerl", "root": str(server.model_path),
             "parent": None if i == 0 else server.served_name}
            for i, name in enumerate(server.model_names())
        ]
        return {"object": "list", "data": data}

    async def complete_chat(body: dict[str, Any]) -> dict[str, Any]:
        return await server.complete(parse_chat_request(body))

    gated = add_api_routes(app, complete_chat)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await json_body(request)
        chat = parse_chat_request(body)  # a bad request is a 400 before anything else
        completion = await gated(body)
        if chat.stream:
            return StreamingResponse(stream_events(completion, chat.include_usage), media_type="text/event-stream")
        return completion

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        from .completions import parse_completion_request

        return await server.complete_prompt(parse_completion_request(await json_body(request)))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Any:
        body = await json_body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise OpenAIError("'lora_name' and 'lora_path' are required strings", param="lora_name")
        if server.engine.has_adapter(name) and not body.get("load_inplace", False):
            raise OpenAIError(f"The lora adapter '{name}' has already been loaded. Pass load_inplace to replace it.",
                              param="lora_name")
        try:
            await server.load_adapter(name, path)
        except ConfigError as error:
            raise OpenAIError(str(error), param="lora_path") from error
        return f"Success: LoRA adapter '{name}' added successfully."

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Any:
        body = await json_body(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or not server.engine.has_adapter(name):
            raise OpenAIError(f"The lora adapter '{name}' cannot be found.", status=404, type="not_found_error",
                              param="lora_name", code="model_not_found")
        await server.unload_adapter(name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    return app
