"""The router over N inference replicas: policy (pure) and behaviour over real loopback HTTP.

Replicas are the scripted OpenAI server with ``/health`` and adapter routes
(``router_replicas.ReplicaServer``); faults are real: a stopped replica refuses connections, a
scripted one answers 503, hangs, or drops its answer mid-stream.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from capture_fake_server import Reply
from router_replicas import ReplicaServer

import tracerl
from tracerl.cluster import GROUP_HEADER, REPLICA_HEADER, ReplicaPool, Router, group_key
from tracerl.errors import InferenceServerError, NoHealthyReplicaError


# -- policy -------------------------------------------------------------------------------------
def test_least_loaded_replica_is_chosen():
    pool = ReplicaPool(["http://a", "http://b/v1", "http://c/"])
    picked = [pool.acquire(None).url for _ in range(6)]
    assert sorted(picked) == ["http://a", "http://a", "http://b", "http://b", "http://c", "http://c"]
    pool.release(pool.replica("http://b"))
    assert pool.acquire(None).url == "http://b"


def test_a_group_stays_on_its_replica_until_it_is_far_busier_than_the_idlest():
    pool = ReplicaPool(["http://a", "http://b"], max_imbalance=2)
    first = pool.acquire("g1")
    assert all(pool.acquire("g1") is first for _ in range(2))  # in flight 3 vs 0: imbalance 3 > 2 next
    other = pool.acquire("g1")
    assert other is not first  # spilled to the idlest for this request ...
    pool.release(first), pool.release(first)
    assert pool.acquire("g1") is first  # ... but the group is still bound where it started


def test_unhealthy_replicas_are_skipped_and_none_left_is_a_typed_error():
    pool = ReplicaPool(["http://a", "http://b"])
    a = pool.acquire("g")
    pool.release(a, error="ConnectError: refused")
    assert pool.acquire("g").url == "http://b"  # the group moves to a healthy replica
    pool.mark(pool.replica("http://b"), healthy=False, error="health check answered 500")
    with pytest.raises(NoHealthyReplicaError) as caught:
        pool.acquire("g")
    assert caught.value.replicas == {
        "http://a": "unhealthy (ConnectError: refused)",
        "http://b": "unhealthy (health check answered 500)",
    }
    assert isinstance(caught.value, tracerl.InfrastructureError)  # recorded as an exception, never trained on


def test_the_affinity_table_is_bounded():
    pool = ReplicaPool(["http://a", "http://b"], max_groups=3)
    for i in range(10):
        pool.release(pool.acquire(f"g{i}"))
    assert sum(len(r.groups) for r in pool.replicas) == 3


def test_group_key_header_then_user_then_the_shared_prompt():
    system = {"role": "system", "content": "you add"}
    turn1 = {"model": "m", "messages": [system, {"role": "user", "content": "1+2"}]}
    turn2 = {"model": "m", "messages": [*turn1["messages"], {"role": "assistant", "content": "3"}, {"role": "user", "content": "sure?"}]}
    other = {"model": "m", "messages": [system, {"role": "user", "content": "5+5"}]}
    assert group_key({GROUP_HEADER: "abc"}, turn1) == "group:abc"
    assert group_key({}, {**turn1, "user": "u1"}) == "user:u1"
    assert group_key({}, turn1) == group_key({}, turn2) != group_key({}, other)  # a rollout's turns stay together
    assert group_key({}, None) is None


# -- over HTTP ----------------------------------------------------------------------------------
@pytest.fixture()
def replicas():
    servers = [ReplicaServer(delay_s=0.05).start() for _ in range(3)]
    yield servers
    for server in servers:
        server.stop()


async def _started(urls, **options) -> Router:
    router = Router(urls, health_interval_s=options.pop("health_interval_s", 60.0), **options)
    await router.start()
    return router


async def _replica_state(router: Router) -> dict[str, dict]:
    async with httpx.AsyncClient() as client:
        answer = await client.get(router.base_url.removesuffix("/v1") + "/router/replicas")
    return {r["url"]: r for r in answer.json()["replicas"]}


async def test_gathered_groups_each_stay_on_one_replica_and_spread_over_all(replicas):
    router = await _started([r.url for r in replicas])
    model = tracerl.Model("agent", "router-tests", inference_base_url=router.base_url, inference_api_key="k")

    async def rollout(task: str) -> tracerl.Trajectory:
        messages = [{"role": "user", "content": task}]
        client = model.openai_client()
        for _ in range(2):  # two turns
            completion = await client.chat.completions.create(model="m", messages=messages)
            messages += [completion.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        return tracerl.Trajectory(messages_and_choices=messages, reward=1.0)

    try:
        groups = await tracerl.gather_trajectory_groups(
            (tracerl.TrajectoryGroup(rollout(f"task {g}") for _ in range(4)) for g in range(6)), pbar_desc=None)
    finally:
        await router.stop()
    assert sum(len(g.trajectories) for g in groups) == 24
    where: dict[str, set[int]] = {}
    for index, server in enumerate(replicas):
        for group in server.groups:
            assert group is not None  # Model.openai_client() named the group
            where.setdefault(group, set()).add(index)
    assert len(where) == 6 and all(len(holders) == 1 for holders in where.values())  # 8 calls each, one replica
    assert all(server.groups for server in replicas)  # and the groups spread over every replica


async def test_streaming_passes_through_and_names_the_replica(replicas):
    router = await _started([r.url for r in replicas])
    try:
        async with httpx.AsyncClient() as client:
            async with client.stream("POST", router.base_url + "/chat/completions",
                                     json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}) as answer:
                assert answer.headers["content-type"].startswith("text/event-stream")
                assert answer.headers[REPLICA_HEADER] in {r.url for r in replicas}
                events = [line async for line in answer.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) > 2
        stream = await openai.AsyncOpenAI(base_url=router.base_url, api_key="k", max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "streamed"}], stream=True)
        assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == "answer: streamed"
        assert all(r["in_flight"] == 0 for r in (await _replica_state(router)).values())  # released after the stream
    finally:
        await router.stop()


async def test_a_dead_replica_is_skipped_and_comes_back_after_a_health_check(replicas):
    dead = replicas[0]
    dead.stop()
    router = await _started([r.url for r in replicas], health_interval_s=0.05)
    client = openai.AsyncOpenAI(base_url=router.base_url, api_key="k", max_retries=0)
    try:
        for i in range(6):
            completion = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q{i}"}])
            assert completion.choices[0].message.content == f"answer: q{i}"
        state = await _replica_state(router)
        assert state[dead.url]["healthy"] is False and state[dead.url]["failures"] >= 1
        dead.start()  # the same port again
        deadline = time.monotonic() + 30
        while not (await _replica_state(router))[dead.url]["healthy"]:
            assert time.monotonic() < deadline, "the restarted replica never passed a health check"
            await asyncio.sleep(0.05)
        for i in range(6):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"again {i}"}])
        assert dead.requests  # it serves again
    finally:
        await router.stop()


async def test_a_replica_answering_503_is_retried_elsewhere_and_marked(replicas):
    failing = replicas[1]
    failing.script = lambda body: Reply(status=503)
    router = await _started([r.url for r in replicas])
    client = openai.AsyncOpenAI(base_url=router.base_url, api_key="k", max_retries=0)
    try:
        for i in range(6):
            completion = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q{i}"}])
            assert completion.choices[0].message.content == f"answer: q{i}"
        state = (await _replica_state(router))[failing.url]
        assert state["healthy"] is False and state["last_error"] == "answered 503"
        assert len(failing.requests) == 1  # tried once, then skipped
    finally:
        await router.stop()


async def test_no_healthy_replica_left_is_a_503_naming_each(replicas):
    for server in replicas:
        server.stop()
    router = await _started([r.url for r in replicas], max_attempts=3)
    try:
        async with httpx.AsyncClient() as client:
            answer = await client.post(router.base_url + "/chat/completions", json={"model": "m", "messages": []})
            assert answer.status_code == 503
            error = answer.json()["error"]
            assert error["type"] == "NoHealthyReplicaError"
            assert all(r.url in error["message"] for r in replicas) and "cannot connect" in error["message"]
            assert (await client.get(router.base_url.removesuffix("/v1") + "/health")).status_code == 503
        assert not await router.health()
    finally:
        await router.stop()


async def test_a_hung_replica_times_out_with_a_typed_504(replicas):
    for server in replicas:
        server.script = lambda body: Reply(hang=True)
    router = await _started([replicas[0].url], request_timeout=0.5)
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            answer = await client.post(router.base_url + "/chat/completions",
                                       json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert answer.status_code == 504 and answer.json()["error"]["type"] == "InferenceTimeoutError"
        assert "request_timeout" in answer.json()["error"]["message"]
    finally:
        await router.stop()


async def test_a_stream_dropped_mid_answer_reaches_the_client_and_marks_the_replica(replicas):
    replicas[0].script = lambda body: Reply(content="long answer " * 20, drop=True)
    router = await _started([replicas[0].url, replicas[1].url])
    client = openai.AsyncOpenAI(base_url=router.base_url, api_key="k", max_retries=0)
    try:
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], stream=True, extra_headers={GROUP_HEADER: "pin"})
            async for _ in stream:
                pass
        state = await _replica_state(router)
        dropped = [url for url, s in state.items() if s["last_error"] and "dropped mid-answer" in s["last_error"]]
        assert dropped == [replicas[0].url] and state[replicas[0].url]["healthy"] is False  # the idlest, first listed
    finally:
        await router.stop()


async def test_adapters_are_loaded_on_every_replica_and_a_failure_names_the_replica(replicas):
    router = await _started([r.url for r in replicas])
    try:
        await router.load_adapter("agent@1", "/ckpt/0001")
        assert all(s.loaded == [{"lora_name": "agent@1", "lora_path": "/ckpt/0001", "load_inplace": True}] for s in replicas)
        replicas[2].load_status = 500
        with pytest.raises(InferenceServerError, match=replicas[2].url):
            await router.load_adapter("agent@2", "/ckpt/0002")
    finally:
        await router.stop()

