"""SFT on the real SmolLM2-135M, then RL on the same adapter, served by the transformers server.

One model goes through: SFT (step 1) -> one GRPO step (step 2) -> SFT from an OpenAI JSONL
file with tool calls (step 3) -> a fresh backend resumes at step 3.
"""

from __future__ import annotations

import json

import pytest

import tracerl
from sft_helpers import CAPITALS, capital_example, expected_mask, tool_example, write_jsonl
from tracerl.train.sft_config import SFTConfig
from tracerl.train.sft_data import load_sft_file, tokenize_examples

pytestmark = [pytest.mark.real_model, pytest.mark.asyncio(loop_scope="session")]  # the served fixture's loop: one client

QUESTION = [{"role": "system", "content": "Answer in one short sentence."}, {"role": "user", "content": "What is the capital of Peru?"}]


@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    base = tmp_path_factory.mktemp("sft-runs")
    model = tracerl.TrainableModel("warm", "tests", "smollm2-135m", base_path=base)
    backend = tracerl.LocalBackend(inference="transformers")
    await model.register(backend)
    config = SFTConfig(
        learning_rate=2e-3, batch_size=4, epochs=2, schedule_type="cosine", warmup_ratio=0.25, val_fraction=0.25, show_progress=False
    )
    result = await backend.train_sft(model, [capital_example(*c) for c in CAPITALS], config)
    yield model, backend, result, base
    await backend.close()


async def test_sft_lowers_held_out_loss_and_commits_step_one(served):
    model, _, result, _ = served
    m = result.metrics
    assert result.step == 1 and result.checkpoint_path.endswith("0001")
    assert m["num_examples"] == 9 and m["num_val_examples"] == 3 and m["optimizer_steps"] == 6
    assert m["val_loss"] < m["val_loss_before"], m
    assert m["val_loss_epoch_2"] <= m["val_loss_epoch_1"] * 1.5
    assert m["learning_rate_last"] == pytest.approx(0.0) and m["learning_rate_peak"] == pytest.approx(2e-3)
    record = json.loads((model.run_dir.checkpoint_path(1) / "step.json").read_text())
    assert record["split"] == "sft" and record["step"] == 1
    [row] = [r for r in model.history() if r["step"] == 1]
    assert row["sft/val_loss"] == m["val_loss"] and row["sft/trained_tokens"] == m["trained_tokens"]
    assert model.get_inference_name() == "warm@1"


async def test_rl_after_sft_samples_the_sft_adapter_and_serves_the_next_step(served, smol_tokenizer):
    model, backend, _, _ = served
    client = model.openai_client()
    completion = await client.chat.completions.create(
        model=model.get_inference_name(), messages=QUESTION, max_tokens=12, n=2, temperature=1.0,
        logprobs=True, extra_body={"return_token_ids": True},
    )  # fmt: skip
    choices = [tracerl.Choice.from_openai(c, completion) for c in completion.choices]
    group = tracerl.TrajectoryGroup(
        tracerl.Trajectory(messages_and_choices=[*QUESTION, c], reward=float(i)) for i, c in enumerate(choices)
    )
    result = await backend.train(model, [group], learning_rate=1e-4)
    assert result.step == 2
    # the served warm@1 and the trainer's SFT adapter are the same network
    assert result.metrics["sampler_trainer_prob_corr"] > 0.999
    await model.log([group], split="train", metrics=result.metrics, step=result.step)
    answer = await client.chat.completions.create(model="warm@2", messages=QUESTION, max_tokens=4)
    assert answer.choices[0].message.content is not None and model.get_inference_name() == "warm@2"


async def test_openai_jsonl_with_tool_calls_trains_exactly_the_assistant_tokens(served, smol_tokenizer, tmp_path):
    model, backend, _, _ = served
    records = [tool_example(a, b, first_weight=w) for a, b, w in ((17, 25, None), (3, 4, 0), (120, 7, 1))]
    path = write_jsonl(tmp_path / "tools.jsonl", records)
    sequences = [s for ex in tokenize_examples(load_sft_file(path), smol_tokenizer) for s in ex]
    expected_trained = 0
    for record, sequence in zip(records, sequences, strict=True):
        full, mask = expected_mask(smol_tokenizer, record)
        assert sequence.token_ids == full[: len(sequence.token_ids)]
        assert sequence.weights == mask[: len(sequence.token_ids)]
        expected_trained += int(sum(mask))
    result = await backend.train_sft(model, path, SFTConfig(learning_rate=1e-4, batch_size=3, show_progress=False))
    assert result.step == 3, "SFT continues the step counter after RL"
    assert result.metrics["trained_tokens"] == expected_trained
    assert result.metrics["sequence_breaks/total"] == 0
    answer = await model.openai_client().chat.completions.create(model="warm@3", messages=QUESTION, max_tokens=4)
    assert answer.choices


async def test_a_bad_file_fails_before_training_naming_its_line(served, tmp_path):
    model, backend, _, _ = served
    step = await backend.get_step(model)
    path = write_jsonl(tmp_path / "bad.jsonl", [capital_example("Peru", "Lima"), {"messages": [{"role": "user", "content": "hi", "weight": 1}]}])
    with pytest.raises(tracerl.TrajectoryError, match=rf"{path} line 2, message 0: 'weight' is only allowed on assistant"):
        await backend.train_sft(model, path, SFTConfig(show_progress=False))
    with pytest.raises(tracerl.ConfigError, match="learning_rate"):
        await backend.train_sft(model, path, {"learning_rate": float("nan")})
    assert await backend.get_step(model) == step


async def test_a_fresh_backend_resumes_after_the_sft_steps(served):
    model, backend, _, base = served
    await backend.close()  # frees the run lock (the fixture's close is then a no-op)
    again = tracerl.TrainableModel("warm", "tests", "smollm2-135m", base_path=base)
    other = tracerl.LocalBackend(inference=None)
    await again.register(other)
    try:
        assert await again.get_step() == 3
        splits = {(row["step"], key.split("/")[0]) for row in again.history() for key in row if "/" in key}
        assert {(1, "sft"), (2, "train"), (3, "sft")} <= splits
        assert sum(1 for row in again.history() if row["step"] == 3) == 1
    finally:
        await other.close()
