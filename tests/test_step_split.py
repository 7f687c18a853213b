"""Every training step's metrics say where its wall time went: rollouts, train, save, hot-load.

The light tests check the gather's own clock and how ``LocalBackend.train`` picks it up; the
real-model test runs one served step end to end (transformers server: a real hot-load) and
reads the split back from the step's history row.  No test asserts how fast anything is.
"""

from __future__ import annotations

import asyncio

import pytest

import tracerl
from tracerl.gather import GatheredGroups
from tracerl.train.local_backend import _gather_seconds

SPLIT = ("rollout_seconds", "train_seconds", "save_seconds", "hot_load_seconds")


async def _trajectory(reward: float) -> tracerl.Trajectory:
    await asyncio.sleep(0)
    return tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=reward)


def test_gather_records_its_wall_time_and_train_reads_it():
    groups = asyncio.run(
        tracerl.gather_trajectory_groups([tracerl.TrajectoryGroup([_trajectory(0.0), _trajectory(1.0)])], pbar_desc=None)
    )
    assert isinstance(groups, GatheredGroups) and groups.metrics["seconds"] >= 0
    assert _gather_seconds(groups) == groups.metrics["seconds"]


def test_groups_not_from_a_gather_carry_no_rollout_time():
    group = tracerl.TrajectoryGroup([tracerl.Trajectory(messages_and_choices=[], reward=0.0)], metrics={"seconds": 3.0})
    assert _gather_seconds([group]) is None  # a user's group metric named "seconds" is not the gather's clock
    odd = GatheredGroups([group])
    odd.metrics = {"seconds": float("nan")}
    assert _gather_seconds(odd) is None


@pytest.mark.real_model
def test_a_served_step_reports_its_split_in_metrics_and_history(tmp_path):
    question = [{"role": "user", "content": "Say a colour."}]

    async def rollout(model: tracerl.TrainableModel, reward: float) -> tracerl.Trajectory:
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=question, max_tokens=4, temperature=1.0,
            logprobs=True, extra_body={"return_token_ids": True},
        )  # fmt: skip
        choice = tracerl.Choice.from_openai(completion.choices[0], completion)
        return tracerl.Trajectory(messages_and_choices=[*question, choice], reward=reward)

    async def run() -> tuple[GatheredGroups, tracerl.TrainResult, dict]:
        model = tracerl.TrainableModel("split", "tests", "smollm2-135m", base_path=tmp_path)
        backend = tracerl.LocalBackend(inference="transformers")
        await model.register(backend)
        try:
            groups = await tracerl.gather_trajectory_groups(
                [tracerl.TrajectoryGroup(rollout(model, r) for r in (0.0, 1.0))], pbar_desc=None
            )
            result = await backend.train(model, groups, learning_rate=1e-4)
            row = await model.log(groups, split="train", metrics=result.metrics, step=result.step)
            return groups, result, row
        finally:
            await backend.close()

    groups, result, row = asyncio.run(run())
    metrics = result.metrics
    assert all(metrics[key] > 0 for key in SPLIT), {key: metrics.get(key) for key in SPLIT}
    assert metrics["rollout_seconds"] == groups.metrics["seconds"]
    assert metrics["train_seconds"] + metrics["save_seconds"] + metrics["hot_load_seconds"] <= metrics["step_seconds"]
    assert all(f"train/{key}" in row for key in SPLIT)
