"""The trainer as a Ray actor, inference as Ray replicas: two GRPO steps on a real two-node local
cluster, each taken by two data-parallel (gloo) workers, the rollouts as Ray tasks, and afterwards
both replicas serve ``name@2`` (issue 12's acceptance line).

The model is the tiny random Llama in ``make test``; ``TRACERL_FULL=1`` (``make test-long``) also
runs the real SmolLM2-135M (the same code path, a real model's weights and tokenizer).  The
adapters travel trainer node → object store → replicas.
"""

from __future__ import annotations

import httpx
import pytest

ray = pytest.importorskip("ray")
import ray_rollout_agents as agents  # noqa: E402

import tracerl  # noqa: E402
from suite_size import FULL  # noqa: E402
from tracerl.cluster.ray_backend import RayBackend  # noqa: E402
from tracerl.cluster.ray_replicas import RayReplicas  # noqa: E402
from tracerl.cluster.ray_rollouts import RayRollouts  # noqa: E402

ray.cloudpickle.register_pickle_by_value(agents)


@pytest.mark.parametrize("base", ["tiny_llama", *([pytest.param("smol_path", marks=pytest.mark.real_model)] if FULL else [])])
async def test_two_steps_on_the_trainer_actor_then_both_replicas_serve_name_at_2(ray_cluster, base, request, tmp_path):
    model_folder = request.getfixturevalue(base)  # the base model folder (the same path on both nodes)
    replicas = RayReplicas(model_folder, replicas=2, num_cpus=1, served_name="agent", server_options={"num_threads": 1})
    backend = RayBackend(replicas, path=tmp_path / "trainer-node", train_workers=2)  # two gloo workers per step
    model = tracerl.TrainableModel("agent", "ray", base_model=str(model_folder), base_path=tmp_path / "client",
                                   lora_config={"r": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]})
    await model.register(backend)
    try:
        assert model.get_inference_name() == "agent@0" and model.inference_base_url == replicas.base_url
        on_cluster = RayRollouts(num_cpus=0.5).remote(agents.ask_for)
        for step in (1, 2):
            groups = await tracerl.gather_trajectory_groups(
                (tracerl.TrajectoryGroup(on_cluster(model, prompt, float(i % 2)) for i in range(4)) for prompt in ("w5 w6", "w7 w8")),
                pbar_desc=None)
            assert all(t.sampled_turns()[0].token_ids for g in groups for t in g)  # captured on the workers
            result = await backend.train(model, groups, learning_rate=1e-3)
            assert result.step == step and "hot_load_seconds" in result.metrics
            assert result.metrics["num_groups_trainable"] == 2 and result.metrics["data_parallel_workers"] == 2
            await model.log(groups, split="train", metrics=result.metrics, step=result.step)
        assert model.get_inference_name() == "agent@2" and await backend.get_step(model) == 2
        async with httpx.AsyncClient(timeout=120) as client:
            for url in replicas.urls:  # each replica directly, not through the router
                answer = await client.post(url + "/v1/chat/completions",
                                           headers={"authorization": f"Bearer {replicas.api_key}"},
                                           json={"model": "agent@2", "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "w5"}]})
                assert answer.status_code == 200, answer.text
        checkpoints = tmp_path / "trainer-node" / "ray" / "models" / "agent" / "checkpoints"
        assert sorted(p.name for p in checkpoints.iterdir()) == ["0000", "0001", "0002"]  # the trainer node's layout
        assert [row["step"] for row in model.history()] == [1, 2]  # history here, as with RemoteBackend
        with pytest.raises(TypeError):
            await backend.train(model, groups, learning_rat=1e-3)  # the trainer's own error, raised as it is
    finally:
        await backend.close()
