"""The ``InferenceServer`` interface (DESIGN §4) and :func:`make_server`.

Both implementations speak the OpenAI chat-completions protocol at ``base_url`` (tool calls,
``n > 1``, logprobs, vLLM's ``return_token_ids``) and load peft adapters at run time under
served names such as ``"agent@3"``:

- :class:`~tracerl.inference.vllm_server.VLLMServer`: a managed vLLM subprocess (from a
  runtime venv tracerl installs, see :func:`~tracerl.inference.vllm_server.install_vllm_runtime`);
- :class:`~tracerl.inference.transformers_server.TransformersServer`: transformers + peft in
  this process, the fallback where vLLM cannot run and the fast path for tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from ..errors import ConfigError

ServerKind = Literal["auto", "vllm", "transformers"]


@runtime_checkable
class InferenceServer(Protocol):
    """An OpenAI-compatible server for a base model plus run-time LoRA adapters."""

    base_url: str
    """``http://host:port/v1`` once started."""

    async def start(self) -> None:
        """Start serving; returns when requests can be answered (raises ``InferenceServerError``)."""

    async def load_adapter(self, name: str, path: str) -> None:
        """Serve the peft adapter folder ``path`` as model ``name``; an existing ``name`` is replaced in place."""

    async def health(self) -> bool:
        """True while the server answers."""

    async def stop(self) -> None:
        """Stop serving and release the process(es) and threads started by :meth:`start`."""


@runtime_checkable
class PausableServer(InferenceServer, Protocol):
    """A server that can hold generation while a trainer uses the same cores (both implementations are)."""

    async def pause(self) -> None:
        """Hold generation; requests in flight and new ones wait (they are not dropped)."""

    async def resume(self) -> None:
        """Continue generating."""


def make_server(kind: ServerKind, model_path: str | Path, *, served_name: str, **options: Any) -> InferenceServer:
    """Create (not start) an inference server of ``kind`` for the HF model folder ``model_path``.

    ``"auto"`` picks vLLM when its runtime is installed (the ``vllm`` package importable here,
    ``$TRACERL_VLLM_PYTHON`` or the runtime venv of :func:`install_vllm_runtime`), else
    transformers.  ``options`` go to the implementation's constructor.
    """
    if kind == "auto":
        from .vllm_server import vllm_python

        kind = "vllm" if vllm_python() is not None else "transformers"
    if kind == "vllm":
        from .vllm_server import VLLMServer

        return VLLMServer(model_path, served_name=served_name, **options)
    if kind == "transformers":
        from .transformers_server import TransformersServer

        return TransformersServer(model_path, served_name=served_name, **options)
    raise ConfigError(f"inference server kind must be 'auto', 'vllm' or 'transformers', got {kind!r}")
