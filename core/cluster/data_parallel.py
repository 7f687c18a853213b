"""Data-parallel GRPO steps over torch.distributed ranks (gloo on CPU; nccl on CUDA, not yet run).

:class:`DataParallelLoRATrainer` is :class:`~tracerl.train.trainer.LoRATrainer` with the step's packed
micro-batches shared out between the ranks.  Every rank holds the same base model and adapter
(rank 0's, broadcast at start: a new LoRA's ``A`` is random), computes the loss of its share with
the *step's* normaliser (the trained tokens of all micro-batches), and the LoRA gradients are
summed with one all-reduce.  Clipping and AdamW then see the same gradient on every rank, so each
takes the same step, and that step is one process's to float tolerance: the same sum, reordered.
A failure on one rank (a non-finite loss, a bad token id, anything) is raised on every rank before
any gradient is exchanged, so no rank waits forever and none applies an update.

:class:`PersistentLoRATrainer` (``LocalBackend(train_workers=N)``) starts the ranks once, as
processes of this machine kept for the run (:class:`~tracerl.cluster.rank_pool.RankPool`: a socket
pair to each, every wait bounded, a rank that dies an ``InfrastructureError``); each loads the base
model once and steps, saves and restores its adapter on command.  The parent holds no model of its
own unless something asks for one (SFT, merged serving): then it loads a copy on the CPU.
:func:`train_step_data_parallel` runs one step that way from Python.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..train.packing import MicroBatch
from ..train.trainer import LoRASettings, LoRATrainer, StepConfig, trained_tokens
from .rank_pool import RankPool, describe_error, rebuild_error, serve_commands


def shard(micro_batches: Sequence[MicroBatch], rank: int, world: int) -> list[MicroBatch]:
    """This rank's micro-batches: greedily balanced by tokens, the same split on every rank."""
    loads = [0] * world
    owner: dict[int, int] = {}
    for index in sorted(range(len(micro_batches)), key=lambda i: (-micro_batches[i].num_tokens, i)):
        least = min(range(world), key=lambda r: (loads[r], r))
        owner[index] = least
        loads[least] += micro_batches[index].num_tokens
    return [mb for i, mb in enumerate(micro_batches) if owner[i] == rank]


class DataParallelLoRATrainer(LoRATrainer):
    """A :class:`LoRATrainer` that is one rank of a data-parallel group (see the module doc)."""

    def __init__(self, model_path: str | os.PathLike[str], **options: Any) -> None:
        if not dist.is_initialized():
            raise ConfigError("DataParallelLoRATrainer needs torch.distributed's process group (torchrun sets it up)")
        super().__init__(model_path, **options)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        with torch.no_grad():
            for param in self.params:
                dist.broadcast(param.data, src=0)

    def _accumulate(
        self, micro_batches: Sequence[MicroBatch], config: StepConfig, *, normalizer: float | None = None
    ) -> tuple[dict[str, float], list[torch.Tensor], list[torch.Tensor]]:
        """This rank's share, then the gradients and the step's totals summed over the ranks."""
        if normalizer is None:
            normalizer = trained_tokens(micro_batches)
        failure: Exception | None = None
        try:
            totals, sampler, trainer = super()._accumulate(
                shard(micro_batches, self.rank, self.world), config, normalizer=normalizer)
        except Exception as error:  # noqa: BLE001 - raised below, on every rank at once
            failure = error
        failed = torch.tensor([0.0 if failure is None else 1.0], device=self.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if float(failed):
            self._raise_everywhere(failure)
        self._all_reduce_gradients()
        return self._summed(totals), *self._gathered(sampler, trainer)

    def _raise_everywhere(self, failure: Exception | None) -> None:
        """Raise on every rank: the rank's own error, or the first failed rank's as the same type."""
        reports: list[Any] = [None] * self.world
        dist.all_gather_object(reports, None if failure is None else describe_error(failure))
        if failure is not None:
            raise failure
        rank, report = next((r, report) for r, report in enumerate(reports) if report is not None)
        raise rebuild_error(report, prefix=f"data-parallel rank {rank}: ")

    def _all_reduce_gradients(self) -> None:
        """Sum every LoRA gradient over the ranks in one flat all-reduce (a rank without
        micro-batches contributes zeros)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for param, grad in zip(self.params, grads):
            param.grad = flat[offset : offset + grad.numel()].view_as(grad).clone()
            offset += grad.numel()

    def _summed(self, totals: dict[str, float]) -> dict[str, float]:
        keys = sorted(k for k in totals if not k.endswith("_max"))
        maxima = sorted(k for k in totals if k.endswith("_max"))
        values = torch.tensor([totals[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        largest = torch.tensor([totals[k] for k in maxima], dtype=torch.float64, device=self.device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        return {**dict(zip(keys, values.tolist())), **dict(zip(maxima, largest.tolist()))}

    def _gathered(self, sampler: list[torch.Tensor], trainer: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every rank's sampler and trainer logprobs (for ``sampler_trainer_prob_corr``)."""
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, (sampler, trainer))
        return [x for rank_sampler, _ in parts for x in rank_sampler], [x for _, rank_trainer in parts for x in rank_trainer]


