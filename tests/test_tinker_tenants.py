"""The Tinker service under several tenants, with small limits: the sampler's adapter caps and their
reloads, unnamed saves dropped, every table bounded per tenant (429 + ``Retry-After``), the
per-request limits (400), the fair sampling admission, and tenant isolation against id guessing,
``tinker://`` paths naming another's run, ``..`` and URL-encoded separators.

One server for the module, in this process (``tracerl serve``'s app with the Tinker service, the
real model), driven over HTTP by the official ``tinker`` SDK and, where the SDK cannot aim, by a
raw HTTP client.  Each test uses tenants of its own, so one test's tables do not touch another's."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types
from tinker_loopback import tinker_on_loopback

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
TENANTS = ("alice", "bob", "carol", "dave", "erin", "frank", "gina", "hana")
KEYS = {f"tml-tenants-test-{name:0>8}": name for name in TENANTS}
KEY = {name: key for key, name in KEYS.items()}
PROMPT = [1, 2, 3, 4, 5]


@dataclass
class Server:
    url: str
    service: Any  # TinkerService
    loop: asyncio.AbstractEventLoop

    def post(self, tenant: str, route: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.url}/api/v1/{route}", json=body, headers={"X-API-Key": KEY[tenant]}, timeout=60)

    def get(self, tenant: str, route: str) -> httpx.Response:
        return httpx.get(f"{self.url}/api/v1/{route}", headers={"X-API-Key": KEY[tenant]}, timeout=60)

    def create_session(self, tenant: str) -> httpx.Response:
        return self.post(tenant, "create_session", {"tags": [], "user_metadata": None, "sdk_version": "test", "type": "create_session"})

    def stats(self, tenant: str) -> dict[str, Any]:
        answer = self.get(tenant, "tracerl/stats")
        assert answer.status_code == 200, answer.text
        return answer.json()

    def until(self, check: Any, what: str, deadline_s: float = 60.0) -> None:
        end = time.monotonic() + deadline_s
        while not check():
            assert time.monotonic() < end, f"never happened: {what}"
            time.sleep(0.05)

    def sample(self, tenant: str, sampling_id: str, seq: int, max_tokens: int = 1, n: int = 1) -> httpx.Response:
        return self.post(tenant, "asample", {
            "sampling_session_id": sampling_id, "seq_id": seq, "num_samples": n, "prompt": {"chunks": [{"tokens": PROMPT, "type": "encoded_text"}]},
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0}, "type": "sample",
        })  # fmt: skip

    def finished(self, request_id: str) -> float | None:
        result = self.service.results.get(request_id)
        return None if result is None else result.finished


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tracerl.tinker.service import Limits

    limits = Limits(
        max_sampler_adapters=2, max_sampler_adapters_per_tenant=1, max_results_per_tenant=16, result_grace_s=1.0, result_ttl_s=600.0,
        max_sessions_per_tenant=3, session_idle_s=600.0, max_sampling_sessions_per_tenant=5, sampling_session_idle_s=600.0,
        max_num_samples=4, max_prompt_tokens=64, max_sample_tokens=16, sample_slots=1, max_samples_pending_per_tenant=6,
    )  # fmt: skip
    with tinker_on_loopback(tmp_path_factory.mktemp("tenants"), "tinker-tenants", keys=KEYS, limits=limits, max_models=8) as running:
        yield Server(*running)


@pytest.fixture(scope="module")
def clients(server):
    """One SDK ServiceClient (one session) per tenant, made when first asked for."""
    made: dict[str, Any] = {}

    def client(tenant: str) -> Any:
        if tenant not in made:
            made[tenant] = tinker.ServiceClient(base_url=server.url, api_key=KEY[tenant])
        return made[tenant]

    return client


GREEDY = types.SamplingParams(max_tokens=4, temperature=0.0)


def test_sampler_adapters_stay_under_their_caps_reload_on_demand_and_unnamed_saves_are_dropped(server, clients):
    """Caps 1 per tenant, 2 in all: alice's two saves and bob's one take turns in the engine; an evicted
    adapter answers again (the same greedy tokens); an unnamed save superseded is unloaded, its folder
    deleted and its sampling client refused; the newest goes when its session finishes."""
    engine = server.service.sampler.engine
    alice = tinker.ServiceClient(base_url=server.url, api_key=KEY["alice"])  # its own session: finished below
    alice_train = alice.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    bob_train = clients("bob").create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    prompt = types.ModelInput.from_ints(PROMPT)
    step = [types.Datum(model_input=types.ModelInput.from_ints(PROMPT), loss_fn_inputs={"target_tokens": PROMPT[1:] + [6], "weights": [1.0] * 5})]
    alice_train.forward_backward(step, "cross_entropy").result()
    alice_train.optim_step(types.AdamParams(learning_rate=5e-2)).result()  # a1 is not the base model
    first = alice.create_sampling_client(model_path=alice_train.save_weights_for_sampler("a1").result().path).result()
    second = alice.create_sampling_client(model_path=alice_train.save_weights_for_sampler("a2").result().path).result()
    bobs = clients("bob").create_sampling_client(model_path=bob_train.save_weights_for_sampler("b1").result().path).result()
    most = 0
    answers = []
    for sampler in (first, second, bobs, first, bobs, second, first):
        answers.append(sampler.sample(prompt, num_samples=1, sampling_params=GREEDY).result().sequences[0].tokens)
        most = max(most, len(engine.adapter_names))
    assert answers[0] == answers[3] == answers[6]  # a1, evicted twice, loaded again from its folder
    stats = server.stats("alice")
    assert most <= 2 and stats["service"]["sampler_adapters_peak"] <= 2
    assert stats["service"]["sampler_adapters_loaded"] == stats["service"]["sampler_adapters_in_engine"] == len(engine.adapter_names)
    assert stats["tenant"]["sampler_adapters_loaded"] <= 1
    assert stats["service"]["sampler_adapter_evictions"] >= 4

    folder = server.service.root / alice_train.model_id / "sampler_weights"
    unnamed = []
    for _ in range(3):  # what save_weights_and_get_sampling_client does every RL iteration
        unnamed.append(alice_train.save_weights_and_get_sampling_client().result())
        unnamed[-1].sample(prompt, num_samples=1, sampling_params=GREEDY).result()
    server.until(lambda: len([f for f in folder.iterdir() if f.name.startswith("ephemeral")]) == 1, "the superseded saves deleted")
    assert sorted(f.name for f in folder.iterdir() if not f.name.startswith("ephemeral")) == ["a1", "a2"]
    assert sum("ephemeral" in name for name in engine.adapter_names) <= 1
    with pytest.raises(tinker.NotFoundError, match="ended"):
        unnamed[0].sample(prompt, num_samples=1, sampling_params=GREEDY).result()
    assert unnamed[-1].sample(prompt, num_samples=1, sampling_params=GREEDY).result().sequences
    session_id = alice_train.model_id.split(":")[0]
    assert server.post("alice", f"sessions/{session_id}/finish", {}).status_code == 200
    server.until(lambda: not any(f.name.startswith("ephemeral") for f in folder.iterdir()), "the last unnamed save deleted with its session")
    assert not any("ephemeral" in name for name in engine.adapter_names)
    assert len(engine.adapter_names) <= 2


def test_per_request_limits_answer_400_and_the_sdk_waits_out_a_quotas_429(server, clients):
    sampler = clients("carol").create_sampling_client(base_model=BASE).result()
    prompt = types.ModelInput.from_ints(PROMPT)
    with pytest.raises(tinker.BadRequestError, match="num_samples=5"):
        sampler.sample(prompt, num_samples=5, sampling_params=GREEDY).result()
    with pytest.raises(tinker.BadRequestError, match="max_prompt_tokens"):
        sampler.sample(types.ModelInput.from_ints([7] * 65), num_samples=1, sampling_params=GREEDY).result()
    with pytest.raises(tinker.BadRequestError, match="max_sample_tokens"):
        sampler.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=17)).result()
    with pytest.raises(tinker.BadRequestError, match="max_prompt_tokens"):
        sampler.compute_logprobs(types.ModelInput.from_ints([7] * 65)).result()
    assert len(sampler.compute_logprobs(prompt).result()) == len(PROMPT)  # within the limits: answered
    # 6 requests at most running or waiting: the SDK is answered 429 for the others, waits and resubmits
    refused = server.stats("carol")["tenant"]["refused_429"]
    futures = [sampler.sample(prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=8, temperature=0.0)) for _ in range(9)]
    assert all(len(future.result().sequences) == 2 for future in futures)
    assert server.stats("carol")["tenant"]["refused_429"] > refused


def test_full_tables_answer_429_with_retry_after_and_never_evict_another_tenants_futures(server):
    """dave fills his sessions, sampling sessions and futures; erin's pending future survives it and she
    is served as before; dave's answered futures are pruned after the grace period, then he goes on."""
    sessions = [server.create_session("dave") for _ in range(3)]
    assert all(answer.status_code == 200 for answer in sessions)
    full = server.create_session("dave")
    assert full.status_code == 429 and 1 <= int(full.headers["retry-after"]) <= 60, full.text
    session = sessions[0].json()["session_id"]
    samplers = [server.post("dave", "create_sampling_session", {"session_id": session, "sampling_session_seq_id": i, "base_model": BASE}) for i in range(5)]
    assert all(answer.status_code == 200 for answer in samplers)
    over = server.post("dave", "create_sampling_session", {"session_id": session, "sampling_session_seq_id": 5, "base_model": BASE})
    assert over.status_code == 429 and "retry-after" in over.headers, over.text
    sampling_id = samplers[0].json()["sampling_session_id"]

    erin_session = server.create_session("erin").json()["session_id"]
    erin_sampler = server.post("erin", "create_sampling_session", {"session_id": erin_session, "sampling_session_seq_id": 0, "base_model": BASE}).json()["sampling_session_id"]
    erin_first = server.sample("erin", erin_sampler, 0, max_tokens=16).json()["request_id"]

    accepted = []
    for seq in range(16):  # dave's futures, finished and not polled: his table is full
        answer = server.sample("dave", sampling_id, seq)
        assert answer.status_code == 200, answer.text
        accepted.append(answer.json()["request_id"])
        server.until(lambda: server.finished(accepted[-1]) is not None, "dave's sample finished")
    refused = server.sample("dave", sampling_id, 100)
    assert refused.status_code == 429 and "futures" in refused.json()["detail"] and 1 <= int(refused.headers["retry-after"]) <= 60
    assert server.sample("dave", sampling_id, 0).json()["request_id"] == accepted[0]  # a retry is not a new future

    erin_poll = server.post("erin", "retrieve_future", {"request_id": erin_first})
    assert erin_poll.status_code == 200 and "try_again" not in erin_poll.text  # not evicted by dave's flood
    assert server.sample("erin", erin_sampler, 1).status_code == 200

    for request_id in accepted:  # answered: pruned after the grace period
        assert server.post("dave", "retrieve_future", {"request_id": request_id}).status_code == 200
    server.until(lambda: server.sample("dave", sampling_id, 101).status_code == 200, "a new future accepted once the answered ones are pruned")
    server.until(lambda: server.post("dave", "retrieve_future", {"request_id": accepted[0]}).status_code == 404, "an answered future forgotten")
    assert server.post("dave", f"sessions/{sessions[1].json()['session_id']}/finish", {}).status_code == 200
    server.until(lambda: server.create_session("dave").status_code == 200, "a finished session pruned")


