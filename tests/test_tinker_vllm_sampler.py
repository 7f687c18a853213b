"""``tracerl serve --tinker --tinker-sampler vllm``: the Tinker service's sampler is a multi-LoRA vLLM server.

Through the official ``tinker`` SDK on the real model (fp32 on this CPU, vLLM from tracerl's runtime):
a trained client's weights saved for sampling load into vLLM as a LoRA (the unembedding's LoRA
included, Tinker's default), its samples carry the logprobs the trainer computes for the same
tokens, ``compute_logprobs`` scores a prompt as the trainer does, evicted weights load again on
demand, and the tenant reaches the weights on ``/v1`` by name.  Skipped without the vLLM runtime."""

from __future__ import annotations

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types
from tinker_loopback import tinker_on_loopback

pytestmark = pytest.mark.real_model

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
KEY = "tml-vllm-sampler-test-0001"
TOLERANCE = 2e-3  # fp32 on both sides; vLLM's kernels sum in another order than transformers'


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    from tracerl.inference.vllm_server import vllm_python
    from tracerl.tinker.service import Limits

    if vllm_python() is None:
        pytest.skip("the vLLM runtime is not installed (make install-vllm)")
    limits = Limits(max_sampler_adapters=2, max_sampler_adapters_per_tenant=2)
    with tinker_on_loopback(tmp_path_factory.mktemp("vllm-sampler"), "tinker-vllm", keys={KEY: "vera"}, limits=limits, sampler="vllm",
                            sampler_options={"kv_cache_memory_bytes": 256 << 20}) as (url, running, _):  # fmt: skip
        yield url, running


def _trainer_logprobs(training, prompt: list[int], tokens: list[int]) -> list[float]:
    """The trainer's logprobs of ``tokens`` after ``prompt`` (the same weights the sampler was saved from)."""
    sequence = prompt + tokens
    datum = types.Datum(model_input=types.ModelInput.from_ints(sequence[:-1]),
                        loss_fn_inputs={"target_tokens": sequence[1:], "weights": [1.0] * (len(sequence) - 1)})  # fmt: skip
    return training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()


def test_vllm_samples_each_tenants_weights_with_the_trainers_logprobs(service):
    url, running = service
    client = tinker.ServiceClient(base_url=url, api_key=KEY)
    training = client.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    tokenizer = training.get_tokenizer()
    prompt = tokenizer.encode("Count: one, two,", add_special_tokens=False)
    datum = types.Datum(model_input=types.ModelInput.from_ints(prompt[:-1]), loss_fn_inputs={"target_tokens": prompt[1:], "weights": [1.0] * (len(prompt) - 1)})
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-3)).result()  # the adapter is not the base model any more

    saved = training.save_weights_for_sampler("v1").result().path
    sampler = client.create_sampling_client(model_path=saved).result()
    samples = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=3,
                             sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)).result().sequences  # fmt: skip
    assert len(samples) == 3 and all(1 <= len(s.tokens) <= 6 for s in samples)
    for sequence in samples:
        trainer = _trainer_logprobs(training, prompt, list(sequence.tokens))[-len(sequence.tokens):]
        assert max(abs(a - b) for a, b in zip(trainer, sequence.logprobs, strict=True)) < TOLERANCE

    scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    trainer = _trainer_logprobs(training, prompt[:1], prompt[1:])
    assert scored[0] is None and max(abs(a - b) for a, b in zip(scored[1:], trainer, strict=True)) < TOLERANCE

    base = client.create_sampling_client(base_model=BASE).result()
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    tuned = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=greedy).result().sequences[0]
    plain = base.sample(types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=greedy).result().sequences[0]
    assert max(abs(a - b) for a, b in zip(tuned.logprobs, plain.logprobs)) > 10 * TOLERANCE or tuned.tokens != plain.tokens

    # two more saves with a cap of 2: v1 is evicted from vLLM, then loaded again on demand with the same answer
    for name in ("v2", "v3"):
        more = client.create_sampling_client(model_path=training.save_weights_for_sampler(name).result().path).result()
        more.sample(types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=greedy).result()
    stats = httpx.get(f"{url}/api/v1/tracerl/stats", headers={"X-API-Key": KEY}, timeout=30).json()["service"]
    assert stats["sampler_adapters_peak"] <= 2 and stats["sampler_adapter_evictions"] >= 1
    assert stats["sampler_adapters_in_engine"] == stats["sampler_adapters_loaded"] <= 2
    again = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=greedy).result().sequences[0]
    assert again.tokens == tuned.tokens

    answer = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                        json={"model": "v1", "prompt": "Count: one, two,", "max_tokens": 4, "temperature": 0.0})  # fmt: skip
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"]
