"""The Tinker service's sampler: the inference server that holds every tenant's sampler weights.

Two kinds, chosen with ``TinkerService(sampler=...)`` (``tracerl serve --tinker-sampler``):

* ``"transformers"`` (the default): tracerl's in-process engine
  (:class:`~tracerl.inference.transformers_server.TransformersServer`).  Rows of different tenants'
  adapters share each forward (:mod:`tracerl.inference.multi_lora`): on a CPU, the faster of the two.
* ``"vllm"``: a vLLM server with run-time LoRA (:class:`~tracerl.inference.vllm_server.VLLMServer`), what
  GPUs run: continuous batching across adapters, its paged KV cache.  Adapters are loaded and
  unloaded with vLLM's ``/v1/load_lora_adapter`` routes; sampling and prompt scoring are vLLM's own
  ``/v1/completions`` (token-id prompts, ``n`` samples, the sampled distribution's logprobs, prompt
  logprobs).  vLLM holds at most ``max_loras`` adapters in a batch and serves adapters of rank up to
  its ``--max-lora-rank``: both are set from the service's limits.

Both answer the same three calls: :meth:`load_adapter` / :meth:`unload_adapter` (from a worker
thread: :class:`~tracerl.tinker.sampler_adapters.SamplerAdapters` runs them) and :meth:`sample`
(on the service's loop), and serve tenants' ``/v1`` requests at ``base_url`` with ``api_key``.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..errors import ConfigError, InferenceServerError

SAMPLERS = ("transformers", "vllm")
ADAPTER_CALL_TIMEOUT_S = 600.0
"""A load or unload of an adapter in vLLM (its own timeout on the HTTP call)."""


@dataclass(frozen=True)
class Sampled:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass(frozen=True)
class SampleRequest:
    prompt: list[int]
    adapter: str | None
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int  # 0: no top-k
    stop: list[str]
    stop_token_ids: list[int]
    seed: int | None
    with_prompt_logprobs: bool


class Sampler(Protocol):
    base_url: str
    api_key: str

    @property
    def base_names(self) -> set[str]: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def adapters_loaded(self) -> int: ...
    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def load_adapter(self, name: str, folder: Path, answer_as: str) -> None: ...
    def unload_adapter(self, name: str) -> None: ...
    async def sample(self, request: SampleRequest) -> tuple[list[Sampled], list[float] | None]: ...


class _OverServer:
    """What tenants' ``/v1`` requests are proxied to: the inference server's own URL and key."""

    server: Any

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def api_key(self) -> str:
        return self.server.api_key


class TransformersSampler(_OverServer):
    """tracerl's transformers engine, in this process."""

    def __init__(self, model_path: Path, *, served_name: str, dtype: Any, max_batch_rows: int) -> None:
        from ..inference.transformers_server import TransformersServer

        self.server = TransformersServer(model_path, served_name=served_name, dtype=dtype, max_batch_rows=max_batch_rows)

    @property
    def engine(self) -> Any:
        return self.server.engine

    @property
    def base_names(self) -> set[str]:
        return self.server.base_names

    @property
    def vocab_size(self) -> int:
        return int(self.engine.vocab_size)

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def adapters_loaded(self) -> int:
        return len(self.engine.adapter_names)

    async def start(self) -> None:
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop()

    def load_adapter(self, name: str, folder: Path, answer_as: str) -> None:
        self.engine.load_adapter(name, folder)
        self.server.answer_as[name] = answer_as  # /v1 answers carry the tenant's own name

    def unload_adapter(self, name: str) -> None:
        if self.engine.has_adapter(name):
            self.engine.unload_adapter(name)
        self.server.answer_as.pop(name, None)

    async def sample(self, request: SampleRequest) -> tuple[list[Sampled], list[float] | None]:
        from ..inference.engine import GenerationJob

        engine = self.engine
        job = GenerationJob(
            prompt_ids=request.prompt, adapter=request.adapter, n=request.n, temperature=request.temperature,
            top_p=request.top_p, top_k=request.top_k, max_tokens=request.max_tokens, stop=request.stop,
            stop_token_ids=request.stop_token_ids, seed=request.seed,
        )  # fmt: skip
        scored = None
        if request.with_prompt_logprobs:
            entries, last = await asyncio.to_thread(engine.prompt_logprobs, request.prompt, request.adapter)
            scored = [entry.logprob for entry in entries[1:]]
            if request.n == 1 and request.max_tokens == 1:  # compute_logprobs: the one token comes from the scoring pass
                one = engine.one_token(last, job.temperature, job.seed, top_p=job.top_p, top_k=job.top_k)
                finish = "stop" if one.token_ids[-1] in job.stop_token_ids else one.finish_reason
                return [Sampled(one.token_ids, one.logprobs, finish)], scored
        samples = await asyncio.wrap_future(engine.submit(job))
        return [Sampled(s.token_ids, s.logprobs, s.finish_reason) for s in samples], scored