def test_sampling_is_admitted_fairly_a_burst_delays_its_own_tenant(server):
    """frank queues 6 requests of 4 rows; gina's one, sent after them, finishes after at most one of frank's
    (by order, from the service's own finish times: one slot, and the tenant holding it goes last)."""
    ids = {}
    for tenant in ("frank", "gina"):
        session = server.create_session(tenant).json()["session_id"]
        ids[tenant] = server.post(tenant, "create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0, "base_model": BASE}).json()["sampling_session_id"]
    franks = [server.sample("frank", ids["frank"], seq, max_tokens=8, n=4).json()["request_id"] for seq in range(6)]
    ginas = server.sample("gina", ids["gina"], 0, max_tokens=8).json()["request_id"]
    server.until(lambda: all(server.finished(r) for r in [*franks, ginas]), "every sample finished")
    before = [r for r in franks if server.finished(r) < server.finished(ginas)]
    assert len(before) <= 1, f"{len(before)} of frank's 6 finished before gina's one"


def test_weights_asked_for_on_v1_stay_loaded_until_answered(server, clients):
    """hana's /v1 request for her weights ``h1`` waits in the paused sampler; her Tinker sample of ``h2``
    then needs her one adapter slot.  It waits for the /v1 answer instead of unloading ``h1`` under it
    (which answered the /v1 request "adapter not loaded"), and both are answered."""
    engine = server.service.sampler.engine
    train = clients("hana").create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    train.save_weights_for_sampler("h1").result()
    h2 = clients("hana").create_sampling_client(model_path=train.save_weights_for_sampler("h2").result().path).result()
    v1 = {"model": "h1", "prompt": "Hello", "max_tokens": 2, "temperature": 0.0}
    assert httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY['hana']}"}, json=v1, timeout=60).status_code == 200
    waiting = engine.jobs_waiting
    engine.pause()
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            asked = pool.submit(httpx.post, f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY['hana']}"}, json=v1, timeout=60)
            server.until(lambda: engine.jobs_waiting > waiting, "the /v1 request waiting in the paused sampler")
            sampled = pool.submit(lambda: h2.sample(types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=GREEDY).result())
            time.sleep(1.0)  # h2's load has started: it evicts h1 now unless the /v1 request holds it
            engine.resume()
            answer = asked.result(60)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] is not None
            assert sampled.result(60).sequences
    finally:
        engine.resume()
    assert server.stats("hana")["tenant"]["sampler_adapters_loaded"] <= 1


