"""bf16 end to end on this CPU: SmolLM2's real weights trained and served in bf16.

The base weights are bf16 in the trainer and the server; the LoRA, the optimizer state and the
logprob math stay fp32.  Sampler and trainer agree on the real weights within the bf16 limit of the
train–inference agreement table, and a small-learning-rate step is served as what it is, never
rounded back to the base: served adapters keep the update, merged bf16 serving (which would lose
it) is refused.

The limit, set on SmolLM2's real weights: the sampler decodes one token at a time against its KV
cache, the trainer computes the whole sequence at once, and in bf16 the two round differently.
Measured here (2026-12-06, this CPU, 60 tokens sampled at T = 0.8 and re-scored): a mismatch KL of
2.0–2.4e-3 with both sides' output heads in bf16, still 1.1–1.7e-3 with both in fp32; the served
step below measured 1.9e-3.  transformers' own ``generate`` against its own ``forward`` over the
same sequence shows the same floor (a KL of 2.1e-3, SDPA or eager attention).  So 5e-3 is the bf16
limit, half the default ``max_mismatch_kl``.
"""

from __future__ import annotations

import pytest
import torch

import tracerl

BF16_KL = 5e-3
QUESTION = [{"role": "user", "content": "Name three colours."}]


def test_merged_serving_below_fp32_is_refused(tmp_path):
    with pytest.raises(tracerl.ConfigError, match="would lose the update"):
        tracerl.LocalBackend(tmp_path, serve_merged=True, dtype="bfloat16")
    with pytest.raises(tracerl.ConfigError, match="dtype must be one of"):
        tracerl.LocalBackend(tmp_path, dtype="float16")


async def test_bf16_training_agrees_with_bf16_serving_and_a_small_step_is_served(tmp_path):
    from tracerl.train.distill import TeacherQuery, served_teacher

    backend = tracerl.LocalBackend(tmp_path, inference="transformers", dtype="bfloat16")
    model = tracerl.TrainableModel("bf16", "tests", "smollm2-135m", lora_config={"r": 8})
    try:
        await model.register(backend)
        trainer = backend._trainer(backend._state(model))
        assert next(trainer.model.get_base_model().model.parameters()).dtype == torch.bfloat16
        assert all(p.dtype == torch.float32 for p in trainer.params)  # LoRA and Adam state in fp32
        client = model.openai_client()
        trajectories = []
        for seed, reward in ((1, 1.0), (2, 0.0), (3, 0.5), (4, 0.2)):
            async with tracerl.rollout(model) as captured:
                await client.chat.completions.create(model=model.get_inference_name(), messages=QUESTION, max_tokens=24,
                                                     temperature=0.8, seed=seed)  # fmt: skip
            captured.trajectory.reward = reward
            trajectories.append(captured.trajectory)
        turn = trajectories[0].sampled_turns()[0]
        query = TeacherQuery(QUESTION, None, turn.prompt_token_ids, turn.token_ids)
        before = await served_teacher(model, model_name=model.get_inference_name(0)).score(query)

        result = await backend.train(model, [tracerl.TrajectoryGroup(trajectories)])  # the default (small) learning rate
        metrics = result.metrics
        print(f"agreement smollm2-135m bfloat16 transformers: mismatch_kl={metrics['mismatch_kl']:.3g} "
              f"max_abs={metrics['mismatch_abs_max']:.3g} tokens={metrics['mismatch_tokens']:.0f}")
        assert metrics["mismatch_tokens"] == metrics["trained_tokens"] > 0
        assert metrics["mismatch_kl"] <= BF16_KL

        after = await served_teacher(model, model_name=model.get_inference_name(1)).score(query)
        assert max(abs(a - b) for a, b in zip(after, before)) > 0  # step 1 is served, not the base
    finally:
        await backend.close()
