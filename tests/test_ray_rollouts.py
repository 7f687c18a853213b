"""Rollouts as Ray tasks on a real two-node Ray cluster (loopback): capture runs on the workers.

The rollouts call two inference replicas (``RayReplicas``, the tiny random Llama) through the
router; what fails fails for real: an exception in the agent, a worker process that exits, an
inference server that is not there (the agent swallows the error; capture does not).
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
import ray_rollout_agents as agents  # noqa: E402

import tracerl  # noqa: E402
from tracerl.cluster.ray_replicas import RayReplicas  # noqa: E402
from tracerl.cluster.ray_rollouts import RayRollouts, ShippedModel  # noqa: E402

ray.cloudpickle.register_pickle_by_value(agents)


@pytest.fixture()
async def replicas(ray_cluster, tiny_llama):
    served = RayReplicas(tiny_llama, replicas=2, num_cpus=1, served_name="agent@0", server_options={"num_threads": 1})
    await served.start()
    yield served
    await served.stop()


def _model(tmp_path: Path, tiny_llama: Path, base_url: str, api_key: str | None) -> tracerl.TrainableModel:
    return tracerl.TrainableModel("agent", "ray-rollouts", base_model=str(tiny_llama), base_path=tmp_path,
                                  inference_base_url=base_url, inference_api_key=api_key)


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


async def test_rollouts_run_as_ray_tasks_on_both_nodes_and_are_captured_there(replicas, tiny_llama, tmp_path):
    model = _model(tmp_path, tiny_llama, replicas.base_url, replicas.api_key)
    on_cluster = RayRollouts(num_cpus=1).remote(agents.ask)
    groups = await tracerl.gather_trajectory_groups(
        (tracerl.TrajectoryGroup(on_cluster(model, prompt) for _ in range(2)) for prompt in ("w5 w6", "w7 w8")),
        pbar_desc=None)
    assert [len(g.trajectories) for g in groups] == [2, 2] and not any(g.exceptions for g in groups)
    nodes = {t.metadata["node"] for g in groups for t in g.trajectories}
    assert nodes == {n["NodeID"] for n in ray.nodes() if n["Alive"]}  # SPREAD: both nodes ran rollouts
    for group in groups:
        assert len({t.metadata["group"] for t in group.trajectories}) == 1  # the group id travelled
        for t in group.trajectories:
            (turn,) = t.sampled_turns()  # captured on the worker: exact token ids and logprobs
            assert len(turn.token_ids) == 3 and len(turn.logprobs) == 3 and turn.prompt_token_ids
            assert t.reward == float(len(turn.message["content"] or ""))
            assert t.trace_id
    assert groups[0].trajectories[0].metadata["group"] != groups[1].trajectories[0].metadata["group"]


async def test_failures_come_back_as_the_groups_exception_records(ray_cluster, tiny_llama, tmp_path):
    model = _model(tmp_path, tiny_llama, _closed_port_url(), "key")
    rollouts = RayRollouts(num_cpus=1)
    group = tracerl.TrajectoryGroup([rollouts.run(agents.raises, model, "w5"), rollouts.run(agents.exits, model, "w5"),
                                     rollouts.run(agents.swallows, model, "w5")])
    (gathered,) = groups = await tracerl.gather_trajectory_groups([group], max_exceptions=3, pbar_desc=None)
    assert gathered.trajectories == []  # none of them is ever trained on
    by_type = {record.type: record for record in gathered.exceptions}
    assert set(by_type) == {"ValueError", "RolloutWorkerError", "InferenceServerError"}
    assert "makes this agent fail" in by_type["ValueError"].message
    assert "raised in a Ray task" in by_type["ValueError"].traceback  # the worker's traceback came along
    assert "WorkerCrashedError" in by_type["RolloutWorkerError"].message
    assert groups.metrics["infrastructure_exceptions"] == 2.0  # the crash and the swallowed failure


async def test_a_cancelled_rollout_cancels_its_ray_task(ray_cluster, tmp_path):
    task = asyncio.ensure_future(RayRollouts(num_cpus=1).run(agents.hangs, str(tmp_path)))
    await _until(lambda: (tmp_path / "started").exists() or task.done())
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _until(lambda: (tmp_path / "unwound").exists())  # the worker's finally: blocks ran


def test_models_travel_without_their_backend_with_the_served_name_pinned(tmp_path):
    model = tracerl.TrainableModel("agent", "p", base_model="x", base_path=tmp_path,
                                   inference_base_url="http://10.0.0.1:8000/v1", inference_api_key="k")
    model._step_cache = 7
    shipped = ray.cloudpickle.loads(ray.cloudpickle.dumps(ShippedModel(model)))
    assert (shipped.get_inference_name(), shipped.trainable, shipped.inference_api_key) == ("agent@7", True, "k")
    assert shipped.inference_base_url == model.inference_base_url and shipped._backend is None
    with pytest.raises(tracerl.ConfigError):
        RayRollouts().remote(lambda: None)


async def _until(condition, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "gave up waiting"
        await asyncio.sleep(0.2)
