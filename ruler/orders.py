"""The orders in which a group is shown to the judge.

Judges favour some positions (often the first or the last).  Order 1 is a seeded
random permutation.  When ``num_orders`` is a multiple of the group size, the orders
are all its cyclic rotations (a Latin square: every trajectory sits in every position
equally often, so *any* position bias cancels in the average).  Otherwise the orders
are rotations spread evenly, each followed by its reverse, so that a linear position
bias (primacy or recency) cancels exactly whenever ``num_orders`` is even.
"""

from __future__ import annotations

import math
import random


def judge_orders(n: int, num_orders: int, seed: int) -> list[list[int]]:
    """``num_orders`` permutations of ``range(n)`` (they repeat when ``n`` is small)."""
    if num_orders < 1:
        raise ValueError(f"num_orders must be >= 1, got {num_orders}")
    base = list(range(n))
    random.Random(seed).shuffle(base)
    if n <= 1:
        return [base for _ in range(num_orders)]

    def rotated(shift: int) -> list[int]:
        return base[shift:] + base[:shift]

    if num_orders % n == 0:
        return [rotated(j % n) for j in range(num_orders)]
    pairs = math.ceil(num_orders / 2)
    orders: list[list[int]] = []
    for j in range(pairs):
        order = rotated(round(j * n / pairs) % n)
        orders.extend([order, order[::-1]])
    return orders[:num_orders]
