"""Supervised fine-tuning on the same LoRA, run directory and step counter as GRPO.

``LocalBackend.train_sft(model, examples, config)`` lands here.  One call is one checkpoint
step: the examples are tokenized through GRPO's path (:mod:`tracerl.train.sft_data`), packed with
GRPO's packer (:func:`tracerl.train.packing.pack_sequences`: several examples share a row, a 4-D
mask and restarting position ids keep each one blind to the others, a common prefix is
computed once), and trained for ``epochs × ceil(n / batch_size)`` optimizer steps through
:meth:`LoRATrainer.apply_update` (so the non-finite guards are GRPO's).  The loss is the
negative log-likelihood of the trained (assistant) tokens only, normalised per token or per
sequence (:class:`~tracerl.train.sft_config.SFTConfig`).  The adapter is then committed as
checkpoint ``step+1`` exactly as ``train`` commits one (atomic rename, ``step.json`` with
the history row, split ``sft``), the ``sft`` row is appended to ``history.jsonl``, and the
new adapter is hot-loaded as ``name@step+1``, so the next RL rollouts sample from it.

If anything fails (a non-finite loss, an interrupt) the step does not advance, no
checkpoint is written, and the in-memory trainer is dropped so the next call reloads the
last checkpoint: nothing of the failed call remains.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import NonFiniteError, TrajectoryError
from ..runs.storage import RunDir, atomic_dir, history_row, logged_splits
from ..types import Trajectory
from .sft_config import SFTConfig
from .sft_data import tokenize_examples
from .tokenization import TokenizeStats, TrainingSequence

if TYPE_CHECKING:  # pragma: no cover
    from .packing import MicroBatch
    from .trainer import LoRATrainer

SFT_SPLIT = "sft"


# -- weights and batches --------------------------------------------------------------------------
def sequence_weights(sequences: Sequence[TrainingSequence], normalization: str) -> list[float]:
    """The per-token weight of each sequence so that ``-Σ w·logp`` is the batch's loss.

    ``token``: ``1 / N`` (N trained tokens in the batch): the mean token NLL.
    ``sequence``: ``1 / (E · n_e)`` (E examples, n_e trained tokens of the sequence's example):
    the mean over examples of each example's mean token NLL.
    """
    per_example: dict[int, int] = {}
    for seq in sequences:
        per_example[seq.trajectory_index] = per_example.get(seq.trajectory_index, 0) + seq.num_trainable
    total = sum(per_example.values())
    if total == 0:
        return [0.0] * len(sequences)
    if normalization == "token":
        return [1.0 / total] * len(sequences)
    examples = sum(1 for n in per_example.values() if n > 0)
    return [1.0 / (examples * per_example[s.trajectory_index]) if per_example[s.trajectory_index] else 0.0 for s in sequences]


def pack_batch(
    sequences: Sequence[TrainingSequence], normalization: str, *, max_tokens: int, pad_token_id: int
) -> list["MicroBatch"]:
    """GRPO's packer over one SFT batch: all its sequences in one packing group (one shared prefix)."""
    from .packing import pack_sequences

    for seq in sequences:
        seq.group_index = 0
    return pack_sequences(sequences, sequence_weights(sequences, normalization), max_tokens=max_tokens, pad_token_id=pad_token_id)


def split_examples(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Indices of the training and held-out examples (at least one of each when ``val_fraction > 0``)."""
    if val_fraction <= 0 or n < 2:
        return list(range(n)), []
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    return sorted(order[n_val:]), sorted(order[:n_val])


def batches(indices: list[int], batch_size: int, epochs: int, shuffle: bool, seed: int) -> list[tuple[int, list[int]]]:
    """``(epoch, example indices)`` of every optimizer step; epoch ``e`` is shuffled with ``seed + e`` (ART)."""
    out = []
    for epoch in range(epochs):
        order = list(indices)
        if shuffle:
            random.Random(seed + epoch).shuffle(order)
        out += [(epoch, order[i : i + batch_size]) for i in range(0, len(order), batch_size)]
    return out


# -- the loop -------------------------------------------------------------------------------------
@dataclass
class SFTRun:
    """What one ``train_sft`` call trains on, tokenized."""

    train: list[list[TrainingSequence]]
    val: list[list[TrainingSequence]]
    stats: TokenizeStats = field(default_factory=TokenizeStats)
    skipped: int = 0
    """Training examples left without a trained token (truncated away)."""


def _nll(trainer: "LoRATrainer", micro_batches: Sequence["MicroBatch"], *, backward: bool, where: str) -> float:
    """``-Σ w·logp`` over the micro-batches (with its backward pass when training)."""
    import torch

    total = 0.0
    for index, mb in enumerate(micro_batches):
        if mb.num_trained == 0:
            continue
        trainer._check_vocabulary(mb)
        logprobs, _ = trainer.forward_token_logprobs(mb)
        loss = -(mb.weights_N.to(logprobs.device) * logprobs).sum()
        if not bool(torch.isfinite(loss)):
            raise NonFiniteError(
                f"the SFT loss of micro-batch {index + 1}/{len(micro_batches)} {where} is {float(loss.detach())}; "
                "the optimizer step was not taken",
                sequences=tuple(int(i) for i in mb.sequence_ids_N.unique().tolist()),
            )
        if backward:
            loss.backward()
        total += float(loss.detach())
    return total


def validation_loss(trainer: "LoRATrainer", val: list[list[TrainingSequence]], config: SFTConfig, *, max_tokens: int, pad: int) -> float:
    """The held-out loss, normalised as training is, over all held-out examples at once."""
    import torch

    sequences = [s for example in val for s in example]
    with torch.no_grad():
        return _nll(trainer, pack_batch(sequences, config.normalization, max_tokens=max_tokens, pad_token_id=pad), backward=False, where="(validation)")


def run_sft(
    trainer: "LoRATrainer", run: SFTRun, config: SFTConfig, *, max_tokens: int, pad_token_id: int
) -> dict[str, float]:
    """Every optimizer step of one ``train_sft`` call; returns its metrics (``sft/...`` in the history)."""
    started = time.monotonic()
    steps = batches(list(range(len(run.train))), config.resolved_batch_size, config.epochs, config.shuffle, config.seed)
    rates = config.schedule(len(steps))
    metrics: dict[str, float] = {}
    if run.val:
        metrics["val_loss_before"] = validation_loss(trainer, run.val, config, max_tokens=max_tokens, pad=pad_token_id)
    losses, norms, epoch_losses = [], [], {}
    trained_tokens = forward_tokens = 0.0
    bar = _progress(len(steps), config.show_progress)
    try:
        for index, ((epoch, members), rate) in enumerate(zip(steps, rates)):
            sequences = [s for i in members for s in run.train[i]]
            micro_batches = pack_batch(sequences, config.normalization, max_tokens=max_tokens, pad_token_id=pad_token_id)
            where = f"(optimizer step {index + 1}, epoch {epoch + 1})"
            loss, grad_norm = trainer.apply_update(
                lambda: _nll(trainer, micro_batches, backward=True, where=where),
                learning_rate=rate,
                max_grad_norm=config.max_grad_norm,
                loss_of=lambda value: value,
            )
            losses.append(loss)
            norms.append(grad_norm)
            epoch_losses.setdefault(epoch, []).append(loss)
            trained_tokens += sum(mb.num_trained for mb in micro_batches)
            forward_tokens += sum(mb.num_tokens for mb in micro_batches)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", lr=f"{rate:.2e}", epoch=epoch + 1)
            if run.val and (index + 1 == len(steps) or steps[index + 1][0] != epoch):
                metrics[f"val_loss_epoch_{epoch + 1}"] = validation_loss(trainer, run.val, config, max_tokens=max_tokens, pad=pad_token_id)
                if bar is not None:
                    bar.set_postfix(loss=f"{loss:.4f}", val_loss=f"{metrics[f'val_loss_epoch_{epoch + 1}']:.4f}", epoch=epoch + 1)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.monotonic() - started
    metrics.update(
        {
            "loss": sum(epoch_losses[max(epoch_losses)]) / len(epoch_losses[max(epoch_losses)]),
            "loss_first_step": losses[0],
            "loss_last_step": losses[-1],
            "grad_norm": sum(norms) / len(norms),
            "learning_rate_peak": max(rates),
            "learning_rate_last": rates[-1],
            "optimizer_steps": float(len(steps)),
            "epochs": float(config.epochs),
            "num_examples": float(len(run.train)),
            "num_val_examples": float(len(run.val)),
            "examples_without_trained_tokens": float(run.skipped),
            "trained_tokens": trained_tokens,
            "forward_tokens": forward_tokens,
            "trained_tokens_per_second": trained_tokens / seconds if seconds > 0 else 0.0,
            **run.stats.metrics(),
        }
    )
    if run.val:
        metrics["val_loss"] = metrics[f"val_loss_epoch_{config.epochs}"]
    return metrics


def _progress(total: int, show: bool) -> Any:
    if not show:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="SFT", unit="step")


# -- LocalBackend glue ----------------------------------------------------------------------------
def prepare(
    tokenizer: Any, examples: list[Trajectory], val_examples: list[Trajectory] | None, config: SFTConfig, max_seq_len: int | None
) -> SFTRun:
    """Split off the held-out examples (unless given) and tokenize both sets."""
    if val_examples is None:
        train_idx, val_idx = split_examples(len(examples), config.val_fraction, config.seed)
        train_examples, val_examples = [examples[i] for i in train_idx], [examples[i] for i in val_idx]
    else:
        train_examples = examples
    stats = TokenizeStats()
    kwargs = dict(assistant_turns=config.assistant_turns, max_seq_len=max_seq_len)
    train = tokenize_examples(train_examples, tokenizer, stats=stats, **kwargs)
    val = tokenize_examples(val_examples, tokenizer, stats=TokenizeStats(), first_index=len(train_examples), **kwargs)
    kept = [seqs for seqs in train if seqs]
    if not kept:
        raise TrajectoryError("no training example has a token to train (every assistant turn truncated away by max_seq_len?)")
    return SFTRun(train=kept, val=[seqs for seqs in val if seqs], stats=stats, skipped=len(train) - len(kept))


def commit(run_dir: RunDir, step: int, trainer: "LoRATrainer", metrics: dict[str, float]) -> None:
    """Checkpoint ``step`` with its ``sft`` row in ``step.json`` (one atomic rename, like ``train``), then the row.

    A kill after the rename and before the row leaves a committed step whose row ``register``
    recovers from ``step.json``; the row is written once per ``(step, "sft")``.
    """
    with atomic_dir(run_dir.checkpoint_path(step)) as tmp:
        trainer.save(tmp, step=step)
        run_dir.write_step_record(tmp, step, metrics, split=SFT_SPLIT)
    if not any(row.get("step") == step and SFT_SPLIT in logged_splits(row) for row in run_dir.read_history()):
        run_dir.append_history(history_row(step, SFT_SPLIT, metrics))
