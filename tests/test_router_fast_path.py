"""The router's lean path: whole JSON answers relayed as one body, the group header spares the body
a parse, a whole answer cut mid-body is a 502 naming the replica, and the client's pool
(``tracerl.net.http_pool.AiohttpTransport``, or ``ShardedTransport`` without aiohttp) keeps its
connections alive across turns.

Faults are real: the scripted replica drops its connection mid-body (``Reply(drop=True)``).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from capture_fake_server import Reply
from router_replicas import ReplicaServer

import tracerl
from tracerl.cluster import GROUP_HEADER, REPLICA_HEADER, Router
import tracerl.net.http_pool
from tracerl.net.http_pool import AiohttpTransport, ShardedTransport


@pytest.fixture()
def replicas():
    servers = [ReplicaServer().start() for _ in range(2)]
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture(params=["h11", "httptools"])
async def router(request, replicas):
    if request.param == "httptools":
        pytest.importorskip("httptools")
    router = Router([r.url for r in replicas], health_interval_s=60.0, http=request.param)
    await router.start()
    yield router
    await router.stop()


async def test_a_whole_answer_is_relayed_with_its_length_and_a_bad_body_still_gets_a_clear_400(router):
    async with httpx.AsyncClient(timeout=30) as client:
        answer = await client.post(router.base_url + "/chat/completions", headers={GROUP_HEADER: "g"},
                                   json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
        assert int(answer.headers["content-length"]) == len(answer.content)  # one body, not a chunked stream
        assert answer.headers.get("transfer-encoding") is None and answer.headers[REPLICA_HEADER]
        broken = await client.post(router.base_url + "/chat/completions", content=b"{not json")
        assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]["message"]


async def test_a_whole_answer_cut_mid_body_is_a_502_naming_the_replica_and_marks_it(router, replicas):
    for server in replicas:
        server.script = lambda body: Reply(content="long answer " * 50, drop=True)
    async with httpx.AsyncClient(timeout=30) as client:
        answer = await client.post(router.base_url + "/chat/completions", headers={GROUP_HEADER: "g"},
                                   json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        state = (await client.get(router.base_url.removesuffix("/v1") + "/router/replicas")).json()["replicas"]
    assert answer.status_code == 502 and answer.json()["error"]["type"] == "InferenceServerError"
    cut = [r for r in state if r["last_error"] and "dropped mid-answer" in r["last_error"]]
    assert len(cut) == 1 and cut[0]["healthy"] is False and cut[0]["url"] in answer.json()["error"]["message"]


@pytest.mark.parametrize("kind", ["aiohttp", "sharded"])
async def test_the_model_client_keeps_its_connections_across_turns(router, kind, monkeypatch):
    if kind == "sharded":  # the transport without aiohttp installed
        monkeypatch.setattr(tracerl.net.http_pool, "openai_transport", lambda http: ShardedTransport(http=http))
    model = tracerl.Model("agent", "fast-path", inference_base_url=router.base_url, inference_api_key="k")
    client = model.openai_client()
    transport = client._client._transport
    assert isinstance(transport, AiohttpTransport if kind == "aiohttp" else ShardedTransport)

    async def rollout(i: int) -> tracerl.Trajectory:
        messages = [{"role": "user", "content": f"task {i}"}]
        for _ in range(3):
            completion = await client.chat.completions.create(model="m", messages=messages)
            messages += [completion.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
        return tracerl.Trajectory(messages_and_choices=messages, reward=1.0)

    groups = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(rollout(i) for i in range(16)) for _ in range(2)], pbar_desc=None)
    assert sum(len(g.trajectories) for g in groups) == 32
    if kind == "aiohttp":  # every connection is back in the pool, idle and open
        idle = [c for conns in transport._sessions[asyncio.get_running_loop()].connector._conns.values() for c, _ in conns]
        assert 0 < len(idle) < 32 * 3 and all(c.is_connected() for c in idle)
        return
    connections = [c for shard in transport.shards for c in shard._pool.connections]
    assert 0 < len(connections) < 32 * 3  # fewer connections than calls: kept alive across turns ...
    assert not any(c.is_closed() for c in connections)  # ... and none closed by a keep-alive limit


def test_shards_split_the_connection_limit():
    transport = ShardedTransport(max_connections=100, shards=4)
    assert [shard._pool._max_connections for shard in transport.shards] == [25] * 4
    assert all(shard._pool._max_keepalive_connections == 25 for shard in transport.shards)
    with pytest.raises(ValueError):
        ShardedTransport(max_connections=2, shards=4)


async def test_the_router_keeps_idle_connections_longer_than_httpx_expires_them(router):
    # httpx closes its idle connections after 5 s; a server closing at the same moment cuts requests
    assert router._http._server.config.timeout_keep_alive == tracerl.cluster.router.KEEP_ALIVE_S > httpx.Limits().keepalive_expiry


def test_shards_share_one_tls_context():
    transport = ShardedTransport(shards=4)
    assert len({id(shard._pool._ssl_context) for shard in transport.shards}) == 1
