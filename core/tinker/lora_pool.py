"""Many LoRA adapters on one copy of a base model, each with its own Adam state.

What a Tinker service needs from a trainer: every training client is one adapter of peft's
multi-adapter model over the shared base, so N tenants' models cost one base plus N small
adapters.  Operations are the Tinker ones, per adapter: ``forward`` (logprobs only),
``forward_backward`` (gradients *add up* until the next ``optim_step``, as Tinker defines it),
``optim_step`` (Adam with the caller's parameters), ``save``/``load`` (adapter, optionally the
optimizer).  The pool is not thread-safe: the service runs its operations one at a time.

Adapters are saved in peft's standard layout (``adapter_config.json`` +
``adapter_model.safetensors``), so tracerl's inference servers and vLLM load them as they are.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, NonFiniteError, TrajectoryError
from ..inference.devices import (
    TRAIN_OVERHEAD,
    check_room_for,
    default_device,
    dtype_for,
)
from ..train.forward import PolicyForward, Sampling, load_causal_lm
from ..train.packing import MicroBatch, pack_sequences
from ..train.tokenization import TrainingSequence
from ..train.trainer import enable_checkpointing
from .losses import LOSS_INPUTS, tinker_loss

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)


@dataclass(frozen=True)
class AdapterSpec:
    """A Tinker LoRA training client's settings (``create_lora_training_client``'s arguments)."""

    rank: int = 32
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True

    def target_modules(self) -> list[str]:
        modules = [
            *(ATTENTION_MODULES if self.train_attn else ()),
            *(MLP_MODULES if self.train_mlp else ()),
            *(UNEMBED_MODULES if self.train_unembed else ()),
        ]
        if not modules:
            raise ConfigError("train_mlp, train_attn and train_unembed are all False: nothing would be trained")
        return modules


@dataclass(frozen=True)
class Datum:
    """One training example: input tokens and its loss inputs (tensors of the same length)."""

    tokens: list[int]
    inputs: Mapping[str, torch.Tensor]


@dataclass
class _Adapter:
    name: str  # peft's adapter name (a safe identifier), not the client's model id
    spec: AdapterSpec
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Adam


class LoRAPool:
    """One base model (fp32 on CPU, bf16 on CUDA) and the adapters trained on it."""

    def __init__(
        self, model_path: str | Path, *, device: str | None = None, dtype: torch.dtype | None = None, batch_tokens: int = 4096,
        gradient_checkpointing: bool | int = 2,
    ) -> None:
        """``batch_tokens``: padded tokens of one forward pass at most (:func:`pack`).
        ``gradient_checkpointing``: as :class:`~tracerl.train.trainer.LoRATrainer`'s; every 2nd layer by
        default, as the demo trains (without it a 4,096-token pass keeps ~5 GB of activations here)."""
        self.device = device or default_device()
        self.dtype = dtype_for(self.device, dtype)
        check_room_for(model_path, self.device, overhead=TRAIN_OVERHEAD, what="the trainer", dtype=self.dtype)
        # straight onto the device in its dtype: no full copy on the CPU first
        self.base, attention = load_causal_lm(model_path, self.dtype, self.device)
        self.base.config.use_cache = False
        self.policy_forward = PolicyForward(self.base, implementation=attention, device=self.device, dtype=self.dtype)
        self.policy_forward.check_against_model(self.base.get_input_embeddings().num_embeddings)
        enable_checkpointing(self.base, gradient_checkpointing)
        self.vocab_size = self.base.get_input_embeddings().num_embeddings
        self.batch_tokens = batch_tokens
        self.peft_model: Any = None  # the PeftModel, once the first adapter exists
        self.adapters: dict[str, _Adapter] = {}
        self._next = 0

    # -- adapters -----------------------------------------------------------------
    def create(self, model_id: str, spec: AdapterSpec) -> None:
        """A fresh adapter for ``model_id`` (LoRA B = 0, so it starts as the base model)."""
        from peft import LoraConfig

        if model_id in self.adapters:
            raise ConfigError(f"adapter {model_id!r} exists already")
        config = LoraConfig(r=spec.rank, lora_alpha=spec.rank, lora_dropout=0.0, target_modules=spec.target_modules(), task_type="CAUSAL_LM")
        self._add(model_id, spec, config)

    def _add(self, model_id: str, spec: AdapterSpec, config: Any) -> _Adapter:
        from peft import get_peft_model

        name = f"a{self._next}"
        self._next += 1
        with torch.random.fork_rng(devices=[]):  # the seed decides LoRA A, without moving the process's RNG
            if spec.seed is not None:
                torch.manual_seed(spec.seed)
            if self.peft_model is None:
                self.peft_model = get_peft_model(self.base, config, adapter_name=name)
            else:
                self.peft_model.add_adapter(name, config)
        params = [p for n, p in self.peft_model.named_parameters() if f".{name}." in n]
        adapter = _Adapter(name, spec, params, torch.optim.Adam(params, lr=1e-4))
        self.adapters[model_id] = adapter
        return adapter

    def _select(self, model_id: str) -> _Adapter:
        adapter = self.adapters.get(model_id)
        if adapter is None:
            raise ConfigError(f"no adapter {model_id!r} in this pool")
        self.peft_model.set_adapter(adapter.name)  # the only active one; its weights (only) need grad
        return adapter

    # -- forward / backward ------------------------------------------------------
    def forward(
        self, model_id: str, datums: Sequence[Datum], loss_fn: str = "cross_entropy", loss_fn_config: Mapping[str, Any] | None = None,
        *, backward: bool,
    ) -> tuple[list[list[float]], float]:
        """Each datum's logprobs of its ``target_tokens`` and the summed loss; with ``backward``
        the gradients add up in the adapter (until :meth:`optim_step`).

        A non-finite loss raises before its backward, so nothing of it is accumulated."""
        adapter = self._select(model_id)
        for index, datum in enumerate(datums):
            self._check_tokens(datum)
            missing = [key for key in LOSS_INPUTS[loss_fn] if key not in datum.inputs]
            if missing:
                raise TrajectoryError(f"datum {index} has no loss_fn_inputs {missing}: {loss_fn} needs {list(LOSS_INPUTS[loss_fn])}")
        logprobs_out: dict[int, list[float]] = {}
        total = 0.0
        self.peft_model.train(backward)
        with torch.set_grad_enabled(backward):
            for batch in pack(datums, self.batch_tokens):
                losses = []
                for index, logprobs_T in self._target_logprobs(batch, datums):
                    inputs = {k: v.to(self.device, torch.float32) if k != "target_tokens" else v for k, v in datums[index].inputs.items()}
                    loss = tinker_loss(loss_fn, logprobs_T, inputs, loss_fn_config)
                    if not torch.isfinite(loss):
                        raise NonFiniteError(f"the loss of datum {index} is {float(loss.detach())}; nothing of this call was applied")
                    losses.append(loss)
                    logprobs_out[index] = logprobs_T.detach().float().cpu().tolist()
                loss = torch.stack(losses).sum()
                if backward:
                    loss.backward()
                total += float(loss.detach())
        return [logprobs_out[i] for i in range(len(datums))], total

    def _target_logprobs(self, batch: MicroBatch, datums: Sequence[Datum]) -> list[tuple[int, torch.Tensor]]:
        """``(datum index, logprobs of its targets)`` for each datum packed in ``batch``, from one forward pass
        through the trainer's own route (:class:`tracerl.train.forward.PolicyForward`: the model's attention
        per layer type and its output path, a LoRA on the unembedding included)."""
        indices, counts = torch.unique_consecutive(batch.sequence_ids_N, return_counts=True)
        targets = torch.cat([datums[i].inputs["target_tokens"] for i in indices.tolist()]).to(self.device, torch.long)
        logprobs = self.policy_forward.token_logprobs(batch, targets, Sampling())[0]
        return list(zip(indices.tolist(), logprobs.split(counts.tolist())))

    def _check_tokens(self, datum: Datum) -> None:
        n = len(datum.tokens)
        if n == 0:
            raise TrajectoryError("a datum has no input tokens")
        for key, value in datum.inputs.items():
            if value.shape != (n,):
                raise TrajectoryError(f"loss_fn_inputs[{key!r}] has shape {tuple(value.shape)}; the datum has {n} input tokens")
        targets = datum.inputs.get("target_tokens")
        if targets is None:
            raise TrajectoryError("a datum has no loss_fn_inputs['target_tokens']")
        for ids in (datum.tokens, targets.tolist()):
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise TrajectoryError(f"a token id is outside the model's vocabulary [0, {self.vocab_size})")

    # -- optimizer ----------------------------------------------------------------
    def optim_step(
        self, model_id: str, *, learning_rate: float, beta1: float = 0.9, beta2: float = 0.95, eps: float = 1e-12,
        weight_decay: float = 0.0, grad_clip_norm: float = 0.0,
    ) -> dict[str, float]:
        """One Adam step on the accumulated gradients, which are then cleared.  A non-finite
        gradient norm raises with the gradients cleared and the adapter untouched."""
        adapter = self._select(model_id)
        if not (math.isfinite(learning_rate) and learning_rate >= 0):
            raise ConfigError(f"learning_rate must be a finite number >= 0, got {learning_rate}")
        grads = [p for p in adapter.params if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(grads, grad_clip_norm if grad_clip_norm > 0 else math.inf) if grads else torch.tensor(0.0)
        if not torch.isfinite(norm):
            adapter.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(f"the gradient norm is {float(norm)}; the optimizer step was not taken")
        for group in adapter.optimizer.param_groups:
            group.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        adapter.optimizer.step()
        adapter.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm:mean": float(norm)}

    # -- persistence --------------------------------------------------------------
    def save(self, model_id: str, path: str | Path, *, with_optimizer: bool) -> None:
        """The adapter in peft's standard layout, plus ``optimizer.pt`` when asked."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        adapter = self.adapters[model_id]
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.peft_model.peft_config[adapter.name].save_pretrained(str(path))
        state = get_peft_model_state_dict(self.peft_model, adapter_name=adapter.name, save_embedding_layers=False)
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(path / "adapter_model.safetensors"))
        (path / "tinker_adapter.json").write_text(json.dumps(asdict(adapter.spec)))
        if with_optimizer:
            torch.save(adapter.optimizer.state_dict(), path / "optimizer.pt")

    def load(self, model_id: str, path: str | Path, *, with_optimizer: bool) -> None:
        """Replace ``model_id``'s adapter (and, when asked, its Adam state) with the one saved at ``path``."""
        from peft import LoraConfig, set_peft_model_state_dict
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / "adapter_model.safetensors").exists():
            raise ConfigError(f"no saved adapter at {path}")
        if with_optimizer and not (path / "optimizer.pt").exists():
            raise ConfigError(f"the checkpoint at {path} was saved without optimizer state")
        spec = AdapterSpec(**json.loads((path / "tinker_adapter.json").read_text()))
        old = self.adapters.get(model_id)
        adapter = self._add(model_id, spec, LoraConfig.from_pretrained(str(path)))  # before the old one goes: peft keeps >= 1
        if old is not None:
            self.peft_model.delete_adapter(old.name)
        set_peft_model_state_dict(self.peft_model, load_file(str(path / "adapter_model.safetensors")), adapter_name=adapter.name)
        if with_optimizer:
            adapter.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))


