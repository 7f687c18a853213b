"""``RayBackend``: ART's backend shape on a Ray cluster.

The trainer is a Ray actor (placed where its ``num_gpus``/``num_cpus`` fit: the node with the
accelerator) holding a :class:`~tracerl.LocalBackend` that trains without serving; checkpoints are
written there in the usual layout (``{path}/{project}/models/{name}/checkpoints/{step:04d}``, run lock
and crash safety included).  Inference is a :class:`~tracerl.cluster.ray_replicas.RayReplicas`.
After each step the trainer puts the new adapter's files in Ray's object store and every replica
writes its own copy and hot-loads it as ``name@step`` before ``train`` returns, so the next rollouts
can use it: the bytes go from the trainer's node to the replicas' nodes, never through this process
and never through a shared filesystem.  ``history.jsonl`` is written here, by ``model.log``, as
with ``RemoteBackend``.  Errors the trainer raises (``ConfigError``, ``TrajectoryError``,
``NonFiniteError``, a ``TypeError`` for an unknown keyword) are raised here as they are.
``train_sft`` runs ``LocalBackend.train_sft`` on the actor the same way (its ``sft`` history row
also written here).

If the trainer actor dies (its process exits or is killed, its node leaves), every call raises
:class:`~tracerl.errors.InfrastructureError` at once: nothing is retried on a new actor, since a
half-taken step must not be taken twice.  What the dead process committed stays (checkpoints are
renamed into place whole), what it had not is cleaned away by the next ``register``, and the run
lock went with the process, so a new ``RayBackend`` on the same ``path`` resumes from the last
committed step (tests/test_ray_backend_faults.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Iterable

from ..errors import CheckpointError, InfrastructureError
from ..model import Model, TrainableModel
from ..types import TrainResult, TrajectoryGroup
from .ray_replicas import RayReplicas, adapter_files
from .ray_rollouts import original_error


class _TrainerActor:
    """The trainer on its node (made a Ray actor by :meth:`RayBackend._start_trainer`)."""

    def __init__(self, options: dict[str, Any]) -> None:
        from ..train.local_backend import LocalBackend

        self.backend = LocalBackend(inference=None, **options)
        self.models: dict[str, TrainableModel] = {}

    async def register(self, spec: dict[str, Any]) -> tuple[int, Any]:
        """Open (or resume) the model's run directory here; its latest adapter's files, in the object store."""
        model = TrainableModel(**spec)
        await self.backend.register(model)
        self.models[model.name] = model
        step = await self.backend.get_step(model)
        return step, self._shipped(model, step)

    async def train(self, name: str, groups: list[TrajectoryGroup], kwargs: dict[str, Any]) -> tuple[TrainResult, Any]:
        result = await self.backend.train(self.models[name], groups, **kwargs)
        return result, self._shipped(self.models[name], result.step)

    async def train_sft(self, name: str, examples: list[Any], config: Any, val: list[Any] | None) -> tuple[TrainResult, Any]:
        result = await self.backend.train_sft(self.models[name], examples, config, val_trajectories=val)
        return result, self._shipped(self.models[name], result.step)

    def _shipped(self, model: TrainableModel, step: int) -> Any:
        import ray

        return ray.put(adapter_files(model.run_dir.checkpoint_path(step)))

    async def get_step(self, name: str) -> int:
        return await self.backend.get_step(self.models[name])

    async def list_checkpoints(self, name: str) -> list[int]:
        return await self.backend.list_checkpoints(self.models[name])

    async def delete_checkpoints(self, name: str, keep: list[int]) -> list[int]:
        return await self.backend.delete_checkpoints(self.models[name], keep)

    async def close(self) -> None:
        await self.backend.close()


class RayBackend:
    """Trains on a Ray actor, serves through :class:`RayReplicas` (see the module doc)."""

    def __init__(
        self,
        replicas: RayReplicas,
        *,
        path: str | Path | None = None,
        num_cpus: float = 1,
        num_gpus: float = 0,
        device: str | None = None,
        micro_batch_tokens: int = 2048,
        max_seq_len: int | None = 4096,
        train_workers: int = 1,
    ) -> None:
        """``replicas``: the inference replicas (started by ``register`` if they are not yet);
        ``path``: the run directories' root on the trainer's node (default: the model's
        ``base_path``, made absolute here); ``num_cpus``/``num_gpus``: what the trainer actor needs
        (with ``train_workers=N`` data-parallel torchrun processes on its node, reserve N of them)."""
        self.replicas = replicas
        self.path = str(Path(path).resolve()) if path is not None else None
        self.resources = {"num_cpus": num_cpus, "num_gpus": num_gpus}
        self.options: dict[str, Any] = {"device": device, "micro_batch_tokens": micro_batch_tokens, "max_seq_len": max_seq_len,
                                        "train_workers": train_workers}
        self._trainer: Any = None
        self._models: dict[str, TrainableModel] = {}

    async def _call(self, method: str, *args: Any) -> Any:
        """One trainer-actor call; its own errors raised as they are, a lost actor as InfrastructureError."""
        from ray.exceptions import RayError, RayTaskError

        try:
            return await getattr(self._trainer, method).remote(*args)
        except RayTaskError as error:
            raise original_error(error) from None
        except RayError as error:
            raise InfrastructureError(f"the Ray trainer actor failed ({method}): {type(error).__name__}: {error}") from error

    async def register(self, model: Model) -> None:
        if not isinstance(model, TrainableModel):
            return  # a prompted model needs no storage or serving from us
        import ray

        if self._trainer is None:
            if not ray.is_initialized():
                raise InfrastructureError("Ray is not running here: call ray.init() (or ray.init(address=...)) first")
            self._trainer = ray.remote(**self.resources)(_TrainerActor).remote(self.options)
        spec = {"name": model.name, "project": model.project, "base_model": model.base_model,
                "lora_config": model.lora_config, "base_path": self.path or str(Path(model.base_path).resolve())}
        step, files = await self._call("register", spec)
        if self.replicas.router is None:
            await self.replicas.start()
        await self.replicas.load_adapter_files(model.get_inference_name(step), files)
        self._models[model.name] = model
        model._step_cache = step
        model.inference_base_url = self.replicas.base_url
        model.inference_api_key = self.replicas.api_key
        model.inference_model_name = model.get_inference_name(step)

    def _registered(self, model: Model) -> str:
        if self._models.get(model.name) is not model:
            raise CheckpointError(f"model {model.name!r} is not registered with this backend: await model.register(backend)")
        return model.name

    async def train(self, model: Model, trajectory_groups: Iterable[TrajectoryGroup], **kwargs: Any) -> TrainResult:
        """One GRPO step on the trainer actor, then ``name@step`` hot-loaded on every replica."""
        name = self._registered(model)
        result, files = await self._call("train", name, list(trajectory_groups), kwargs)
        loading = asyncio.get_running_loop().time()
        await self.replicas.load_adapter_files(model.get_inference_name(result.step), files)
        result.metrics["hot_load_seconds"] = asyncio.get_running_loop().time() - loading
        model._step_cache = result.step  # type: ignore[attr-defined]
        model.inference_model_name = model.get_inference_name(result.step)
        return result

    async def train_sft(self, model: Model, trajectories: Any, config: Any = None, *, val_trajectories: Any = None) -> TrainResult:
        """``LocalBackend.train_sft`` on the trainer actor, then ``name@step`` hot-loaded on every replica.

        The examples are read and checked here (a bad file line fails before anything is sent) and
        travel to the actor as ``Trajectory`` objects; the ``sft`` history row is also written to this
        machine's ``history.jsonl``, where ``model.log`` writes the others (as ``RemoteBackend`` does)."""
        from ..runs.storage import history_row, logged_splits
        from ..train.sft_config import SFTConfig
        from ..train.sft_data import as_sft_examples

        name = self._registered(model)
        config = SFTConfig.coerce(config)
        val = None if val_trajectories is None else as_sft_examples(val_trajectories)
        result, files = await self._call("train_sft", name, as_sft_examples(trajectories), config, val)
        await self.replicas.load_adapter_files(model.get_inference_name(result.step), files)
        model._step_cache = result.step  # type: ignore[attr-defined]
        model.inference_model_name = model.get_inference_name(result.step)
        run_dir = model.run_dir
        if not any(row.get("step") == result.step and "sft" in logged_splits(row) for row in run_dir.read_history()):
            run_dir.append_history(history_row(result.step, "sft", result.metrics))
        return result

    async def get_step(self, model: Model) -> int:
        return int(await self._call("get_step", self._registered(model)))

    async def list_checkpoints(self, model: Model) -> list[int]:
        return list(await self._call("list_checkpoints", self._registered(model)))

    async def delete_checkpoints(self, model: Model, keep: list[int]) -> list[int]:
        return list(await self._call("delete_checkpoints", self._registered(model), list(keep)))

    async def close(self) -> None:
        """Stop the replicas and the trainer (its run locks released); the actor is ended by handle."""
        import ray
        from ray.exceptions import RayActorError

        try:
            await self.replicas.stop()
        finally:
            if self._trainer is not None:
                try:
                    await self._trainer.close.remote()
                except RayActorError:  # the actor already died: its process, and with it the run lock, is gone
                    pass
                finally:
                    ray.kill(self._trainer)
                    self._trainer = None

    async def __aenter__(self) -> "RayBackend":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
