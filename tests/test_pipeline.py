"""The pipelined loop (``tracerl.PipelineTrainer``) and checkpoint retention.

The real-model test runs the loop on SmolLM2 served by the transformers server with rollouts
captured by ``tracerl.rollout``: every sampled turn names the policy that sampled it, a
group held back until it is two steps stale still gets the policy it pinned (its lease) and is
then dropped and counted, groups started while a
step trained are trained one step stale with the off-policy correction's diagnostics in the
row, retention never deletes the served checkpoint or one an in-flight group samples from,
and a second run resumes at the next scenario and the same final step.
"""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

import tracerl
from tracerl.errors import ConfigError
from tracerl.loops.pipeline import PipelineReport
from tracerl.loops.retention import CheckpointInfo, RetentionContext, keep_recent_and_top, metrics_by_step
from tracerl.train.served_policies import ServedPolicies

QUESTION = "Say one word."


def test_keep_recent_and_top_keeps_the_newest_and_the_best():
    checkpoints = [CheckpointInfo(s, {"val/reward": r} if r is not None else {}) for s, r in [(1, 0.9), (2, None), (3, 0.1), (4, 0.5), (5, None)]]
    policy = keep_recent_and_top(recent=2, top=1)
    assert set(policy(RetentionContext(6, checkpoints))) == {2, 3}
    assert set(keep_recent_and_top(recent=0, top=0)(RetentionContext(6, checkpoints))) == {1, 2, 3, 4, 5}
    with pytest.raises(ConfigError, match="recent"):
        keep_recent_and_top(recent=-1)
    rows = [{"step": 2, "train/reward": 0.5}, {"step": 2, "val/reward": 1, "val/note": "x"}, {"step": "bad"}]
    assert metrics_by_step(rows) == {2: {"train/reward": 0.5, "val/reward": 1.0}}


def test_served_policies_retire_the_old_ones_no_lease_holds():
    served = ServedPolicies()
    for step in (0, 1):
        served.serve(step)
    assert served.next_to_retire() is None  # the newest and its predecessor (stragglers) stay
    served.hold(0)
    served.hold(0)
    served.serve(2)
    served.serve(3)
    assert served.next_to_retire() == 1  # 0 is leased twice
    served.retire(1)
    served.release(0)
    assert served.next_to_retire() is None
    served.release(0)
    assert served.next_to_retire() == 0 and not served.leases
    served.retire(0)
    assert served.steps == {2, 3} and served.next_to_retire() is None


def test_bad_settings_fail_before_anything_runs():
    model = tracerl.TrainableModel("p", "tests", "smollm2-135m")
    for bad in ({"max_staleness": -1}, {"groups_per_step": 0}, {"max_steps": True}):
        with pytest.raises(ConfigError):
            tracerl.PipelineTrainer(model, None, None, [], **{"max_steps": 2, **bad})  # type: ignore[arg-type]


