"""Inference replicas as Ray actors on a real two-node Ray cluster (loopback), behind the router.

The model is a tiny randomly initialised Llama (bench/gpu_check.py's, with a word-level
tokenizer); the adapter reaches each replica through Ray's object store, not a shared path.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")
from tracerl.cluster import REPLICA_HEADER, GROUP_HEADER  # noqa: E402
from tracerl.cluster.ray_replicas import RayReplicas  # noqa: E402


@pytest.fixture()
def cluster(ray_cluster):
    return ray_cluster  # one cluster per session (tests/conftest.py)


@pytest.fixture()
def tiny_model(tiny_llama):
    return tiny_llama


def _adapter(model_folder: Path, out: Path) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_folder),
                           LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    model.save_pretrained(out)
    return out


async def test_two_replicas_on_two_nodes_serve_and_hot_load_a_shipped_adapter(cluster, tiny_model, tmp_path):
    replicas = RayReplicas(tiny_model, replicas=2, num_cpus=1, served_name="agent",
                           server_options={"num_threads": 1})
    await replicas.start()
    try:
        nodes = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
        assert len(nodes) == 2 and len(set(replicas.urls)) == 2
        placed = set(ray.get([a.node_id.remote() for a in replicas.actors]))
        assert placed == nodes  # SPREAD: one replica per node
        adapter = _adapter(tiny_model, tmp_path / "agent-0001")
        await replicas.load_adapter("agent@1", str(adapter))
        served = set()
        async with httpx.AsyncClient(timeout=120) as client:
            for group in ("g1", "g2", "g3", "g4"):
                answer = await client.post(
                    replicas.base_url + "/chat/completions",
                    headers={GROUP_HEADER: group, "authorization": f"Bearer {replicas.api_key}"},
                    json={"model": "agent@1", "max_tokens": 3, "messages": [{"role": "user", "content": "w5 w6"}]})
                assert answer.status_code == 200, answer.text
                assert answer.json()["usage"]["completion_tokens"] == 3
                served.add(answer.headers[REPLICA_HEADER])
            unauthorised = await client.post(replicas.base_url + "/chat/completions",
                                             json={"model": "agent@1", "messages": [{"role": "user", "content": "w5"}]})
            assert unauthorised.status_code == 401  # the router passes the replicas' key check through
        assert served == {url for url in replicas.urls}  # groups spread; both replicas serve name@1
        assert await replicas.health()
    finally:
        await replicas.stop()
