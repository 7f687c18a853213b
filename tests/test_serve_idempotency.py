"""``train`` through ``tracerl serve`` is idempotent (issue 9, item 5): a client whose call timed out
retries with the same request id and gets the first call's result; the server trains once.

Real uvicorn and HTTP on loopback; the backend is test_remote_backend's recording stand-in whose
``train`` is held at a gate, so the client's first attempt really times out while the step runs.
"""

from __future__ import annotations

import asyncio
import threading
import uuid

import httpx
import pytest
from test_remote_backend import RecordingBackend, _group, _model, upstream  # noqa: F401 - upstream is a fixture

import tracerl
from tracerl.net.http_server import BackgroundUvicorn
from tracerl.serve.remote_backend import dumps_body, encode_groups
from tracerl.serve.server import create_app
from tracerl.serve.idempotency import TrainResults

TRAIN = "/tracerl/v1/models/remote-tests/agent/train"


class GatedBackend(RecordingBackend):
    """``train`` waits for ``gate`` (set by the test) before it trains."""

    def __init__(self, upstream: str | None) -> None:
        super().__init__(upstream)
        self.gate = threading.Event()
        self.started = 0

    async def train(self, model, trajectory_groups, **kwargs):  # type: ignore[override]
        self.started += 1
        await asyncio.to_thread(self.gate.wait, 120)
        return await super().train(model, trajectory_groups, **kwargs)


@pytest.fixture()
def gated(upstream):  # noqa: F811
    backend = GatedBackend(upstream.base_url)
    app = create_app(backend)
    http = BackgroundUvicorn(app, name="tracerl-serve-idempotency")
    url = f"http://127.0.0.1:{http.start()}"
    yield backend, app.state.tracerl, url
    backend.gate.set()
    http.stop()


async def _until(condition, what: str) -> None:
    for _ in range(3000):
        if condition():
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"never happened: {what}")


async def test_a_timed_out_train_retried_leaves_client_and_server_at_the_same_step(gated):
    backend, state, url = gated
    model = _model()
    async with tracerl.RemoteBackend(url, train_timeout=1.0, train_retries=5) as remote:
        await model.register(remote)
        call = asyncio.create_task(remote.train(model, [_group()]))
        await _until(lambda: state.results.replayed >= 1, "a retry reached the server while the first step ran")
        assert not call.done() and backend.started == 1  # the first attempt timed out; its step still runs, alone
        backend.gate.set()
        result = await call
        assert result.step == 1 and result.checkpoint_path == "/ckpt/0001"
        assert backend.started == 1 and len(backend.trained) == 1  # trained once
        assert await remote.get_step(model) == 1 == backend.steps["agent"]  # server and client agree
        assert model.get_inference_name() == "agent@1"
        second = await remote.train(model, [_group()])  # the next call has a new id: a new step
    assert second.step == 2 and len(backend.trained) == 2


async def test_same_key_replays_different_key_trains_different_body_is_refused(gated):
    backend, _, url = gated
    backend.gate.set()
    async with tracerl.RemoteBackend(url) as remote:
        await _model().register(remote)
    body = dumps_body({"groups": encode_groups([_group()]), "kwargs": {"learning_rate": 1e-4}})
    key = uuid.uuid4().hex
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        first = await client.post(TRAIN, content=body, headers={"Idempotency-Key": key})
        again = await client.post(TRAIN, content=body, headers={"Idempotency-Key": key})
        assert first.status_code == again.status_code == 200 and first.content == again.content
        assert len(backend.trained) == 1
        other = await client.post(TRAIN, content=body, headers={"Idempotency-Key": uuid.uuid4().hex})
        assert other.json()["step"] == 2
        changed = body.replace(b"0.0001", b"0.0002")
        reused = await client.post(TRAIN, content=changed, headers={"Idempotency-Key": key})
        assert reused.status_code == 400 and "different train request" in reused.json()["error"]["message"]
        unkeyed = [await client.post(TRAIN, content=body) for _ in range(2)]  # no key: each call trains
        assert [r.json()["step"] for r in unkeyed] == [3, 4]


async def test_a_failed_step_is_not_remembered(gated):
    backend, _, url = gated
    backend.gate.set()
    async with tracerl.RemoteBackend(url) as remote:
        await _model().register(remote)
    body = dumps_body({"groups": encode_groups([_group()]), "kwargs": {}})
    headers = {"Idempotency-Key": "retry-me"}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        backend.fail_with = RuntimeError("GPU on fire")
        assert (await client.post(TRAIN, content=body, headers=headers)).status_code == 500
        backend.fail_with = None
        retried = await client.post(TRAIN, content=body, headers=headers)  # nothing was trained: run it now
        assert retried.status_code == 200 and retried.json()["step"] == 1 and len(backend.trained) == 1


async def test_remembered_keys_are_bounded_per_model():
    results = TrainResults(per_model=2)
    runs = 0

    async def step() -> dict:
        nonlocal runs
        runs += 1
        return {"step": runs}

    for key in ("a", "b", "c"):
        await results.run("m", key, b"{}", step)
    assert (await results.run("m", "c", b"{}", step)) == {"step": 3} and runs == 3  # still remembered
    assert (await results.run("m", "a", b"{}", step)) == {"step": 4}  # the oldest was dropped: trains again
    with pytest.raises(tracerl.ConfigError):
        await results.run("m", "", b"{}", step)