STEP_TIMEOUT = 1800.0
"""Seconds a step (and each rank's collectives) may take before it is an ``InfrastructureError``."""
START_TIMEOUT = 600.0
"""Seconds for the ranks to start, join their process group and load the model."""
SAVE_TIMEOUT = 300.0
_MUTATING = frozenset({"apply_update", "optimizer", "params"})
"""What, reached through the parent's own copy, can change the adapter: the ranks take it back before their next step."""
_OWN = frozenset({"_pool", "_local", "_local_ahead", "_chunk_size"})


class PersistentLoRATrainer:
    """A trainer whose steps are taken by ``workers`` data-parallel ranks started once (see the module doc).

    It answers what :class:`LoRATrainer` answers for ``LocalBackend``: :meth:`step` (on the
    ranks), :meth:`save` (rank 0 writes the adapter, optimizer state and trainer state, the same
    files a single process writes), and anything else (``model``, ``apply_update``,
    ``forward_token_logprobs``... for merged serving and SFT) from a copy the parent loads on the
    CPU the first time it is asked, from the ranks' adapter.  An update made through that copy is
    given back to the ranks before their next step; after each step the copy takes the ranks'
    adapter.  :meth:`close` stops the ranks; so does dropping the last reference to the trainer.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        workers: int,
        lora: LoRASettings = LoRASettings(),
        adapter_path: str | os.PathLike[str] | None = None,
        device: str | None = None,
        dtype: torch.dtype | str | None = None,
        logprob_chunk_size: int = 256,
        gradient_checkpointing: bool | int = False,
        start_timeout: float = START_TIMEOUT,
        step_timeout: float = STEP_TIMEOUT,
    ) -> None:
        """``device``: ``"cpu"`` (gloo; ranks share the cores, ``OMP_NUM_THREADS`` split between
        them unless set) or ``"cuda"`` (nccl, rank ``i`` on GPU ``i``: not yet run).  ``adapter_path``:
        resume from a checkpoint (adapter and optimizer state), as :class:`LoRATrainer`."""
        from ..inference.devices import default_device

        if workers < 1:
            raise ConfigError(f"train_workers must be >= 1, got {workers}")
        self.model_path, self.workers, self.lora = str(model_path), workers, lora
        self.device = str(device or default_device())
        self.step_timeout = step_timeout
        self._local: LoRATrainer | None = None
        self._local_ahead = False
        self._chunk_size = logprob_chunk_size
        self._pool = _start_ranks(workers, self.device.split(":")[0], step_timeout)
        try:
            dtype_name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype
            load = {"model_path": self.model_path, "lora": asdict(lora), "adapter_path": str(adapter_path) if adapter_path else None,
                    "dtype": dtype_name, "logprob_chunk_size": logprob_chunk_size,
                    "gradient_checkpointing": gradient_checkpointing}  # fmt: skip
            self.dtype: torch.dtype = getattr(torch, self._pool.call("load", load, timeout=start_timeout)[0])
        except BaseException:
            self._pool.close()
            raise

    # -- what the ranks do -----------------------------------------------------------
    def step(self, micro_batches: Sequence[MicroBatch], config: StepConfig) -> dict[str, float]:
        """One GRPO step on the ranks (see :meth:`LoRATrainer.step`); its errors are raised here as their types."""
        if self._local_ahead:
            self._give_back_local()
        metrics = self._pool.call("step", {"micro_batches": list(micro_batches), "config": config.to_dict()},
                                  timeout=self.step_timeout)[0]  # fmt: skip
        if self._local is not None:
            self._refresh_local()
        return {**metrics, "data_parallel_workers": float(self.workers)}

    def save(self, path: str | os.PathLike[str], *, step: int, with_optimizer: bool = True) -> None:
        """Write the adapter (peft format), the optimizer state and ``trainer_state.json`` to ``path``."""
        if self._local_ahead:
            assert self._local is not None
            self._local.save(path, step=step, with_optimizer=with_optimizer)
            return
        self._pool.call("save", {"path": str(path), "step": step, "with_optimizer": with_optimizer}, timeout=SAVE_TIMEOUT, ranks=[0])

    def rank_stats(self) -> list[dict[str, Any]]:
        """Each rank's ``pid``, ``model_loads``, ``steps`` and whether it recomputes activations (``checkpointing``),
        as of its last answer."""
        return [dict(stats) for stats in self._pool.stats]

    def close(self) -> None:
        """Stop the ranks (asked, then by process id) and drop the parent's copy; safe to call twice."""
        self._pool.close()
        self._local = None

    # -- the parent's copy -------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in _OWN:  # not set yet (a failed __init__): never the copy
            raise AttributeError(name)
        local = self._local_copy()
        if name in _MUTATING:
            self._local_ahead = True
        return getattr(local, name)

    def _local_copy(self) -> LoRATrainer:
        if self._local is None:
            with tempfile.TemporaryDirectory(prefix="tracerl-dp-copy-") as scratch:
                self.save(scratch, step=0)
                self._local = LoRATrainer(self.model_path, lora=self.lora, adapter_path=scratch, device="cpu", dtype=self.dtype,
                                          logprob_chunk_size=self._chunk_size)  # fmt: skip
        return self._local

    def _refresh_local(self) -> None:
        assert self._local is not None
        with tempfile.TemporaryDirectory(prefix="tracerl-dp-copy-") as scratch:
            self._pool.call("save", {"path": scratch, "step": 0, "with_optimizer": True}, timeout=SAVE_TIMEOUT, ranks=[0])
            _restore(self._local, scratch)

    def _give_back_local(self) -> None:
        assert self._local is not None
        with tempfile.TemporaryDirectory(prefix="tracerl-dp-copy-") as scratch:
            self._local.save(scratch, step=0)
            self._pool.call("restore", {"path": scratch}, timeout=SAVE_TIMEOUT)
        self._local_ahead = False