def test_a_tenant_cannot_reach_or_learn_another_tenants_objects(server, clients):
    """bob against alice's run, checkpoints, sampler weights, sampling session and future: by id,
    by ``tinker://`` path, by ``..`` and by URL-encoded separators; each is answered as if it did not
    exist (404, the same words as an unknown id) or refused as malformed (400), and nothing of alice's changes."""
    alice = clients("alice").create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    state = alice.save_state("mine").result().path
    sampler_path = alice.save_weights_for_sampler("mine").result().path
    alice_session = server.create_session("alice").json()["session_id"]
    sampling_id = server.post("alice", "create_sampling_session", {"session_id": alice_session, "sampling_session_seq_id": 0, "model_path": sampler_path}).json()["sampling_session_id"]
    request_id = server.sample("alice", sampling_id, 0).json()["request_id"]
    bob_train = clients("bob").create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    run, bob_run = alice.model_id, bob_train.model_id
    unknown = f"s{'0' * 16}:train:0"
    alice_folder = server.service.root / run / "sampler_weights" / "mine"

    def same_as_unknown(answer: httpx.Response, unknown_answer: httpx.Response, real: str, fake: str) -> None:
        assert answer.status_code == unknown_answer.status_code == 404, (answer.text, unknown_answer.text)
        assert answer.json()["detail"].replace(real, fake) == unknown_answer.json()["detail"]

    # by id: the run, its checkpoints, the run's routes
    same_as_unknown(server.get("bob", f"training_runs/{run}"), server.get("bob", f"training_runs/{unknown}"), run, unknown)
    same_as_unknown(server.get("bob", f"training_runs/{run}/checkpoints"), server.get("bob", f"training_runs/{unknown}/checkpoints"), run, unknown)
    for route, body in {
        "get_info": {"model_id": run, "type": "get_info"},
        "optim_step": {"model_id": run, "seq_id": 99, "adam_params": {"learning_rate": 1.0}, "type": "optim_step"},
        "save_weights_for_sampler": {"model_id": run, "seq_id": 99, "path": "stolen", "type": "save_weights_for_sampler"},
    }.items():
        same_as_unknown(server.post("bob", route, body), server.post("bob", route, {**body, "model_id": unknown}), run, unknown)
    assert run not in server.get("bob", "training_runs").text
    # the future and the sampling session
    fake = "r" + "0" * 32
    same_as_unknown(server.post("bob", "retrieve_future", {"request_id": request_id}), server.post("bob", "retrieve_future", {"request_id": fake}), request_id, fake)
    fake = f"{unknown.split(':')[0]}:sample:0"
    same_as_unknown(server.get("bob", f"samplers/{sampling_id}"), server.get("bob", f"samplers/{fake}"), sampling_id, fake)
    same_as_unknown(server.sample("bob", sampling_id, 1), server.sample("bob", fake, 1), sampling_id, fake)
    # tinker:// paths naming alice's run
    with pytest.raises(tinker.NotFoundError):
        clients("bob").create_sampling_client(model_path=sampler_path).result()
    with pytest.raises(tinker.NotFoundError):
        clients("bob").create_training_client_from_state(state).result()
    with pytest.raises(tinker.RequestFailedError, match="unknown training run"):  # failed in its place: bob's run goes on
        bob_train.load_state(state).result()
    rest = tinker.RestClient(base_url=server.url, api_key=KEY["bob"])
    with pytest.raises(tinker.NotFoundError):
        rest.delete_checkpoint_from_tinker_path(state).result()
    # '..' inside a tinker:// path, and URL-encoded separators in the routes
    bob_session = bob_run.split(":")[0]
    for tricky in (
        f"tinker://{bob_run}/sampler_weights/../../{run}/sampler_weights/mine",
        f"tinker://{bob_run}/sampler_weights/..",
        f"tinker://../{run}/sampler_weights/mine",
        f"tinker://{bob_run}/sampler_weights/%2e%2e",
    ):
        answer = server.post("bob", "create_sampling_session", {"session_id": bob_session, "sampling_session_seq_id": 77, "model_path": tricky})
        assert answer.status_code in (400, 404), (tricky, answer.text)
    bob_train.save_weights_for_sampler("own").result()
    bob_folder = server.service.root / bob_run
    for path in (
        f"training_runs/{bob_run}/checkpoints/sampler_weights/%2e%2e",
        f"training_runs/{bob_run}/checkpoints/sampler_weights%2F%2e%2e%2F%2e%2e%2F{run}%2Fsampler_weights%2Fmine",
        f"training_runs/{bob_run}/checkpoints/sampler_weights/..%2F..%2F{run}%2Fsampler_weights%2Fmine",
        f"training_runs/%2e%2e/checkpoints/{run}%2Fsampler_weights%2Fmine",
        f"training_runs/{run.replace(':', '%3A')}/checkpoints/sampler_weights%2Fmine",
    ):
        answer = httpx.delete(f"{server.url}/api/v1/{path}", headers={"X-API-Key": KEY["bob"]}, timeout=30)
        assert answer.status_code in (400, 404), (path, answer.text)
    assert alice_folder.is_dir() and (bob_folder / "sampler_weights" / "own").is_dir() and (bob_folder / "run.json").exists()
    assert server.get("bob", "training_runs/%2e%2e/checkpoints").status_code == 404
    # the OpenAI route: alice's weights by her name or the sampler's internal one
    for name in ("mine", f"{run}@mine"):
        answer = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY['bob']}"}, timeout=60,
                            json={"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})  # fmt: skip
        assert answer.status_code == 404, (name, answer.text)
    assert "mine" not in httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY['bob']}"}, timeout=30).text
    # alice's own still work
    assert server.post("alice", "retrieve_future", {"request_id": request_id}).status_code == 200
    assert server.sample("alice", sampling_id, 1).status_code == 200
    assert {"weights/mine", "sampler_weights/mine"} <= {c.checkpoint_id for c in tinker.RestClient(base_url=server.url, api_key=KEY["alice"]).list_checkpoints(run).result().checkpoints}
