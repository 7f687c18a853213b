"""Data-parallel GRPO steps over torch.distributed ranks (gloo on CPU, nccl on CUDA).

:class:`DataParallelLoRATrainer` is :class:`~tracerl.train.trainer.LoRATrainer` with the step's packed
micro-batches shared out between the ranks.  Every rank holds the same base model and adapter
(rank 0's, broadcast at start: a new LoRA's ``A`` is random), computes the loss of its share with
the *step's* normaliser (the trained tokens of all micro-batches), and the LoRA gradients are
summed with one all-reduce.  Clipping and AdamW then see the same gradient on every rank, so each
takes the same step, and that step is one process's to float tolerance: the same sum, reordered.
A failure on one rank (a non-finite loss, a bad token id, anything) is raised on every rank before
any gradient is exchanged, so no rank waits forever and none applies an update.

The ranks are started by an existing launcher, never by us: ``torchrun`` (this module is its
worker, ``python -m torch.distributed.run ... -m tracerl.cluster.data_parallel``; multi-node with
``--nnodes``/``--rdzv-endpoint``), or anything else that sets up the process group (Ray Train's
``TorchTrainer``).  :func:`train_step_data_parallel` runs one step that way from Python.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..errors import ConfigError, NonFiniteError, TracerlError, TrajectoryError
from ..train.packing import MicroBatch
from ..train.trainer import LoRASettings, LoRATrainer, StepConfig, trained_tokens


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
        mine = None if failure is None else (type(failure).__name__, str(failure), getattr(failure, "sequences", ()))
        dist.all_gather_object(reports, mine)
        if failure is not None:
            raise failure
        rank, (kind, message, sequences) = next((r, report) for r, report in enumerate(reports) if report is not None)
        message = f"data-parallel rank {rank}: {message}"
        if kind == NonFiniteError.__name__:
            raise NonFiniteError(message, sequences=tuple(sequences))
        if kind == TrajectoryError.__name__:
            raise TrajectoryError(message)
        raise TracerlError(f"{kind}: {message}")

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
    timeout: float | None = 1800,
) -> dict[str, float]:
    """One GRPO step on ``micro_batches`` by ``workers`` torchrun processes on this machine; rank 0
    writes the new adapter (and optimizer state) to ``out``.  Returns the step's metrics.

    ``device="cpu"``: gloo; ``"cuda"``: nccl, one GPU per worker.  For several machines run
    ``torchrun --nnodes N --rdzv-endpoint HOST:PORT ... -m tracerl.cluster.data_parallel`` on each."""
    if workers < 1:
        raise ConfigError(f"workers must be >= 1, got {workers}")
    with tempfile.TemporaryDirectory(prefix="tracerl-dp-") as scratch:
        batches = Path(scratch, "micro_batches.pt")
        torch.save(list(micro_batches), batches)
        job = {"model_path": str(model_path), "adapter_path": str(adapter_path) if adapter_path else None,
               "lora": asdict(lora), "config": config.to_dict(),
               "device": device, "step": step, "batches": str(batches), "out": str(out),
               "metrics": str(Path(scratch, "metrics.json"))}
        Path(scratch, "job.json").write_text(json.dumps(job))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
                   "-m", "tracerl.cluster.data_parallel", str(Path(scratch, "job.json"))]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        failure = Path(scratch, "error.json")
        if failure.exists():  # the step's own error, as the ranks raised it: the same type here
            kind, message, sequences = json.loads(failure.read_text())
            if kind == NonFiniteError.__name__:
                raise NonFiniteError(message, sequences=tuple(sequences))
            if kind == TrajectoryError.__name__:
                raise TrajectoryError(message)
            raise TracerlError(f"{kind}: {message}")
        if done.returncode != 0:
            raise TracerlError(f"the data-parallel step failed (torchrun exit {done.returncode}):\n{done.stderr[-4000:]}")
        return json.loads(Path(job["metrics"]).read_text())


class TorchrunLoRATrainer(LoRATrainer):
    """A :class:`LoRATrainer` whose steps are taken by ``workers`` torchrun processes on this machine
    (``LocalBackend(train_workers=N)``): before a step its adapter and optimizer state are written to
    a scratch folder the ranks start from, after it the result is loaded back, so checkpoints,
    resume and hot-loading stay the backend's.  Each step starts the ranks afresh (model load
    included): the price of keeping one process's trainer and many processes' step interchangeable."""

    def __init__(self, model_path: str | os.PathLike[str], *, workers: int, **options: Any) -> None:
        if workers < 1:
            raise ConfigError(f"train_workers must be >= 1, got {workers}")
        super().__init__(model_path, **options)
        self.model_path, self.workers = str(model_path), workers

    def step(self, micro_batches: Sequence[MicroBatch], config: StepConfig) -> dict[str, float]:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        with tempfile.TemporaryDirectory(prefix="tracerl-dp-step-") as scratch:
            before, after = Path(scratch, "before"), Path(scratch, "after")
            self.save(before, step=0)
            metrics = train_step_data_parallel(self.model_path, micro_batches, config, after, workers=self.workers,
                                               adapter_path=before, lora=self.lora, device=str(self.device).split(":")[0])
            set_peft_model_state_dict(self.model, load_file(after / "adapter_model.safetensors", device=str(self.device)))
            self.optimizer.load_state_dict(torch.load(after / "optimizer.pt", weights_only=True))
        return metrics


def _worker(job_file: str) -> None:
    """One torchrun rank: join the group, load, step, and (rank 0) save."""
    job = json.loads(Path(job_file).read_text())
    device = job["device"]
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = f"cuda:{torch.cuda.current_device()}"
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    try:
        lora = LoRASettings(**{**job["lora"], "target_modules": tuple(job["lora"]["target_modules"])})
        trainer = DataParallelLoRATrainer(job["model_path"], lora=lora, adapter_path=job["adapter_path"], device=device)
        micro_batches = torch.load(job["batches"], weights_only=False)  # our own file, written by the launcher
        try:
            metrics = trainer.step(micro_batches, StepConfig(**job["config"]))
        except Exception as error:  # every rank raises (DataParallelLoRATrainer); rank 0 tells the launcher what
            if dist.get_rank() == 0:
                report = [type(error).__name__, str(error), list(getattr(error, "sequences", ()))]
                Path(job["metrics"]).with_name("error.json").write_text(json.dumps(report))
            raise
        if dist.get_rank() == 0:
            trainer.save(job["out"], step=job["step"])
            Path(job["metrics"]).write_text(json.dumps({**metrics, "data_parallel_workers": float(dist.get_world_size())}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one data-parallel GRPO step (a torchrun worker)")
    parser.add_argument("job", help="the job file train_step_data_parallel writes")
    _worker(parser.parse_args().job)
