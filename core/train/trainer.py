"""The LoRA trainer: base model + peft adapter + AdamW, one GRPO step at a time.

The training loop is an explicit function of micro-batches (see :meth:`LoRATrainer.step`),
not a framework trainer to subclass.  By default fp32 on CPU (bf16 pays only where the CPU has bf16
instructions: ``dtype="bfloat16"``), bf16 on CUDA (:func:`tracerl.inference.devices.dtype_for`), after
a check that the GPU has room for the model; in bf16 the LoRA, Adam's state and the logprob math stay fp32.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import torch

from ..errors import ConfigError, NonFiniteError, TrajectoryError
from ..inference.devices import TRAIN_OVERHEAD, check_room_for, default_device, dtype_for
from ..validation import check_lora_settings, lora_values
from .allocator import hold_freed_memory, release_freed_memory
from .forward import PolicyForward, load_causal_lm
from .grpo import policy_loss, probability_correlation
from .mismatch import SUM_KEYS, add_sums, check_mismatch, mismatch_metrics, mismatch_sums
from .packing import MicroBatch
from .step_config import StepConfig

STEP_TOTALS = (
    "loss", "ratio_sum", "ratio_max", "clipped", "tokens", "kl", "entropy",
    "stale_tokens", "off_policy_ratio_sum", "off_policy_ratio_max", "off_policy_truncated", "mismatch_masked",
    *SUM_KEYS,
)  # fmt: skip
"""What one step adds up over its micro-batches (and data-parallel ranks; ``*_max`` ones: the largest)."""

T = TypeVar("T")
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRASettings:
    r: int = 8
    alpha: float = 16
    dropout: float = 0.0
    """0 by default: dropout would make trainer logprobs differ from the sampler's."""
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES

    def __post_init__(self) -> None:
        check_lora_settings(self.r, self.alpha, self.dropout, self.target_modules)
        object.__setattr__(self, "target_modules", tuple(self.target_modules))

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> "LoRASettings":
        """From a ``lora_config`` dict (unknown keys: ``TypeError``; bad values: ``ConfigError``)."""
        return cls(**lora_values(values))


def trained_tokens(micro_batches: Sequence[MicroBatch]) -> float:
    """How many tokens the step trains on (the loss's normaliser)."""
    return sum(float((mb.weights_N > 0).sum()) for mb in micro_batches)