def _restore(trainer: LoRATrainer, folder: str | os.PathLike[str]) -> None:
    """Set ``trainer``'s adapter weights and optimizer state to those saved in ``folder``."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(trainer.model, load_file(Path(folder) / "adapter_model.safetensors", device=str(trainer.device)))
    trainer.optimizer.load_state_dict(torch.load(Path(folder) / "optimizer.pt", weights_only=True))


def _start_ranks(workers: int, kind: str, timeout: float) -> RankPool:
    """``workers`` processes of this module, joined through a store this process holds (no port to guess)."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // workers))

    def env(rank: int) -> dict[str, str]:
        extra = {"OMP_NUM_THREADS": threads} if kind == "cpu" else {}
        return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(workers), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store.port), "TRACERL_DP_DEVICE": kind, "TRACERL_DP_TIMEOUT": str(timeout), **extra}

    pool = RankPool("tracerl.cluster.data_parallel", workers, env=env)
    pool.store = store  # type: ignore[attr-defined]  # the rendezvous lives as long as the ranks
    return pool


def train_step_data_parallel(
    model_path: str | os.PathLike[str],
    micro_batches: Sequence[MicroBatch],
    config: StepConfig,
    out: str | os.PathLike[str],
    *,
    workers: int = 2,
    adapter_path: str | os.PathLike[str] | None = None,
    lora: LoRASettings = LoRASettings(),
    device: str = "cpu",
    step: int = 1,
    timeout: float | None = STEP_TIMEOUT,
) -> dict[str, float]:
    """One GRPO step on ``micro_batches`` by ``workers`` ranks started for it (:class:`PersistentLoRATrainer`,
    closed after); rank 0 writes the new adapter (and optimizer state) to ``out``.  Returns the step's metrics."""
    trainer = PersistentLoRATrainer(model_path, workers=workers, lora=lora, adapter_path=adapter_path, device=device,
                                    step_timeout=timeout or STEP_TIMEOUT)  # fmt: skip
    try:
        metrics = trainer.step(micro_batches, config)
        trainer.save(out, step=step)
        return metrics
    finally:
        trainer.close()


