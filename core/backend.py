"""The ``Backend`` interface: who serves and trains a ``TrainableModel``.

Implementations: :class:`tracerl.LocalBackend` (this machine, CPU or GPU) and
:class:`tracerl.RemoteBackend` (the HTTP client of ``tracerl serve``, which wraps a
``LocalBackend`` on the machine with the GPUs, so rollouts can stay on a laptop).  Backend
knobs are explicit keyword arguments of ``train``; an unknown keyword is a ``TypeError``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    from .model import Model
    from .types import TrainResult, TrajectoryGroup


@runtime_checkable
class Backend(Protocol):
    async def register(self, model: "Model") -> None:
        """Prepare storage for ``model`` and, if trainable, start serving its latest step."""

    async def train(self, model: "Model", groups: Iterable["TrajectoryGroup"], **kwargs: object) -> "TrainResult":
        """Run one GRPO step on ``groups``, save checkpoint ``step+1``, serve it, return the result."""

    async def train_sft(self, model: "Model", trajectories: Any, config: Any = None, **kwargs: object) -> "TrainResult":
        """Supervised fine-tuning of the same LoRA (one checkpoint step, served as ``name@step``; ``tracerl.sft``)."""

    async def get_step(self, model: "Model") -> int:
        """The model's latest complete checkpoint step."""

    async def list_checkpoints(self, model: "Model") -> list[int]:
        """Steps of the model's complete checkpoints where this backend keeps them, oldest first."""

    async def delete_checkpoints(self, model: "Model", keep: list[int]) -> list[int]:
        """Delete every checkpoint not in ``keep`` (the latest is always kept); return the deleted steps."""

    async def close(self) -> None:
        """Stop servers and release the trainer."""
