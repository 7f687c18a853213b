"""Deterministic dataset iteration with exact resume."""

from __future__ import annotations

import math
import random
from typing import Iterator, Sequence, TypeVar

from ..types import DatasetBatch

T = TypeVar("T")


def iterate_dataset(
    items: Sequence[T],
    groups_per_step: int = 1,
    num_epochs: int = 1,
    initial_step: int = 0,
    use_tqdm: bool = True,
    seed: int = 42,
) -> Iterator[DatasetBatch]:
    """Yield batches of ``groups_per_step`` items, shuffled deterministically per epoch.

    Batches before ``initial_step`` are skipped without being yielded, so a run resumed at
    ``initial_step = await model.get_step()`` continues with exactly the batch it would
    have seen next.
    """
    if groups_per_step < 1:
        raise ValueError("groups_per_step must be >= 1")
    items = list(items)
    steps_per_epoch = math.ceil(len(items) / groups_per_step) if items else 0
    total = steps_per_epoch * num_epochs
    bar = None
    if use_tqdm and total:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, initial=min(initial_step, total), desc="dataset", unit="step")
    try:
        for epoch in range(num_epochs):
            order = list(range(len(items)))
            random.Random(seed + epoch).shuffle(order)
            for epoch_step in range(steps_per_epoch):
                step = epoch * steps_per_epoch + epoch_step
                if step < initial_step:
                    continue
                chunk = order[epoch_step * groups_per_step : (epoch_step + 1) * groups_per_step]
                yield DatasetBatch(items=[items[i] for i in chunk], step=step, epoch=epoch, epoch_step=epoch_step)
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
