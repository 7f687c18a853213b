"""The Tinker service's trainer packs datums as tracerl's trainer does, and gets the same numbers as one by one."""

from __future__ import annotations

import pytest
import torch

from tracerl.tinker.lora_pool import AdapterSpec, Datum, LoRAPool, pack


def datum(tokens: list[int], targets: list[int], advantages: list[float] | None = None) -> Datum:
    inputs = {"target_tokens": torch.tensor(targets), "weights": torch.ones(len(tokens))}
    if advantages is not None:
        inputs |= {"advantages": torch.tensor(advantages), "logprobs": torch.zeros(len(tokens))}
    return Datum(tokens=tokens, inputs=inputs)


PROMPT = list(range(1000, 1040))


@pytest.fixture(scope="module")
def pool(smol_path):
    pool = LoRAPool(smol_path, batch_tokens=48)  # rows split: the prompt repeats in each
    pool.create("plain", AdapterSpec(rank=4, seed=0, train_unembed=False))
    pool.create("unembed", AdapterSpec(rank=4, seed=1, train_unembed=True))
    for adapter in pool.adapters.values():  # LoRA B starts at 0: move it so the adapters matter
        with torch.no_grad():
            for param in adapter.params:
                param.add_(0.01 * torch.randn_like(param))
    return pool


def test_an_rl_groups_samples_compute_their_prompt_once():
    group = [datum(PROMPT + [7 + i] * (3 + i), [0] * (43 + i)) for i in range(4)]
    other = [datum(list(range(2000, 2030)), [0] * 30)]
    batches = pack(group + other, 4096)
    computed = sum(b.num_tokens for b in batches)
    assert computed == 40 + sum(3 + i + 1 for i in range(4)) + 31  # the prompt once, each suffix (+1 placeholder), the other alone
    assert sum(b.num_trained for b in batches) == sum(len(d.tokens) for d in group + other)


@pytest.mark.parametrize("adapter", ["plain", "unembed"])
def test_packed_logprobs_loss_and_gradient_equal_each_datum_alone(pool, adapter):
    """Datums sharing a prompt (some with targets that are not their inputs shifted), split over
    several micro-batches: the same logprobs, summed loss and gradient as one datum per call."""
    datums = [datum(PROMPT + [5 + i] * (2 + i), [11 + i] * (42 + i), advantages=[0.5 - i * 0.3] * (42 + i)) for i in range(5)]
    datums.append(datum([9, 8, 7, 6], [1, 2, 3, 4], advantages=[1.0] * 4))
    grads = []
    together, total = pool.forward(adapter, datums, "importance_sampling", backward=True)
    grads.append([p.grad.clone() for p in pool.adapters[adapter].params])
    pool.adapters[adapter].optimizer.zero_grad(set_to_none=True)
    alone, totals = [], 0.0
    for d in datums:
        logprobs, loss = pool.forward(adapter, [d], "importance_sampling", backward=True)
        alone += logprobs
        totals += loss
    grads.append([p.grad.clone() for p in pool.adapters[adapter].params])
    pool.adapters[adapter].optimizer.zero_grad(set_to_none=True)
    assert [len(x) for x in together] == [len(d.tokens) for d in datums]
    assert max(abs(a - b) for x, y in zip(together, alone) for a, b in zip(x, y)) < 1e-4
    assert total == pytest.approx(totals, rel=1e-4)
    assert max(float((a - b).abs().max()) for a, b in zip(*grads)) < 1e-4 * max(float(g.abs().max()) for g in grads[1])
