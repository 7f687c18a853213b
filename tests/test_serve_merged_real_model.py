"""``LocalBackend(serve_merged=True)``: after a train step vLLM serves exactly the trainer's policy.

The policy is served as one merged model (no ``--enable-lora``) whose weights are reloaded in
place after each step.  The proof is on the tokens vLLM itself sampled after step 1: the
logprobs it reported equal the trainer's logprobs of the same token ids (and are far from the
base model's), and the next step's ``sampler_trainer_prob_corr`` is 1.  Skipped without the
vLLM runtime.  Run heavy:
``flock /tmp/tracerl-heavy.lock .venv/bin/python -m pytest -q tests/test_serve_merged_real_model.py``.

``make test`` runs the tiny configuration (:data:`CONFIG`): 8 streams across the swap, vLLM eager;
``TRACERL_FULL=1`` (``make test-long``) the full one: 16 streams, vLLM as the demo runs it (torch.compile
on, which merged serving turns on: no LoRA), so the reload is also shown to reach the compiled model.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from openai import AsyncOpenAI, NotFoundError

import tracerl
from tracerl.train.packing import pack_sequences
from tracerl.train.tokenization import tokenize_trajectory

from suite_size import tiny_or_full

pytestmark = pytest.mark.real_model

QUESTION = [{"role": "user", "content": "Name a colour and say why you like it."}]
CONFIG = tiny_or_full(
    {"workers": 8, "rounds_after": 1, "stream_tokens": 16, "vllm_args": ["--enforce-eager"]},
    {"workers": 16, "rounds_after": 2, "stream_tokens": 24, "vllm_args": []},
)
"""Concurrent streams across the swap, rounds each streams after it, tokens a stream, vLLM's extra flags."""


def _vllm_missing() -> str | None:
    from tracerl.inference.vllm_server import vllm_python

    return None if vllm_python() is not None else "the vLLM runtime is not installed"


async def _sample_group(client: AsyncOpenAI, name: str) -> tracerl.TrajectoryGroup:
    completion = await client.chat.completions.create(
        model=name, messages=QUESTION, max_tokens=12, temperature=1.0, n=4, seed=0
    )
    trajectories = [
        tracerl.Trajectory(messages_and_choices=[*QUESTION, tracerl.Choice.from_openai(c, completion)], reward=float(i % 2))
        for i, c in enumerate(completion.choices)
    ]
    return tracerl.TrajectoryGroup(trajectories)