class _Rank:
    """One rank's state between commands: the trainer it loaded once, and what it reports."""

    def __init__(self, device: str) -> None:
        self.device, self.trainer, self.model_loads, self.steps = device, None, 0, 0

    def stats(self) -> dict[str, Any]:
        checkpointing = False
        if self.trainer is not None:  # transformers 5 names it is_activation_checkpointing; 4.x, is_gradient_checkpointing
            base = self.trainer.model.get_base_model()
            checkpointing = base.is_activation_checkpointing if hasattr(type(base), "is_activation_checkpointing") else base.is_gradient_checkpointing
        return {"pid": os.getpid(), "model_loads": self.model_loads, "steps": self.steps, "checkpointing": checkpointing}

    def handle(self, command: str, payload: dict[str, Any]) -> Any:
        if command == "load":
            lora = LoRASettings(**payload["lora"])
            self.trainer = DataParallelLoRATrainer(
                payload["model_path"], lora=lora, adapter_path=payload["adapter_path"], device=self.device, dtype=payload["dtype"],
                logprob_chunk_size=payload["logprob_chunk_size"], gradient_checkpointing=payload["gradient_checkpointing"])  # fmt: skip
            self.model_loads += 1
            return str(self.trainer.dtype).removeprefix("torch.")
        trainer = self.trainer
        if trainer is None:
            raise ConfigError(f"{command!r} before the model was loaded")
        if command == "step":
            metrics = trainer.step(payload["micro_batches"], StepConfig(**payload["config"]))
            self.steps += 1
            return metrics
        if command == "save":
            trainer.save(payload["path"], step=payload["step"], with_optimizer=payload["with_optimizer"])
            return None
        if command == "restore":
            _restore(trainer, payload["path"])
            return None
        raise ConfigError(f"unknown command {command!r}")


def _serve_rank() -> None:
    """A rank: join the group (the parent's store), then answer the parent's commands until told to stop."""
    kind, timeout = os.environ["TRACERL_DP_DEVICE"], float(os.environ["TRACERL_DP_TIMEOUT"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = kind
    if kind == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = f"cuda:{torch.cuda.current_device()}"
    wait = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False, timeout=wait)
    dist.init_process_group("nccl" if kind == "cuda" else "gloo", store=store, rank=rank, world_size=world, timeout=wait)
    try:
        state = _Rank(device)
        serve_commands(state.handle, state.stats)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _serve_rank()
