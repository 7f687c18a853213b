"""Training sequences → padded micro-batches of tensors, sized by a token budget.

Rows are sorted by length so padding stays small; each micro-batch holds at most
``max_tokens`` padded tokens (a single longer row still gets its own micro-batch).
Targets are the next tokens; every per-token array is aligned with the targets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .tokenization import TrainingSequence


@dataclass
class MicroBatch:
    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    targets_BT: torch.Tensor
    weights_BT: torch.Tensor
    """Per-target weight: 0 for context/padding, the trajectory weight for sampled tokens."""
    advantages_BT: torch.Tensor
    old_logprobs_BT: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask_BT.sum())


def pack_sequences(
    sequences: Sequence[TrainingSequence],
    token_weights: Sequence[float],
    *,
    max_tokens: int = 4096,
    pad_token_id: int = 0,
) -> list[MicroBatch]:
    """Pack sequences (with one weight each) into micro-batches of at most ``max_tokens``."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i].token_ids), reverse=True)
    batches: list[list[int]] = []
    for i in order:
        length = len(sequences[i].token_ids)
        if batches:
            rows = batches[-1]
            longest = len(sequences[rows[0]].token_ids)
            if (len(rows) + 1) * max(longest, length) <= max_tokens:
                rows.append(i)
                continue
        batches.append([i])
    return [_to_tensors([sequences[i] for i in rows], [token_weights[i] for i in rows], pad_token_id) for rows in batches]


def _to_tensors(rows: list[TrainingSequence], row_weights: list[float], pad_token_id: int) -> MicroBatch:
    B = len(rows)
    T = max(len(r.token_ids) for r in rows)
    input_ids = torch.full((B, T), pad_token_id, dtype=torch.long)
    attention = torch.zeros((B, T), dtype=torch.long)
    targets = torch.zeros((B, T), dtype=torch.long)
    weights = torch.zeros((B, T), dtype=torch.float32)
    advantages = torch.zeros((B, T), dtype=torch.float32)
    old = torch.full((B, T), float("nan"), dtype=torch.float32)
    for b, (row, weight) in enumerate(zip(rows, row_weights)):
        n = len(row.token_ids)
        input_ids[b, :n] = torch.tensor(row.token_ids)
        attention[b, :n] = 1
        # position t predicts token t+1: shift every per-token array left by one
        targets[b, : n - 1] = torch.tensor(row.token_ids[1:])
        weights[b, : n - 1] = torch.tensor(row.weights[1:]) * weight
        advantages[b, : n - 1] = row.advantage
        old[b, : n - 1] = torch.tensor(row.old_logprobs[1:], dtype=torch.float32)
    return MicroBatch(input_ids, attention, targets, weights, advantages, old)