def enable_checkpointing(base_model: Any, gradient_checkpointing: bool | int) -> None:
    """Recompute activations in backward: every layer (``True``), every n-th layer (``n``), or none.

    Non-reentrant, so LoRA's inputs need no ``requires_grad`` and the recompute sees the same mask."""
    every_n_layers = int(gradient_checkpointing)
    if every_n_layers < 0:
        raise ConfigError(f"gradient_checkpointing is a bool or a layer stride >= 1, got {gradient_checkpointing}")
    if not every_n_layers:
        return
    if hasattr(base_model, "activation_checkpointing_enable"):  # transformers >= 5.x; the old name warns there
        base_model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=every_n_layers)
    else:
        base_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class LoRATrainer:
    """Holds the base model with a trainable LoRA and its optimizer."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        lora: LoRASettings = LoRASettings(),
        adapter_path: str | os.PathLike[str] | None = None,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        logprob_chunk_size: int = 256,
        gradient_checkpointing: bool | int = False,
    ) -> None:
        """``device``: default CUDA when visible, else CPU; ``dtype``: default bf16 on CUDA, fp32 elsewhere.

        ``logprob_chunk_size``: rows of ``[rows, vocabulary]`` logits alive at once (the
        projection to the vocabulary runs chunk by chunk, each recomputed in backward); 256 rows
        of SmolLM2's 49,152 words are 50 MB a tensor, and the result does not depend on it.

        ``gradient_checkpointing=True`` keeps only each decoder layer's input for backward and
        recomputes the rest; an int ``n`` checkpoints every n-th layer only (the others keep their
        activations), trading memory for less recompute: the larger ``n``, the higher the peak
        and the shorter the step (measured per stride in ``docs/benchmarks.md``).  Without
        transformers' ``activation_checkpointing_enable`` (< 5.x) an ``n > 1`` checkpoints every
        layer.

        On CUDA the GPU's free memory is checked first (:class:`~tracerl.errors.InsufficientMemoryError`
        explains a GPU that something else already fills)."""
        from peft import LoraConfig, PeftModel, get_peft_model

        self.device = device or default_device()
        self.dtype = dtype = dtype_for(self.device, dtype)
        if self.device == "cpu":
            hold_freed_memory()  # on jemalloc: no re-faulting inside a step (tracerl.train.allocator)
        check_room_for(model_path, self.device, overhead=TRAIN_OVERHEAD, what="the trainer", dtype=dtype)
        base, attention = load_causal_lm(model_path, dtype, self.device)  # straight onto the device, in its dtype
        base.config.use_cache = False
        with warnings.catch_warnings():
            # peft asks transformers 5.x for the deprecated `is_gradient_checkpointing` (peft's call, not ours)
            warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
            if adapter_path is not None:
                self.model = PeftModel.from_pretrained(base, adapter_path, is_trainable=True)
            else:
                config = LoraConfig(
                    r=lora.r,
                    lora_alpha=lora.alpha,
                    lora_dropout=lora.dropout,
                    target_modules=list(lora.target_modules),
                    task_type="CAUSAL_LM",
                )
                self.model = get_peft_model(base, config)
        enable_checkpointing(self.model.get_base_model(), gradient_checkpointing)
        self.gradient_checkpointing = gradient_checkpointing
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=5e-6, betas=(0.9, 0.99), weight_decay=0.0)
        if adapter_path is not None and (Path(adapter_path) / "optimizer.pt").exists():
            self.optimizer.load_state_dict(torch.load(Path(adapter_path) / "optimizer.pt", weights_only=True))
        self.chunk_size = logprob_chunk_size
        self.lora = lora
        self.policy_forward = PolicyForward(self.model.get_base_model(), implementation=attention, device=self.device, dtype=dtype,
                                     chunk_size=logprob_chunk_size)  # fmt: skip
        self.probe_error = self.policy_forward.check_against_model(self.model.get_input_embeddings().num_embeddings)

    # -- forward ------------------------------------------------------------------
    def forward_token_logprobs(self, batch: MicroBatch, *, adapter: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprob and entropy for each trained token of ``batch`` (shape ``[N]``), with gradients,
        through the model's own semantics and each turn's sampling (:mod:`tracerl.train.forward`)."""
        if adapter:
            return self.policy_forward.token_logprobs(batch)
        with self.model.disable_adapter():
            return self.policy_forward.token_logprobs(batch)

    @torch.no_grad()
    def token_logprobs(self, batch: MicroBatch) -> torch.Tensor:
        """Current-policy logprob of each trained token (for tests and diagnostics)."""
        return self.forward_token_logprobs(batch)[0].cpu()

    # -- one optimizer step -------------------------------------------------------
    def step(self, micro_batches: Sequence[MicroBatch], config: StepConfig) -> dict[str, float]:
        """Accumulate the GRPO loss over all micro-batches, clip, and take one AdamW step.

        Nothing non-finite is ever applied (see :meth:`apply_update`).
        """
        def accumulate() -> tuple[dict[str, float], list[torch.Tensor], list[torch.Tensor]]:
            result = self._accumulate(micro_batches, config)
            check_mismatch(mismatch_metrics(result[0]), config.max_mismatch_kl)  # raises before any update
            return result

        (totals, sampler, trainer), grad_norm = self.apply_update(
            accumulate,
            learning_rate=config.learning_rate,
            max_grad_norm=config.max_grad_norm,
            loss_of=lambda result: result[0]["loss"],
        )
        n = max(totals["tokens"], 1.0)
        metrics = {
            "loss": totals["loss"],
            "entropy": totals["entropy"] / n,
            "ratio_mean": totals["ratio_sum"] / n,
            "ratio_max": totals["ratio_max"],
            "clipped_fraction": totals["clipped"] / n,
            "grad_norm": grad_norm,
            "trained_tokens": totals["tokens"],
            "forward_tokens": float(sum(mb.num_tokens for mb in micro_batches)),
            "num_micro_batches": float(len(micro_batches)),
        }
        if config.kl_penalty_coef:
            metrics["kl"] = totals["kl"] / n
        if totals["stale_tokens"]:
            stale = totals["stale_tokens"]
            metrics["off_policy_ratio_mean"] = totals["off_policy_ratio_sum"] / stale
            metrics["off_policy_ratio_max"] = totals["off_policy_ratio_max"]
            metrics["off_policy_truncated_fraction"] = totals["off_policy_truncated"] / stale
        metrics["stale_token_fraction"] = totals["stale_tokens"] / n
        metrics.update(mismatch_metrics(totals))
        if config.mismatch_correction == "mis":
            metrics["mismatch_masked_fraction"] = totals["mismatch_masked"] / n
        if sampler:
            corr = probability_correlation(torch.cat(sampler), torch.cat(trainer))
            if not math.isnan(corr):
                metrics["sampler_trainer_prob_corr"] = corr
        return metrics

    def apply_update(
        self,
        accumulate: Callable[[], T],
        *,
        learning_rate: float,
        max_grad_norm: float,
        loss_of: Callable[[T], float] = lambda result: float("nan"),
    ) -> tuple[T, float]:
        """Run ``accumulate`` (forwards and backwards: the gradients add up), clip, take one AdamW step.

        The one place an update is applied, for GRPO (:meth:`step`) and SFT alike.  Nothing
        non-finite is ever applied: an adapter that is already non-finite, a NaN/inf loss
        (``accumulate`` raises :class:`NonFiniteError` per micro-batch, before its backward) or
        gradient norm raises with the gradients cleared and the adapter and optimizer state
        untouched.  An update that makes the adapter non-finite (a learning rate so large that
        the weights overflow) raises with ``adapter_changed=True``: the caller must reload the
        adapter from its last checkpoint (``LocalBackend`` does).  Returns ``accumulate``'s
        result and the gradient norm before clipping.
        """
        largest = torch.finfo(self.params[0].dtype).max if self.params else math.inf
        if learning_rate >= largest:  # AdamW would fail half-way through its update
            raise ConfigError(f"learning_rate={learning_rate} overflows the adapter's {self.params[0].dtype} weights")
        self._check_adapter_finite("before the step (was it loaded from a corrupt checkpoint?)")
        self.optimizer.zero_grad(set_to_none=True)
        try:
            result = accumulate()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_grad_norm)
            if not torch.isfinite(grad_norm):
                raise NonFiniteError(
                    f"the gradient norm is {float(grad_norm)} (the loss was finite: {loss_of(result)}); "
                    "the optimizer step was not taken"
                )
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)
            raise
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        release_freed_memory()  # the step's freed memory goes back for the rollouts (see tracerl.train.allocator)
        self._check_adapter_finite(f"after the update (learning_rate={learning_rate} too large?)", changed=True)
        return result, float(grad_norm)

    def _accumulate(
        self, micro_batches: Sequence[MicroBatch], config: StepConfig, *, normalizer: float | None = None
    ) -> tuple[dict[str, float], list[torch.Tensor], list[torch.Tensor]]:
        """Forward and backward of every micro-batch (gradients add up); raises on a non-finite loss.

        ``normalizer``: the trained tokens of the whole step (default: of ``micro_batches``); a
        data-parallel rank passes the step's, so the ranks' gradients sum to one process's."""
        if normalizer is None:
            normalizer = trained_tokens(micro_batches)
        totals = dict.fromkeys(STEP_TOTALS, 0.0)
        sampler, trainer = [], []
        for index, mb in enumerate(micro_batches):
            self._check_vocabulary(mb)
            logprobs, entropy = self.forward_token_logprobs(mb)
            ref = None
            if config.kl_penalty_coef:
                with torch.no_grad():
                    ref = self.forward_token_logprobs(mb, adapter=False)[0]
            weights = mb.weights_N.to(self.device)
            out = policy_loss(
                logprobs,
                mb.old_logprobs_N.to(self.device),
                mb.advantages_N.to(self.device),
                weights,
                normalizer=normalizer,
                ref_logprobs_BT=ref,
                sequence_ids_BT=mb.sequence_ids_N.to(self.device),
                policy_lag_BT=mb.policy_lag_N.to(self.device) if mb.policy_lag_N is not None else None,
                **config.loss_kwargs(),
            )
            if not torch.isfinite(out.loss):
                bad = mb.sequence_ids_N[out.non_finite_BT.cpu()].unique().tolist() if out.non_finite_BT is not None else []
                raise NonFiniteError(
                    f"the loss of micro-batch {index + 1}/{len(micro_batches)} is {float(out.loss.detach())}; "
                    "the optimizer step was not taken",
                    sequences=tuple(int(i) for i in bad),
                )
            out.loss.backward()
            mask = weights > 0
            totals["loss"] += float(out.loss.detach())
            totals["ratio_sum"] += out.ratio_sum
            totals["ratio_max"] = max(totals["ratio_max"], out.ratio_max)
            totals["off_policy_ratio_max"] = max(totals["off_policy_ratio_max"], out.off_policy_ratio_max)
            for key in ("stale_tokens", "off_policy_ratio_sum", "off_policy_truncated", "mismatch_masked"):
                totals[key] += getattr(out, key)
            fresh = mask if mb.policy_lag_N is None else mask & (mb.policy_lag_N.to(self.device) == 0)
            add_sums(totals, mismatch_sums(logprobs, mb.old_logprobs_N, fresh, config.mismatch_cap))
            totals["clipped"] += out.clipped
            totals["tokens"] += out.tokens
            totals["kl"] += out.kl_sum
            totals["entropy"] += float(entropy[mask].sum())
            sampler.append(mb.old_logprobs_N[mask.cpu()])
            trainer.append(logprobs.detach().cpu()[mask.cpu()])
        return totals, sampler, trainer

    def _check_vocabulary(self, batch: MicroBatch) -> None:
        """Ids outside the embedding never reach it (on a GPU that is a device-side assert that
        poisons the whole process); ``LocalBackend`` already named the trajectory, this is the last line."""
        rows = self.model.get_input_embeddings().num_embeddings
        ids = batch.input_ids_BT
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
            bad = ids[(ids < 0) | (ids >= rows)]
            raise TrajectoryError(f"token id {int(bad[0])} is outside the model's embedding [0, {rows}); nothing was trained")

    def _check_adapter_finite(self, when: str, *, changed: bool = False) -> None:
        if not self.params:
            return
        with torch.no_grad():  # one device sync for all tensors; names only when something is wrong
            if bool(torch.stack([torch.isfinite(p).all() for p in self.params]).all()):
                return
            bad = [name for name, p in self.model.named_parameters() if p.requires_grad and not bool(torch.isfinite(p).all())]
        if bad:
            raise NonFiniteError(
                f"the adapter holds NaN or infinite weights {when}: {', '.join(bad[:3])}"
                + (f" and {len(bad) - 3} more" if len(bad) > 3 else ""),
                adapter_changed=changed,
            )

    # -- persistence --------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], *, step: int, with_optimizer: bool = True) -> None:
        """Write the adapter (peft format, loadable by vLLM) and the optimizer state."""
        path = Path(path)
        self.model.save_pretrained(path)
        if with_optimizer:
            torch.save(self.optimizer.state_dict(), path / "optimizer.pt")
        (path / "trainer_state.json").write_text(json.dumps({"step": step, "lora": asdict(self.lora)}, indent=2))
