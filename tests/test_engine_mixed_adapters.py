"""The generation engine decodes rows of different adapters (and of the base model) in one forward
(peft's per-row ``adapter_names``), lets jobs join a running batch, and prefills a job's prompt once
for all its samples; each row samples exactly what it samples alone.

A tiny random Llama (``conftest.tiny_llama``) with random LoRA adapters, in fp32 on the CPU (the
stacked deltas against peft's own in bf16 too): seconds, no real model."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tracerl.errors import ConfigError
from tracerl.inference.engine import GenerationEngine, GenerationJob

TOLERANCE = 1e-4  # fp32: the same row in batches of other shapes and padding


ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _random_lora(model_path: Path, folder: Path, seed: int, **settings) -> Path:
    """A LoRA (default: rank 8 on every projection) with random A and B (peft zeroes B by default), large
    enough that the adapter changes the tiny model's logprobs by far more than :data:`TOLERANCE`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(**{"r": 8, "lora_alpha": 16, "init_lora_weights": False, "target_modules": ALL_PROJECTIONS} | settings)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mixed-adapters")
    folders = {name: _random_lora(tiny_llama, root / name, seed) for seed, name in enumerate(("a", "b", "c"), start=1)}
    # another rank, other layers, rsLoRA's scaling: stacked beside the others with columns of its own
    folders["d"] = _random_lora(tiny_llama, root / "d", 4, r=4, lora_alpha=6, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"])
    folders["dora"] = _random_lora(tiny_llama, root / "dora", 5, use_dora=True)  # not stackable: peft's adapter_names
    return folders


@pytest.fixture()
def engine(tiny_llama, adapters):
    engine = GenerationEngine(tiny_llama, max_batch_rows=64, device="cpu", dtype="float32")
    engine.load_adapter("a", adapters["a"])
    engine.load_adapter("b", adapters["b"])
    engine.start()
    yield engine
    engine.stop()


def _jobs() -> list[GenerationJob]:
    """Base rows and both adapters, greedy and sampled (temperature, top-k, top-p), one and several
    samples a job, prompts of different lengths, a stop token, seeds fixed."""
    specs = [
        dict(adapter="a", prompt_ids=[1, 10, 11, 12, 13, 14, 15], n=3, temperature=1.0, seed=1),
        dict(adapter="b", prompt_ids=[1, 20, 21], n=2, temperature=0.7, top_k=40, seed=2),
        dict(adapter=None, prompt_ids=[1, 30, 31, 32, 33], n=2, temperature=1.0, top_p=0.9, seed=3),
        dict(adapter="a", prompt_ids=[1, 40], temperature=0.0, seed=4),  # greedy: raw logprobs
        dict(adapter="b", prompt_ids=[1, 50, 51, 52, 53, 54, 55, 56, 57, 58], temperature=1.2, top_p=0.95, top_k=100, seed=5),
        dict(adapter=None, prompt_ids=[1, 60, 61], temperature=0.0, seed=6),
        dict(adapter="a", prompt_ids=[1, 70, 71, 72], n=2, temperature=1.0, seed=7, max_tokens=5),  # finishes early
        dict(adapter="b", prompt_ids=[1, 80, 81], temperature=1.0, seed=8, stop_token_ids=list(range(3, 4096, 7))),
    ]
    return [GenerationJob(**{"max_tokens": 48, "ignore_eos": True, "top_logprobs": 2} | spec) for spec in specs]


def _copy(job: GenerationJob) -> GenerationJob:
    fields = ("prompt_ids", "adapter", "n", "temperature", "top_p", "top_k", "max_tokens", "stop", "stop_token_ids",
              "seed", "top_logprobs", "ignore_eos")  # fmt: skip
    return GenerationJob(**{name: getattr(job, name) for name in fields})


def _alone(engine: GenerationEngine, jobs: list[GenerationJob]) -> list[list]:
    return [engine.submit(_copy(job)).result(60) for job in jobs]


def _assert_same(mixed: list, alone: list) -> None:
    for job_index, (got, expected) in enumerate(zip(mixed, alone)):
        for choice, (g, e) in enumerate(zip(got, expected, strict=True)):
            where = f"job {job_index} choice {choice}"
            assert g.token_ids == e.token_ids, where
            assert g.finish_reason == e.finish_reason, where
            assert max(abs(x - y) for x, y in zip(g.logprobs, e.logprobs, strict=True)) <= TOLERANCE, where
            for gt, et in zip(g.top_logprobs, e.top_logprobs, strict=True):
                assert [t for t, _ in gt] == [t for t, _ in et], where
                assert all(abs(x - y) <= TOLERANCE for (_, x), (_, y) in zip(gt, et)), where


def _wait(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.0005)


def test_rows_of_different_adapters_share_forwards_and_sample_what_they_sample_alone(engine):
    jobs = _jobs()
    alone = _alone(engine, jobs)
    greedy_a = alone[3][0].logprobs
    greedy_b = engine.submit(GenerationJob(prompt_ids=[1, 40], adapter="b", temperature=0.0, max_tokens=48, ignore_eos=True)).result(60)
    assert max(abs(x - y) for x, y in zip(greedy_a, greedy_b[0].logprobs)) > 100 * TOLERANCE  # the adapters differ

    first, second = jobs[:5], jobs[5:]
    engine.pause()  # all of the first wave start in one forward
    futures = [engine.submit(job) for job in first]
    forwards = engine.stats["forwards"]
    engine.resume()
    _wait(lambda: engine.stats["forwards"] >= forwards + 3)  # decoding: the rest joins the running batch
    engine.pause()
    futures += [engine.submit(job) for job in second]
    engine.resume()
    mixed = [future.result(60) for future in futures]

    _assert_same(mixed, alone)
    assert engine.stats["max_adapters"] == 3  # base, a and b in one forward
    assert engine.stats["batched_lora"] >= 3  # their deltas stacked (BatchedLoRA), not peft's per-adapter loop
    assert engine.stats["joins"] >= len(second)
    assert engine.stats["max_rows"] == sum(job.n for job in jobs)


def test_a_jobs_prompt_is_prefilled_once_for_all_its_samples(engine):
    before = engine.stats["prompt_tokens"]
    samples = engine.submit(GenerationJob(prompt_ids=[1, 5, 6, 7, 8, 9], adapter="a", n=4, temperature=1.0, seed=0, max_tokens=4)).result(60)
    assert len(samples) == 4 and len({tuple(s.token_ids) for s in samples}) > 1  # four different samples
    assert engine.stats["prompt_tokens"] - before == 6


def test_an_adapter_unloaded_or_replaced_mid_batch_finishes_its_rows_and_is_deleted_after(engine, adapters):
    """What a trainer's hot load does while rows of two adapters and the base decode in one batch:
    pause, replace ``a``, unload ``b``, resume.  Rows finish on the adapter they started on; a new
    job for ``b`` is refused; the replaced and unloaded adapters leave peft after their last row."""
    jobs = [GenerationJob(prompt_ids=[1, 10, 11], adapter=name, n=2, temperature=1.0, seed=i, max_tokens=64, ignore_eos=True)
            for i, name in enumerate(("a", "b", None))]  # fmt: skip
    alone = _alone(engine, jobs)
    old = {name: engine._adapters[name] for name in ("a", "b")}
    engine.pause()
    futures = [engine.submit(job) for job in jobs]
    forwards = engine.stats["forwards"]
    engine.resume()
    _wait(lambda: engine.stats["forwards"] >= forwards + 3)
    engine.pause()
    engine.load_adapter("a", adapters["c"])  # replaced in place
    engine.unload_adapter("b")
    assert set(old.values()) <= set(engine._peft.peft_config)  # still decoding
    refused = engine.submit(GenerationJob(prompt_ids=[1, 10], adapter="b", max_tokens=2))
    engine.resume()
    _assert_same([future.result(60) for future in futures], alone)
    with pytest.raises(ConfigError):
        refused.result(60)
    _wait(lambda: not set(old.values()) & set(engine._peft.peft_config))  # deleted after their last rows (answered first)
    replaced = engine.submit(GenerationJob(prompt_ids=[1, 10, 11], adapter="a", n=2, temperature=1.0, seed=0, max_tokens=64, ignore_eos=True))
    assert [s.token_ids for s in replaced.result(60)] != [s.token_ids for s in alone[0]]  # now c's weights


@pytest.mark.parametrize("other", ["d", "dora"])
def test_adapters_of_other_ranks_layers_and_kinds_mixed_in_one_forward(engine, adapters, other):
    """``d`` (rank 4 on three layer types, rsLoRA) stacks beside ``a``'s rank 8 on every layer.  A DoRA
    adapter can neither be stacked nor passed in peft's ``adapter_names``: its rows decode in batches of
    their own.  Both sample what they sample alone."""
    engine.load_adapter(other, adapters[other])
    jobs = [GenerationJob(prompt_ids=[1, 10 + i, 11, 12], adapter=name, n=2, temperature=1.0, seed=i, max_tokens=24, ignore_eos=True,
                          top_logprobs=2) for i, name in enumerate(("a", None, other))]  # fmt: skip
    alone = _alone(engine, jobs)
    greedy = [engine.submit(GenerationJob(prompt_ids=[1, 40], adapter=name, temperature=0.0, max_tokens=8, ignore_eos=True)).result(60)
              for name in ("a", other)]  # fmt: skip
    assert max(abs(x - y) for x, y in zip(greedy[0][0].logprobs, greedy[1][0].logprobs)) > 100 * TOLERANCE  # they differ
    batched = engine.stats["batched_lora"]
    engine.pause()
    futures = [engine.submit(job) for job in jobs]
    engine.resume()
    _assert_same([future.result(60) for future in futures], alone)
    if other == "d":
        assert engine.stats["max_adapters"] == 3 and engine.stats["batched_lora"] > batched
    else:
        assert engine.stats["max_adapters"] == 2 and engine.stats["batched_lora"] > batched  # a with the base; DoRA alone


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stacked_deltas_equal_pefts_own_per_row_adapters(tiny_llama, adapters, dtype):
    """One forward of rows of ``a``, ``b``, ``d`` and the base: :class:`BatchedLoRA`'s stacked product gives peft's
    own per-row ``adapter_names`` logprobs, in bf16 base weights too (peft keeps the LoRA weights in fp32; the
    stacks, the scaled mask and the products stay in their dtype, so folding the scaling into the mask changes
    no rounding that matters)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tracerl.inference.multi_lora import BatchedLoRA

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=getattr(torch, dtype)), adapters["a"], adapter_name="a")
    for name in ("b", "d"):
        model.load_adapter(adapters[name], adapter_name=name)
    model.eval()
    rows = ["a", None, "b", "d", "a"]
    ids = torch.randint(3, 4096, (len(rows), 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        peft_rows = model(input_ids=ids, adapter_names=[row or "__base__" for row in rows]).logits.float().log_softmax(-1)
        base = model(input_ids=ids, adapter_names=["__base__"] * len(rows)).logits.float().log_softmax(-1)
        with BatchedLoRA(model).rows(rows) as stacked_model:
            stacked = stacked_model(input_ids=ids).logits.float().log_softmax(-1)
    tolerance = TOLERANCE if dtype == "float32" else 1e-2
    assert (stacked - peft_rows).abs().max().item() <= tolerance
    assert (peft_rows - base)[[0, 2, 3, 4]].abs().amax(dim=(1, 2)).min().item() > 50 * tolerance  # every adapter row differs from the base
    assert (stacked - base)[1].abs().max().item() <= tolerance  # the base row keeps no delta


@pytest.mark.parametrize("family", ["gemma3", "gptoss"])
def test_windowed_families_mix_adapters_and_joins_as_each_row_alone(tmp_path, family, sharp_family_model):
    """Gemma 3 and gpt-oss keep sliding-window layers (a window of 8 here, so 16 decoded tokens run past it): rows of
    two adapters and the base, and a second wave submitted while they decode, each sample what they sample alone.

    transformers measures a window in cache slots: a join's slots after the running rows' tokens shortened their
    window for good (gemma3: logprobs 0.14 apart; gpt-oss: other tokens), so these caches take no joins."""
    folder = sharp_family_model(family)  # a window of 8
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    adapters = {name: _random_lora(folder, tmp_path / name, seed, target_modules=attention) for seed, name in enumerate("ab", start=1)}
    engine = GenerationEngine(folder, max_batch_rows=64, device="cpu", dtype="float32")
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    engine.start()
    try:
        jobs = [GenerationJob(prompt_ids=[2, 300 + i, 301, 302, 303][: 3 + i % 3], adapter=name, n=2, temperature=1.0, seed=i,
                              max_tokens=16, ignore_eos=True)
                for i, name in enumerate(("a", None, "b", "a", "b"))]  # fmt: skip
        alone = _alone(engine, jobs)
        engine.pause()
        futures = [engine.submit(job) for job in jobs[:3]]
        forwards = engine.stats["forwards"]
        engine.resume()
        _wait(lambda: engine.stats["forwards"] >= forwards + 8)  # at the window's edge: the rest arrives
        engine.pause()
        futures += [engine.submit(job) for job in jobs[3:]]
        engine.resume()
        _assert_same([future.result(60) for future in futures], alone)
        assert engine.stats["max_adapters"] == 3 and engine.stats["batched_lora"] > 0
        assert engine.stats["joins"] == 0  # the second wave waited for a batch of its own
    finally:
        engine.stop()