def _served_and_trainer_logprobs(trainer, tokenizer, group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token: the sampler's logprob, the trainer's (adapter on) and the base model's (adapter off).

    Every trajectory of ``group`` packed into as few micro-batches as the trainer's own packing makes."""
    sequences = [s for i, t in enumerate(group.trajectories) for s in tokenize_trajectory(t, tokenizer, trajectory_index=i)]
    served, policy, base = [], [], []
    for batch in pack_sequences(sequences, [1.0] * len(sequences)):
        served.append(batch.old_logprobs_N)
        policy.append(trainer.token_logprobs(batch))
        with trainer.model.disable_adapter():
            base.append(trainer.token_logprobs(batch))
    return torch.cat(served), torch.cat(policy), torch.cat(base)


async def _stream(client: AsyncOpenAI, name: str, i: int) -> tracerl.Trajectory:
    """One streamed answer, as the SDK reads it, kept as a trajectory (the served name, ids, logprobs and when)."""
    messages = [{"role": "user", "content": f"Count from {i} and say why."}]
    started = time.monotonic()
    stream = await client.chat.completions.create(
        model=name, messages=messages, max_tokens=CONFIG["stream_tokens"], temperature=1.0, stream=True, logprobs=True
    )
    first = None
    async for chunk in stream:
        if first is None and chunk.choices:
            first = chunk
    assert first is not None
    extra = first.choices[0].model_extra or {}
    choice = tracerl.Choice(
        message={"role": "assistant", "content": first.choices[0].delta.content or ""}, model=first.model,
        token_ids=extra["token_ids"], prompt_token_ids=extra["prompt_token_ids"],
        logprobs=[entry.logprob for entry in first.choices[0].logprobs.content],
    )  # fmt: skip
    return tracerl.Trajectory(messages_and_choices=[*messages, choice], metadata={"span": (started, time.monotonic())})


async def _streams_across(client: AsyncOpenAI, name: str, swap: "asyncio.Task") -> list[tracerl.Trajectory]:
    """``CONFIG["workers"]`` streams at a time, asking for ``name``, from before the swap until
    ``CONFIG["rounds_after"]`` rounds after it."""
    answers: list[tracerl.Trajectory] = []

    async def worker(w: int) -> None:
        rounds_after = 0
        while rounds_after < CONFIG["rounds_after"]:
            rounds_after += swap.done()
            answers.append(await _stream(client, name, w))

    await asyncio.gather(*(worker(w) for w in range(CONFIG["workers"])))
    return answers


def test_merged_serving_returns_the_trainers_policy_after_a_step(tmp_path):
    if reason := _vllm_missing():
        pytest.skip(reason)

    async def run():
        model = tracerl.TrainableModel("merged", "tests", "smollm2-135m", base_path=tmp_path)
        backend = tracerl.LocalBackend(
            inference="vllm", serve_merged=True, server_options={"env": {"VLLM_CPU_KVCACHE_SPACE": "1"}, "extra_args": CONFIG["vllm_args"]},
        )
        await model.register(backend)
        try:
            client = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key, max_retries=0, timeout=600)
            group = await _sample_group(client, model.get_inference_name(0))
            server = backend._state(model).server
            reload, reloads = server.reload_weights, []

            async def timed_reload(*args):
                reloads.append(time.monotonic())
                await reload(*args)

            server.reload_weights = timed_reload
            training = asyncio.create_task(backend.train(model, [group], learning_rate=5e-3))
            streams = await _streams_across(client, model.get_inference_name(0), training)  # the swap under concurrent streams
            first = await training
            spanning = [t for t in streams if t.metadata["span"][0] < reloads[0] < t.metadata["span"][1]]
            assert spanning, "no answer was in flight when the weights were swapped: the check means nothing"
            after_step = await _sample_group(client, model.get_inference_name(1))
            state = backend._state(model)
            logprobs = _served_and_trainer_logprobs(backend._trainer(state), backend.tokenizer(model), after_step)
            per_stream = [  # the streams of each name checked together: one packed forward each, not two per stream
                (name, _served_and_trainer_logprobs(backend._trainer(state), backend.tokenizer(model), tracerl.TrajectoryGroup(named)))
                for name in sorted({t.sampled_turns()[0].model for t in streams})
                for named in [[t for t in streams if t.sampled_turns()[0].model == name]]
            ]
            second = await backend.train(model, [after_step], learning_rate=5e-3)
            with pytest.raises(NotFoundError):  # two steps back: no longer served
                await client.chat.completions.create(model=model.get_inference_name(0), messages=QUESTION, max_tokens=1)
            straggler = await client.chat.completions.create(model=model.get_inference_name(1), messages=QUESTION, max_tokens=1)
            assert {c.model for c in after_step.trajectories[0].sampled_turns()} == {"merged@1"}  # the policy that sampled it
            assert straggler.model == "merged@2"  # asked for step 1, answered by step 2's weights: the answer says so
            sft_example = {"messages": [*QUESTION, {"role": "assistant", "content": "Blue, because it looks calm."}]}
            sft = await backend.train_sft(model, [sft_example], {"learning_rate": 5e-3, "show_progress": False})
            after_sft = await _sample_group(client, model.get_inference_name(3))  # an SFT step is served merged too
            assert sft.step == 3 and {c.model for c in after_sft.trajectories[0].sampled_turns()} == {"merged@3"}
            sft_served, sft_policy, _ = _served_and_trainer_logprobs(backend._trainer(state), backend.tokenizer(model), after_sft)
            assert (sft_served - sft_policy).abs().max() < 2e-3, "vLLM did not serve the policy SFT wrote"
            return first, second, logprobs, streams, per_stream
        finally:
            await backend.close()

    first, second, (served, policy, base), streams, per_stream = asyncio.run(run())
    assert len(streams) >= CONFIG["workers"] * CONFIG["rounds_after"]  # none failed
    assert [name for name, _ in per_stream] == ["merged@0", "merged@1"]  # both sides of the swap
    for name, (stream_served, stream_policy, stream_base) in per_stream:  # every token of an answer from the policy it names
        named = stream_policy if name == "merged@1" else stream_base
        assert (stream_served - named).abs().max() < 2e-3, f"an answer named {name} holds tokens of another policy"
    assert first.step == 1 and second.step == 2 and first.metrics["hot_load_seconds"] > 0
    assert served.numel() >= 4
    assert (served - policy).abs().max() < 2e-3, "vLLM did not serve the trainer's step-1 policy"
    assert (base - policy).abs().max() > 10 * (served - policy).abs().max(), "the step barely moved the policy: the check means nothing"
    assert second.metrics["sampler_trainer_prob_corr"] > 0.999