@pytest.mark.real_model
def test_the_pipelined_loop_tags_bounds_corrects_retains_and_resumes(tmp_path, capfd):
    pinned_answers: list[str] = []

    async def one(model: tracerl.TrainableModel, scenario: dict) -> tracerl.Trajectory:
        async with tracerl.rollout(model, task=scenario["id"]) as r:
            pinned = model.get_inference_name()  # as a LangGraph agent builds its chat model once
            await model.openai_client().chat.completions.create(
                model=pinned, messages=[{"role": "user", "content": QUESTION}], max_tokens=3, temperature=1.0
            )
            if scenario["slow"]:  # a tool that answers only after two more steps: the group goes stale
                async with asyncio.timeout(300):
                    while model.policy_step(model.get_inference_name()) < scenario["started"] + 2:  # step 2 served, step 0 retired but for the lease
                        await asyncio.sleep(0.1)
                again = await model.openai_client().chat.completions.create(  # the group's lease kept its policy served
                    model=pinned, messages=[{"role": "user", "content": QUESTION}], max_tokens=1
                )
                pinned_answers.append(again.model)
            else:
                await asyncio.sleep(0.3)  # a tool call's wait, so rollouts overlap the training step
        trajectory = r.trajectory
        trajectory.reward = float(len(trajectory.sampled_turns()[0].message.get("content") or ""))
        return trajectory

    async def rollout_group(model: tracerl.TrainableModel, scenario: dict, config: None) -> tracerl.TrajectoryGroup:
        scenario = {**scenario, "started": await model.get_step()}
        return tracerl.TrajectoryGroup(one(model, scenario) for _ in range(3))

    scenarios = [{"id": i, "slow": i == 0} for i in range(40)]
    offered: list[tuple[int, set[int]]] = []

    def retention(context: RetentionContext) -> set[int]:
        deletable = {c.step for c in context.checkpoints}
        offered.append((context.current_step, deletable))
        return deletable  # as greedy as a policy can be: the trainer must still protect what is in use

    async def asks_for_the_served_policy(model: tracerl.TrainableModel, refused: list[str]) -> None:
        """An agent's next turns, back to back: each asks for ``get_inference_name()``, the policy served now."""
        while True:
            name = model.get_inference_name()
            try:
                await model.openai_client().chat.completions.create(model=name, messages=[{"role": "user", "content": QUESTION}], max_tokens=1)
            except openai.NotFoundError:
                refused.append(name)

    async def run(max_steps: int, stop=None) -> tuple[PipelineReport, list[dict], list[int]]:
        model = tracerl.TrainableModel("pipe", "tests", "smollm2-135m", base_path=tmp_path)
        backend = tracerl.LocalBackend(inference="transformers")
        await model.register(backend)
        try:
            trainer = tracerl.PipelineTrainer(
                model, backend, rollout_group, scenarios, groups_per_step=2, max_steps=max_steps, max_staleness=1,
                train_kwargs={"learning_rate": 1e-4}, checkpoint_retention=retention, stop=stop,
            )  # fmt: skip
            refused: list[str] = []
            agent = asyncio.create_task(asks_for_the_served_policy(model, refused))
            try:
                report = await trainer.train()
            finally:
                agent.cancel()
            assert not refused, f"{len(refused)} requests for the policy get_inference_name() named were refused: {sorted(set(refused))}"  # named once served
            with pytest.raises(openai.NotFoundError):  # once its leases ended the old policy was retired
                await model.openai_client().chat.completions.create(model=model.get_inference_name(0), messages=[{"role": "user", "content": QUESTION}], max_tokens=1)
            return report, model.history(), await backend.list_checkpoints(model)
        finally:
            await backend.close()

    report, history, checkpoints = asyncio.run(run(4))
    bar = capfd.readouterr().err.split("\r")[-1]
    assert "pipeline: 100%" in bar and "4/4" in bar and "reward=" in bar and "dropped=" in bar and "mismatch KL=" in bar, bar  # the step bar
    rows = [row for row in history if "train/reward" in row]
    assert [row["step"] for row in rows] == [1, 2, 3, 4] == report.steps
    assert pinned_answers == ["pipe@0"] * 3  # the slow group's pinned policy, after steps 1 and 2 were served
    assert report.groups_dropped_stale >= 1 and sum(row["train/groups_dropped_stale"] for row in rows) == report.groups_dropped_stale
    assert all(row["train/staleness_max"] <= 1 for row in rows)
    stale_rows = [row for row in rows if row["train/staleness_max"] == 1]
    assert stale_rows and all(row["train/stale_turns"] > 0 and "train/off_policy_ratio_mean" in row for row in stale_rows)
    assert checkpoints[-2:] == [3, 4] and 1 not in checkpoints  # served and its predecessor (stragglers) kept; the rest went
    assert len(offered) == 4 and all(current not in deletable and current - 1 not in deletable for current, deletable in offered)
    assert 0 not in offered[1][1]  # after step 2 the slow group, sampled by step 0, was still in flight: step 0 stays

    from tracerl.runs.storage import RunDir, read_jsonl

    run_dir = RunDir(tmp_path, "tests", "pipe")
    stored = [t for step in (1, 2, 3, 4) for t in read_jsonl(run_dir.trajectories_path("train", step))]
    turns = [item for t in stored for item in t["messages_and_choices"] if "token_ids" in item]
    assert turns and all(item["model"].startswith("pipe@") for item in turns)  # every sampled turn says which policy
    assert all(t["metadata"].get("task") != 0 for t in stored)  # the slow group was never trained

    report2, history2, _ = asyncio.run(run(9, stop=lambda: True))  # resumed at step 4; stop() ends it after one step
    assert report2.steps == [5]
    offsets = [row["train/scenario_offset"] for row in history2 if "train/scenario_offset" in row]
    assert offsets == sorted(offsets) and len(offsets) == 5 and offsets[-1] > offsets[-2]


def test_a_backend_told_the_server_has_its_own_device_serves_while_it_trains(tmp_path):
    """``pause_serving_while_training=False``: requests are answered during the optimizer step (by default they wait)."""

    async def main() -> None:
        model = tracerl.TrainableModel("overlap", "tests", "smollm2-135m", base_path=tmp_path)
        backend = tracerl.LocalBackend(inference="transformers", pause_serving_while_training=False)
        await model.register(backend)
        try:
            trajectories = []
            for reward in (0.0, 1.0):
                async with tracerl.rollout(model, task="overlap") as r:
                    await model.openai_client().chat.completions.create(
                        model=model.get_inference_name(), messages=[{"role": "user", "content": QUESTION}], max_tokens=3, temperature=1.0
                    )
                r.trajectory.reward = reward
                trajectories.append(r.trajectory)
            windows: list[tuple[float, float]] = []
            run_step = backend._run_step  # our own backend's optimizer step, timed

            def timed_step(*args: object) -> dict[str, float]:
                started = time.monotonic()
                try:
                    return run_step(*args)
                finally:
                    windows.append((started, time.monotonic()))

            backend._run_step = timed_step
            answered: list[float] = []

            async def agent() -> None:
                while True:
                    await model.openai_client().chat.completions.create(
                        model=model.get_inference_name(0), messages=[{"role": "user", "content": QUESTION}], max_tokens=1
                    )
                    answered.append(time.monotonic())

            asking = asyncio.create_task(agent())
            try:
                await backend.train(model, [tracerl.TrajectoryGroup(trajectories)], learning_rate=1e-4)
            finally:
                asking.cancel()
            [(started, ended)] = windows
            assert any(started < t < ended for t in answered), f"no answer during the {ended - started:.1f} s step"
        finally:
            await backend.close()

    asyncio.run(main())