MIN_SHARED_PREFIX = 16
"""Datums share one computed prompt only when it is at least this long and half of each datum."""


def pack(datums: Sequence[Datum], max_tokens: int) -> list[MicroBatch]:
    """The datums as the trainer's packed micro-batches (:func:`tracerl.train.packing.pack_sequences`):
    datums that start with the same prompt (an RL group's samples) compute it once.

    Every input position is picked (the packer's "trained" tokens), so each datum gets the
    logprob of all its targets, in order; a Tinker datum's targets need not be its inputs
    shifted, so the packer's own targets are replaced by them (:meth:`LoRAPool._target_logprobs`).
    """
    order = sorted(range(len(datums)), key=lambda i: datums[i].tokens)  # long common prefixes side by side
    cluster_of: dict[int, int] = {}
    first = None
    for i in order:
        tokens = datums[i].tokens
        if first is None or shared_length(datums[first].tokens, tokens) < max(MIN_SHARED_PREFIX, len(tokens) / 2):
            first = i
        cluster_of[i] = first
    sequences = [
        TrainingSequence(
            token_ids=[*d.tokens, 0],  # one placeholder after the last input: the packer predicts tokens 1..n
            weights=[0.0] + [1.0] * len(d.tokens), old_logprobs=[0.0] * (len(d.tokens) + 1), trajectory_index=i, group_index=cluster_of[i],
        )
        for i, d in enumerate(datums)
    ]  # fmt: skip
    return pack_sequences(sequences, [1.0] * len(sequences), max_tokens=max_tokens)


def shared_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