class VLLMSampler(_OverServer):
    """A vLLM server with run-time LoRA (its own process, from tracerl's vLLM runtime)."""

    def __init__(self, model_path: Path, *, served_name: str, dtype: Any, max_loras: int, max_lora_rank: int,
                 request_timeout_s: float = 600.0, **server_options: Any) -> None:  # fmt: skip
        from ..inference.vllm_server import VLLMServer, vllm_lora_rank

        config = json.loads((Path(model_path) / "config.json").read_text())
        self._vocab_size = int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size"))
        self.served_name = served_name
        self.server = VLLMServer(
            model_path, served_name=served_name, max_loras=max_loras, max_cpu_loras=max_loras,
            max_lora_rank=vllm_lora_rank(max_lora_rank), dtype=dtype,
            **server_options,
        )  # fmt: skip
        self.request_timeout_s = request_timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self._loaded: set[str] = set()
        self._http: Any = None

    @property
    def base_names(self) -> set[str]:
        return {self.served_name}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_model_len(self) -> int:
        return int(self.server.max_model_len)

    @property
    def adapters_loaded(self) -> int:
        return len(self._loaded)

    async def start(self) -> None:
        import httpx

        self.loop = asyncio.get_running_loop()
        await self.server.start()
        self._http = httpx.AsyncClient(timeout=self.request_timeout_s, headers=self.server.auth_headers())

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        await self.server.stop()

    def _on_loop(self, coroutine: Any) -> None:
        """Run ``coroutine`` on the service's loop from a worker thread, and wait for it."""
        if self.loop is None:
            coroutine.close()
            raise InferenceServerError("the vLLM sampler is not started")
        asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=ADAPTER_CALL_TIMEOUT_S)

    def load_adapter(self, name: str, folder: Path, answer_as: str) -> None:
        self._on_loop(self.server.load_adapter(name, folder))  # replaced in place when already loaded
        self._loaded.add(name)

    def unload_adapter(self, name: str) -> None:
        if name in self._loaded:
            self._loaded.discard(name)
            self._on_loop(self.server.unload_adapter(name))

    async def sample(self, request: SampleRequest) -> tuple[list[Sampled], list[float] | None]:
        import httpx

        body: dict[str, Any] = {
            "model": request.adapter or self.served_name, "prompt": request.prompt, "n": request.n,
            "max_tokens": request.max_tokens, "temperature": request.temperature, "top_p": request.top_p,
            "top_k": request.top_k or -1, "logprobs": 0, "return_token_ids": True,
        }  # fmt: skip
        if request.seed is not None:
            body["seed"] = request.seed
        if request.stop:
            body["stop"] = request.stop
        if request.stop_token_ids:
            body["stop_token_ids"] = request.stop_token_ids
        if request.with_prompt_logprobs:
            body["prompt_logprobs"] = 0
        try:
            answer = await self._http.post(self.server.vllm_url + "/v1/completions", json=body)
        except httpx.HTTPError as error:
            raise InferenceServerError(f"the vLLM sampler did not answer: {type(error).__name__}: {error}") from error
        if answer.status_code in (400, 404):
            raise ConfigError(f"vLLM refused the sample: {answer.text[:1000]}")
        if answer.status_code != 200:
            raise InferenceServerError(f"vLLM answered {answer.status_code} to a sample: {answer.text[:1000]}")
        choices = sorted(answer.json()["choices"], key=lambda choice: choice["index"])
        samples = []
        for choice in choices:
            ids = [int(t) for t in choice["token_ids"]]
            logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            if len(logprobs) != len(ids):
                raise InferenceServerError(f"vLLM answered {len(ids)} tokens with {len(logprobs)} logprobs")
            finish = "stop" if choice.get("finish_reason") == "stop" else "length"
            samples.append(Sampled(ids, logprobs, finish))
        scored = None
        if request.with_prompt_logprobs:
            entries = choices[0].get("prompt_logprobs") or []
            scored = [float(entry[str(token)]["logprob"]) for token, entry in zip(request.prompt[1:], entries[1:], strict=True)]
        return samples, scored


def make_sampler(kind: str, model_path: Path, *, served_name: str, dtype: Any, max_batch_rows: int, max_loras: int,
                 max_lora_rank: int, **vllm_options: Any) -> Sampler:  # fmt: skip
    """The sampler ``kind`` (:data:`SAMPLERS`) over the base model at ``model_path``."""
    if kind == "transformers":
        return TransformersSampler(model_path, served_name=served_name, dtype=dtype, max_batch_rows=max_batch_rows)
    if kind == "vllm":
        return VLLMSampler(model_path, served_name=served_name, dtype=dtype, max_loras=max_loras, max_lora_rank=max_lora_rank, **vllm_options)
    raise ConfigError(f"sampler must be one of {', '.join(SAMPLERS)}, got {kind!r}")
