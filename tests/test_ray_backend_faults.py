"""``RayBackend`` when its trainer actor dies, and its SFT passthrough, on the tiny random Llama.

Faults are real: the trainer actor's process exits (``os._exit``) in the middle of a step, while
it writes the step's checkpoint, and it is killed between steps (``ray.kill``).  Each time the
caller gets a typed :class:`~tracerl.errors.InfrastructureError` (no hang), the committed
checkpoints stay as they were, the dying step's trajectories are never trained on or logged,
and a fresh backend resumes the run from the last committed step (the kernel dropped the dead
process's run lock).
"""

from __future__ import annotations

import sys

import httpx
import pytest

ray = pytest.importorskip("ray")
import ray_rollout_agents as agents  # noqa: E402

import tracerl  # noqa: E402
from tracerl.cluster.ray_backend import RayBackend  # noqa: E402
from tracerl.cluster.ray_replicas import RayReplicas  # noqa: E402
from tracerl.cluster.ray_rollouts import RayRollouts  # noqa: E402
from tracerl.errors import InfrastructureError  # noqa: E402

ray.cloudpickle.register_pickle_by_value(agents)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # die_while_saving runs in the actor

LORA = {"r": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]}


def die_while_saving(actor: object) -> None:
    """Run inside the trainer actor: its next checkpoint write stops half-way and the process exits."""
    import os

    from tracerl.train.trainer import LoRATrainer

    def save(self, path, *, step, with_optimizer=True):  # noqa: ANN001 - LoRATrainer.save's signature
        self.model.save_pretrained(path)  # the adapter is on disk, the optimizer and step record are not
        os._exit(1)

    LoRATrainer.save = save


async def _groups(model: tracerl.TrainableModel) -> list[tracerl.TrajectoryGroup]:
    on_cluster = RayRollouts(num_cpus=0.5).remote(agents.ask_for)
    return await tracerl.gather_trajectory_groups(
        (tracerl.TrajectoryGroup(on_cluster(model, prompt, float(i % 2)) for i in range(2)) for prompt in ("w5 w6", "w7 w8")),
        pbar_desc=None)


async def test_a_trainer_actor_that_dies_mid_step_or_between_steps_is_an_infrastructure_error(ray_cluster, tiny_llama, tmp_path):
    replicas = RayReplicas(tiny_llama, replicas=1, num_cpus=1, served_name="agent", server_options={"num_threads": 1})
    backend = RayBackend(replicas, path=tmp_path / "trainer-node")
    model = tracerl.TrainableModel("agent", "ray", base_model=str(tiny_llama), base_path=tmp_path / "client", lora_config=LORA)
    run = tmp_path / "trainer-node" / "ray" / "models" / "agent"
    await model.register(backend)
    resumed, closed = None, False
    try:
        groups = await _groups(model)
        assert (await backend.train(model, groups, learning_rate=1e-3)).step == 1
        await model.log(groups, split="train", step=1)
        committed = {p.name: p.read_bytes() for p in (run / "checkpoints" / "0001").iterdir() if p.is_file()}

        # 1. the actor's process exits while it writes checkpoint 2
        groups = await _groups(model)
        await backend._trainer.__ray_call__.remote(die_while_saving)
        with pytest.raises(InfrastructureError, match=r"the Ray trainer actor failed \(train\)"):
            await backend.train(model, groups, learning_rate=1e-3)
        assert sorted(p.name for p in (run / "checkpoints").iterdir() if not p.name.startswith(".")) == ["0000", "0001"]
        assert {p.name: p.read_bytes() for p in (run / "checkpoints" / "0001").iterdir() if p.is_file()} == committed
        assert model.get_inference_name() == "agent@1" and [row["step"] for row in model.history()] == [1]
        with pytest.raises(InfrastructureError):
            await backend.get_step(model)  # every later call says so too
        await backend.close()  # closing after the death does not raise either
        closed = True

        # a fresh backend on the same run directory resumes at step 1, the half-written step cleaned away
        replicas = RayReplicas(tiny_llama, replicas=1, num_cpus=1, served_name="agent", server_options={"num_threads": 1})
        resumed = RayBackend(replicas, path=tmp_path / "trainer-node")
        await model.register(resumed)
        assert model.get_inference_name() == "agent@1" and await resumed.list_checkpoints(model) == [0, 1]
        assert sorted(p.name for p in (run / "trajectories" / "train").iterdir()) == ["0001.jsonl"]  # step 2's never kept
        assert (await resumed.train(model, groups, learning_rate=1e-3)).step == 2

        # 2. the actor is killed between steps
        ray.kill(resumed._trainer)
        with pytest.raises(InfrastructureError, match=r"the Ray trainer actor failed \(train\)"):
            await resumed.train(model, groups, learning_rate=1e-3)
        assert sorted(p.name for p in (run / "checkpoints").iterdir() if not p.name.startswith(".")) == ["0000", "0001", "0002"]
        async with httpx.AsyncClient(timeout=120) as client:  # the replicas still serve the last committed step
            answer = await client.post(replicas.base_url + "/chat/completions", headers={"authorization": f"Bearer {replicas.api_key}"},
                                       json={"model": "agent@2", "max_tokens": 2, "messages": [{"role": "user", "content": "w5"}]})
            assert answer.status_code == 200, answer.text
    finally:
        if not closed:
            await backend.close()
        if resumed is not None:
            await resumed.close()


async def test_train_sft_runs_on_the_trainer_actor_and_every_replica_serves_its_step(ray_cluster, tiny_llama, tmp_path):
    replicas = RayReplicas(tiny_llama, replicas=1, num_cpus=1, served_name="agent", server_options={"num_threads": 1})
    backend = RayBackend(replicas, path=tmp_path / "trainer-node")
    model = tracerl.TrainableModel("agent", "ray-sft", base_model=str(tiny_llama), base_path=tmp_path / "client", lora_config=LORA)
    await model.register(backend)
    try:
        examples = [{"messages": [{"role": "user", "content": f"w{i}"}, {"role": "assistant", "content": f"w{i + 1}"}]}
                    for i in range(5, 9)]
        result = await backend.train_sft(model, examples, {"learning_rate": 1e-3, "batch_size": 2, "show_progress": False})
        assert result.step == 1 and model.get_inference_name() == "agent@1"
        rows = model.history()  # this machine's history.jsonl, as with RemoteBackend
        assert [row["step"] for row in rows] == [1] and any(key.startswith("sft/") for key in rows[0])
        async with httpx.AsyncClient(timeout=120) as client:
            answer = await client.post(replicas.urls[0] + "/v1/chat/completions", headers={"authorization": f"Bearer {replicas.api_key}"},
                                       json={"model": "agent@1", "max_tokens": 2, "messages": [{"role": "user", "content": "w5"}]})
            assert answer.status_code == 200, answer.text
        with pytest.raises(TypeError, match="learning_rat"):  # SFTConfig's own error, raised here before anything is sent
            await backend.train_sft(model, examples, {"learning_rat": 1e-3})
    finally:
        await backend.close()
