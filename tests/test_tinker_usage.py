"""The Tinker service's disk quota and per-tenant usage: a save that would take a tenant's checkpoints
above ``max_disk_bytes_per_tenant`` answers 429 (with ``Retry-After`` and what to do) and goes through
once checkpoints are deleted; superseded unnamed saves are deleted and do not count; checkpoints are
listed with their size and the tenant's use of its quota; tokens trained and sampled and compute
seconds per tenant on ``GET /api/v1/tracerl/usage``, in one log line per operation, and kept across
a restart (``usage.json``).

One server for the module, in this process, driven by the real ``tinker`` SDK and, where the SDK
cannot aim (a save refused with 429, which the SDK would retry for minutes), by raw HTTP."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types
from tinker_loopback import tinker_on_loopback

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
TENANTS = ("quota", "meter", "other")
KEYS = {f"tml-usage-test-key-{name:0>8}": name for name in TENANTS}
KEY = {name: key for key, name in KEYS.items()}
PROMPT = [1, 2, 3, 4, 5]


class Server:
    def __init__(self, url: str, service: Any) -> None:
        self.url, self.service = url, service

    def post(self, tenant: str, route: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.url}/api/v1/{route}", json=body, headers={"X-API-Key": KEY[tenant]}, timeout=60)

    def get(self, tenant: str, route: str) -> httpx.Response:
        return httpx.get(f"{self.url}/api/v1/{route}", headers={"X-API-Key": KEY[tenant]}, timeout=60)

    def result(self, tenant: str, answer: httpx.Response) -> dict[str, Any]:
        """The future ``answer`` names, polled until done."""
        assert answer.status_code == 200, answer.text
        request_id = answer.json()["request_id"]
        while True:
            polled = self.post(tenant, "retrieve_future", {"request_id": request_id})
            assert polled.status_code == 200, polled.text
            body = polled.json()
            if body.get("type") != "try_again":
                assert "error" not in body, body
                return body

    def until(self, check: Any, what: str, deadline_s: float = 60.0) -> None:
        end = time.monotonic() + deadline_s
        while not check():
            assert time.monotonic() < end, f"never happened: {what}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tracerl.tinker.service import Limits

    limits = Limits(max_num_samples=4, max_sample_tokens=16)
    with tinker_on_loopback(tmp_path_factory.mktemp("usage"), "tinker-usage", keys=KEYS, limits=limits, max_models=4) as (url, service, _):
        yield Server(url, service)


def test_a_save_above_the_disk_quota_answers_429_until_checkpoints_are_deleted(server):
    """Quota: 2.5 of this run's sampler checkpoints.  s1, s2 fit; s3 would not (429, Retry-After, the
    message says what to do, nothing written); unnamed saves supersede each other, so any number fit and
    only the newest stays on disk; after s1 is deleted the same s3 request goes through."""
    session = server.post("quota", "create_session", {"tags": [], "user_metadata": None, "sdk_version": "test", "type": "create_session"}).json()["session_id"]
    created = server.post("quota", "create_model", {
        "session_id": session, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 4}, "type": "create_model",
    })  # fmt: skip
    model_id = server.result("quota", created)["model_id"]
    seq = iter(range(1, 100))

    def save(name: str | None, seq_id: int | None = None, sampling_seq: int | None = None) -> httpx.Response:
        body = {"model_id": model_id, "seq_id": next(seq) if seq_id is None else seq_id, "path": name, "type": "save_weights_for_sampler"}
        if sampling_seq is not None:
            body["sampling_session_seq_id"] = sampling_seq
        return server.post("quota", "save_weights_for_sampler", body)

    server.result("quota", save("s1"))
    rest = tinker.ServiceClient(base_url=server.url, api_key=KEY["quota"]).create_rest_client()
    listed = rest.list_checkpoints(model_id).result().checkpoints
    assert [c.checkpoint_id for c in listed] == ["sampler_weights/s1"] and listed[0].size_bytes > 0
    size = listed[0].size_bytes
    server.service.limits = dataclasses.replace(server.service.limits, max_disk_bytes_per_tenant=int(2.5 * size))

    server.result("quota", save("s2"))
    server.service.limits = dataclasses.replace(server.service.limits, max_disk_bytes_per_tenant=int(3.5 * size))
    for sampling_seq in range(4):  # s1, s2 and one unnamed save: each superseded one is deleted and not counted
        server.result("quota", save(None, sampling_seq=sampling_seq))
    folder = server.service.root / model_id / "sampler_weights"
    server.until(lambda: len([f for f in folder.iterdir() if f.name.startswith("ephemeral")]) == 1, "the superseded unnamed saves deleted")
    assert sorted(f.name for f in folder.iterdir() if not f.name.startswith(("ephemeral", "."))) == ["s1", "s2"]

    server.service.limits = dataclasses.replace(server.service.limits, max_disk_bytes_per_tenant=int(2.5 * size))
    refused = save("s3", seq_id=(s3_seq := next(seq)))  # s1, s2 and the unnamed one: no room for a fourth
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["Retry-After"]) >= 1
    assert "disk quota" in refused.json()["detail"] and "delete_checkpoint" in refused.json()["detail"]
    assert sorted(f.name for f in folder.iterdir() if not f.name.startswith(("ephemeral", "."))) == ["s1", "s2"]  # nothing written

    answer = server.get("quota", f"training_runs/{model_id}/checkpoints").json()  # sizes and the tenant's use
    sizes = {c["checkpoint_id"]: c["size_bytes"] for c in answer["checkpoints"]}
    assert sizes["sampler_weights/s1"] == sizes["sampler_weights/s2"] == size and len(sizes) == 3
    assert answer["disk"]["quota_bytes"] == int(2.5 * size) and answer["disk"]["checkpoints"] == 3
    assert 3 * size <= answer["disk"]["bytes"] < 3.5 * size

    assert save("s3", seq_id=s3_seq).status_code == 429  # the SDK's retry, still above
    rest.delete_checkpoint(model_id, "sampler_weights/s1").result()
    rest.delete_checkpoint(model_id, "sampler_weights/s2").result()
    server.result("quota", save("s3", seq_id=s3_seq))  # the same request, retried, now fits
    assert sorted(f.name for f in folder.iterdir() if not f.name.startswith(("ephemeral", "."))) == ["s3"]
    stats = server.get("quota", "tracerl/stats").json()["tenant"]
    assert stats["refused_429"] == 2 and stats["disk"]["reserved_bytes"] == 0
    assert server.get("other", "tracerl/usage").json()["disk"]["bytes"] == 0  # another tenant's quota is its own


def test_usage_counts_tokens_and_seconds_per_tenant_logs_each_operation_and_survives_a_restart(server, caplog, tmp_path):
    from tracerl.tinker.usage import Usage

    caplog.set_level(logging.INFO, logger="tracerl.tinker.usage")
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY["meter"])
    train = client.create_lora_training_client(base_model=BASE, rank=4, seed=0)
    datum = types.Datum(model_input=types.ModelInput.from_ints(PROMPT), loss_fn_inputs={"target_tokens": PROMPT[1:] + [6], "weights": [1.0] * 5})
    train.forward_backward([datum, datum], "cross_entropy").result()  # 10 tokens trained
    train.forward([datum], "cross_entropy").result()  # 5 scored only
    train.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = train.save_weights_and_get_sampling_client()
    answer = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=2, sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=1)).result()
    sampled = sum(len(sequence.tokens) for sequence in answer.sequences)
    assert sampled > 0

    usage = server.get("meter", "tracerl/usage").json()
    assert usage["tenant"] == "meter"
    counted = usage["usage"]
    assert counted["tokens_trained"] == 10 and counted["tokens_forward"] == 5
    assert counted["tokens_sampled"] == sampled and counted["prompt_tokens_sampled"] == len(PROMPT)
    assert counted["train_seconds"] > 0 and counted["sample_seconds"] > 0
    assert counted["compute_seconds"] == pytest.approx(counted["train_seconds"] + counted["sample_seconds"], abs=0.002)
    assert counted["operations"] == 6  # create, forward_backward, forward, optim_step, save for sampler, sample
    assert server.get("other", "tracerl/usage").json()["usage"]["tokens_trained"] == 0  # counted per tenant
    assert server.get("meter", "tracerl/stats").json()["tenant"]["usage"]["tokens_sampled"] == sampled

    lines = [r.getMessage() for r in caplog.records if r.name == "tracerl.tinker.usage" and "tenant=meter" in r.getMessage()]
    assert any("op=forward_backward" in line and "tokens_trained=10" in line for line in lines)
    assert any("op=sample" in line and f"tokens_sampled={sampled}" in line for line in lines)
    assert len(lines) == 6

    saved = tmp_path / "usage.json"  # what the sweep and shutdown write, and start-up reads
    server.service.usage.save(saved)
    again = Usage()
    again.load(saved)
    assert again.of("meter") == server.service.usage.of("meter")


def test_usage_file_round_trip_and_a_damaged_file_counts_from_zero(tmp_path):
    from tracerl.tinker.usage import Usage

    usage = Usage()
    usage.add("a", "sample", tokens_sampled=7, sample_seconds=0.5)
    usage.add("a", "forward_backward", tokens_trained=3, train_seconds=0.25)
    usage.save(tmp_path / "usage.json")
    loaded = Usage()
    loaded.load(tmp_path / "usage.json")
    loaded.add("a", "sample", tokens_sampled=1, sample_seconds=0.5)  # a restarted server keeps counting
    assert loaded.of("a") == {
        "operations": 3, "tokens_trained": 3, "tokens_forward": 0, "tokens_sampled": 8, "prompt_tokens_sampled": 0,
        "train_seconds": 0.25, "sample_seconds": 1.0, "compute_seconds": 1.25,
    }  # fmt: skip
    (tmp_path / "bad.json").write_text("{not json")
    damaged = Usage()
    damaged.load(tmp_path / "bad.json")
    assert damaged.of("a")["operations"] == 0
