"""``tracerl serve`` + ``RemoteBackend`` over real HTTP on loopback.

The light tests serve a recording stand-in backend (no model, no torch) through the real app
and uvicorn, with the scripted OpenAI server of the capture tests behind the ``/v1`` proxy.
The ``real_model`` test starts ``tracerl serve`` as a subprocess with SmolLM2-135M and trains
one step from this process, as a laptop would.

Run with:  flock /tmp/tracerl-heavy.lock .venv/bin/python -m pytest -q tests/test_remote_backend.py
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from capture_fake_server import FakeOpenAIServer

import tracerl
import tracerl.integrations as ti
from tracerl.net.http_server import BackgroundUvicorn
from tracerl import RemoteBackendError, RemoteConnectionError
from tracerl.serve.remote_backend import decode_groups, encode_groups
from tracerl.serve.server import create_app

TOKEN = "s3cret"


class RecordingBackend:
    """Stands in for ``LocalBackend`` behind the app: records calls, serves through a fake upstream."""

    def __init__(self, upstream: str | None) -> None:
        self.path = None
        self.upstream = upstream
        self.steps: dict[str, int] = {}
        self.checkpoints: dict[str, list[int]] = {}
        self.trained: list[list[tracerl.TrajectoryGroup]] = []
        self.active = self.max_active = 0
        self.fail_with: Exception | None = None
        self.closed = False

    async def register(self, model: tracerl.TrainableModel) -> None:
        self.steps.setdefault(model.name, 0)
        self.checkpoints.setdefault(model.name, [0])
        model._step_cache = self.steps[model.name]
        model.inference_base_url = self.upstream
        model.inference_model_name = model.get_inference_name()

    async def train(self, model: Any, trajectory_groups: Any, *, learning_rate: float = 5e-6, loss_fn: str = "cispo") -> tracerl.TrainResult:
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(0.05)
            if self.fail_with is not None:
                raise self.fail_with
            self.trained.append(list(trajectory_groups))
            self.steps[model.name] += 1
            step = model._step_cache = self.steps[model.name]
            self.checkpoints[model.name].append(step)
            return tracerl.TrainResult(step=step, metrics={"lr": learning_rate, "corr": float("nan")}, checkpoint_path=f"/ckpt/{step:04d}")
        finally:
            self.active -= 1

    async def get_step(self, model: Any) -> int:
        return self.steps[model.name]

    async def list_checkpoints(self, model: Any) -> list[int]:
        return list(self.checkpoints[model.name])

    async def delete_checkpoints(self, model: Any, keep: list[int]) -> list[int]:
        steps = self.checkpoints[model.name]
        deleted = [s for s in steps[:-1] if s not in keep]  # like LocalBackend: the latest is always kept
        self.checkpoints[model.name] = [s for s in steps if s not in deleted]
        return deleted

    async def close(self) -> None:
        self.closed = True


@pytest.fixture(scope="module")
def upstream():
    ti.instrument("openai")
    with FakeOpenAIServer() as server:
        yield server


def _serve(backend: RecordingBackend, token: str | None = None) -> tuple[BackgroundUvicorn, str]:
    http = BackgroundUvicorn(create_app(backend, token=token), name="tracerl-serve-test")
    return http, f"http://127.0.0.1:{http.start()}"


@pytest.fixture()
def served(upstream):
    backend = RecordingBackend(upstream.base_url)
    http, url = _serve(backend)
    yield backend, url
    http.stop()


@pytest.fixture()
def served_with_token(upstream):
    backend = RecordingBackend(upstream.base_url)
    http, url = _serve(backend, TOKEN)
    yield backend, url
    http.stop()


def _model(name: str = "agent") -> tracerl.TrainableModel:
    return tracerl.TrainableModel(name, "remote-tests", "smollm2-135m", lora_config={"r": 4})


def _group(rewards: tuple[float, ...] = (1.0, 0.0)) -> tracerl.TrajectoryGroup:
    def trajectory(reward: float) -> tracerl.Trajectory:
        choice = tracerl.Choice(
            message={"role": "assistant", "content": f"answer {reward}"}, token_ids=[5, 6, 2], prompt_token_ids=[1, 2, 3],
            logprobs=[-0.5, -0.25, -0.1], finish_reason="stop", response_id="chatcmpl-1",
        )  # fmt: skip
        side = tracerl.History(messages_and_choices=[{"role": "user", "content": "sub"}, choice])
        return tracerl.Trajectory(
            messages_and_choices=[{"role": "user", "content": "q"}, choice], reward=reward, additional_histories=[side],
            metrics={"turns": 1}, metadata={"task": "q"},
        )  # fmt: skip

    return tracerl.TrajectoryGroup([trajectory(r) for r in rewards], exceptions=[ValueError("rollout broke")], metadata={"task": "q"})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- light: no model ------------------------------------------------------------------------------
def test_groups_round_trip_keeps_sampled_turns_as_choices():
    group = _group()
    [back] = decode_groups(json.loads(json.dumps(encode_groups([group]))))
    assert [t.to_json_dict() for t in back.trajectories] == [t.to_json_dict() for t in group.trajectories]
    for t in back.trajectories:
        assert [type(i).__name__ for i in t.messages_and_choices] == ["dict", "Choice"]
        assert isinstance(t.additional_histories[0].messages_and_choices[1], tracerl.Choice)
        assert t.sampled_turns()[0].token_ids == [5, 6, 2]
    assert back.exceptions[0].type == "ValueError" and back.exceptions[0].message == "rollout broke"
    assert back.metadata == {"task": "q"} and back.rewards == [1.0, 0.0]


def test_malformed_groups_are_a_trajectory_error():
    with pytest.raises(tracerl.TrajectoryError):
        decode_groups([{"trajectories": [{"reward": "not a number"}]}])
    with pytest.raises(tracerl.TrajectoryError):
        decode_groups({"not": "a list"})


async def test_register_train_step_and_delete_through_http(served):
    backend, url = served
    model = _model()
    remote = tracerl.RemoteBackend(url)
    await model.register(remote)
    assert model.inference_base_url == f"{url}/v1" and model.get_inference_name() == "agent@0"
    groups = [_group(), _group((0.5, 0.25))]
    result = await remote.train(model, groups, learning_rate=1e-4)
    assert (result.step, result.checkpoint_path, result.metrics["lr"]) == (1, "/ckpt/0001", 1e-4)
    assert math.isnan(result.metrics["corr"])  # NaN metrics survive the wire
    assert model.get_inference_name() == "agent@1" and await model.get_step() == 1
    [received] = backend.trained
    assert [[t.to_json_dict() for t in g.trajectories] for g in received] == [[t.to_json_dict() for t in g.trajectories] for g in groups]
    assert isinstance(received[0].trajectories[0].messages_and_choices[1], tracerl.Choice)
    await remote.train(model, [_group()])
    assert await remote.delete_checkpoints(model, keep=[0]) == [1]
    again = _model()  # a second client (or a restarted laptop) registers the same model: resumes at step 2
    await again.register(remote)
    assert again.get_inference_name() == "agent@2"
    await remote.close()


async def test_delete_checkpoints_keeps_the_last_n_and_the_best_on_the_server(served, tmp_path):
    backend, url = served
    model = tracerl.TrainableModel("pruned", "remote-tests", "smollm2-135m", base_path=tmp_path)  # client-side run dir
    async with tracerl.RemoteBackend(url) as remote:
        await model.register(remote)
        for reward in (0.9, 0.2, 0.4, 0.1):  # steps 1..4; the best val/reward is step 1's
            result = await remote.train(model, [_group()])
            await model.log([_group((reward,))], split="val", step=result.step)
        assert model.run_dir.checkpoint_steps() == [] and await remote.list_checkpoints(model) == [0, 1, 2, 3, 4]
        assert await model.delete_checkpoints("val/reward", keep_last=2) == [0, 2]
        assert await remote.list_checkpoints(model) == [1, 3, 4] == backend.checkpoints["pruned"]
        with pytest.raises(tracerl.ConfigError, match="keep_last"):
            await model.delete_checkpoints(keep_last=0)
        with pytest.raises(tracerl.CheckpointError, match="not registered"):
            await remote.list_checkpoints(_model("nobody"))


async def test_unknown_train_keyword_is_a_type_error(served):
    _, url = served
    model = _model()
    async with tracerl.RemoteBackend(url) as remote:
        await model.register(remote)
        with pytest.raises(TypeError, match="learning_rat"):
            await remote.train(model, [_group()], learning_rat=1e-4)


async def test_server_errors_come_back_typed_never_as_bare_500(served):
    backend, url = served
    async with tracerl.RemoteBackend(url) as remote:
        with pytest.raises(tracerl.CheckpointError, match="not registered"):
            await remote.get_step(_model("nobody"))
        model = _model()
        await model.register(remote)
        with pytest.raises(tracerl.ConfigError, match="already served"):
            await tracerl.TrainableModel("agent", "remote-tests", "other-base").register(remote)
        backend.fail_with = RuntimeError("GPU on fire")
        with pytest.raises(RemoteBackendError, match="GPU on fire") as caught:
            await remote.train(model, [_group()])
        assert caught.value.status == 500 and caught.value.error_type == "RuntimeError" and url in str(caught.value)
    async with httpx.AsyncClient(base_url=url) as client:
        bad = await client.post("/tracerl/v1/models/remote-tests/agent/train", content=b"{not json")
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "ConfigError"
        missing = await client.post("/tracerl/v1/models/register", json={"name": "x"})
        assert missing.status_code == 400 and "base_model" in missing.json()["error"]["message"]


async def test_one_train_at_a_time_per_model(served):
    backend, url = served
    model = _model()
    async with tracerl.RemoteBackend(url) as remote:
        await model.register(remote)
        results = await asyncio.gather(*(remote.train(model, [_group()]) for _ in range(3)))
    assert sorted(r.step for r in results) == [1, 2, 3] and backend.max_active == 1


class LeasingBackend(RecordingBackend):
    """The recording stand-in with ``LocalBackend``'s ``policy_lease``: records what is held."""

    def __init__(self, upstream: str | None) -> None:
        super().__init__(upstream)
        self.held: list[tuple[str, int]] = []

    @contextlib.asynccontextmanager
    async def policy_lease(self, model: Any, step: int) -> Any:
        self.held.append((model.name, step))
        try:
            yield
        finally:
            self.held.remove((model.name, step))


async def test_a_policy_lease_holds_until_released_or_expired(served, upstream, caplog):
    _, url = served
    async with tracerl.RemoteBackend(url) as remote:  # a backend that cannot lease says so
        model = _model()
        await model.register(remote)
        with pytest.raises(RemoteBackendError, match="cannot lease") as caught:
            async with remote.policy_lease(model, 0):
                pass
        assert caught.value.status == 501
    leasing = LeasingBackend(upstream.base_url)
    http, url = _serve(leasing)
    try:
        async with tracerl.RemoteBackend(url) as remote:
            model = _model()
            await model.register(remote)
            async with remote.policy_lease(model, 0):
                assert leasing.held == [("agent", 0)]
            assert leasing.held == []
            async with remote.policy_lease(model, 0, seconds=0.2):  # as if this process died in the block
                await asyncio.sleep(1.0)
                assert leasing.held == []  # the server ended it
            assert "could not release the lease on agent@0" in caplog.text and "released already, or expired" in caplog.text
            with pytest.raises(tracerl.ConfigError, match="seconds"):
                async with remote.policy_lease(model, 0, seconds=-1):
                    pass
            with pytest.raises(tracerl.CheckpointError, match="not registered"):
                async with remote.policy_lease(_model("nobody"), 0):
                    pass
        async with httpx.AsyncClient(base_url=url) as client:
            leases = "/tracerl/v1/models/remote-tests/agent/leases"
            assert (await client.post(leases, json={"step": "x"})).status_code == 400
            assert (await client.delete(f"{leases}/nope")).status_code == 404
    finally:
        http.stop()
    from fastapi.testclient import TestClient

    shutting = LeasingBackend(upstream.base_url)
    with TestClient(create_app(shutting)) as client:
        registered = client.post("/tracerl/v1/models/register", json={"name": "agent", "project": "remote-tests", "base_model": "smollm2-135m"})
        assert registered.status_code == 200, registered.text
        assert client.post(leases, json={"step": 0}).status_code == 200  # never released: the shutdown ends it
        assert shutting.held == [("agent", 0)]
    assert shutting.closed and shutting.held == []


async def test_token_is_required_everywhere_but_health(served_with_token):
    _, url = served_with_token
    async with httpx.AsyncClient(base_url=url) as client:
        assert (await client.get("/tracerl/v1/health")).status_code == 200
        for method, path in [("POST", "/tracerl/v1/models/register"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")]:
            response = await client.request(method, path, json={}, headers={"Authorization": "Bearer wrong"})
            assert response.status_code == 401 and response.json()["error"]["type"] == "Unauthorized"
    with pytest.raises(RemoteBackendError, match="TRACERL_SERVE_TOKEN") as caught:
        await _model().register(tracerl.RemoteBackend(url, token=""))
    assert caught.value.status == 401
    model = _model()
    await model.register(tracerl.RemoteBackend(url, token=TOKEN))
    assert model.inference_api_key == TOKEN  # the OpenAI client sends it to the /v1 proxy
    reply = await model.openai_client().chat.completions.create(model=model.get_inference_name(), messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == "answer: hi"


async def test_a_server_that_is_down_is_a_connection_error_naming_the_url():
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(RemoteConnectionError, match=f"cannot reach tracerl serve at {url} \\(register\\)") as caught:
        await _model().register(tracerl.RemoteBackend(url, timeout=5))
    assert isinstance(caught.value, ConnectionError) and isinstance(caught.value, tracerl.TracerlError)
    with pytest.raises(tracerl.ConfigError):
        tracerl.RemoteBackend("localhost:8000")


async def test_rollouts_through_the_proxy_are_captured_with_token_ids(served, upstream):
    _, url = served
    model = _model()
    async with tracerl.RemoteBackend(url) as remote:
        await model.register(remote)
        client = model.openai_client()
        async with tracerl.rollout(model) as plain:
            await client.chat.completions.create(model=model.get_inference_name(), messages=[{"role": "user", "content": "plain"}])
        async with tracerl.rollout(model) as streamed:
            stream = await client.chat.completions.create(
                model=model.get_inference_name(), messages=[{"role": "user", "content": "streamed"}], stream=True
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == "answer: streamed"
        for r in (plain, streamed):
            [turn] = r.trajectory.sampled_turns()
            sent = next(x for x in upstream.responses if x["id"] == turn.response_id)
            assert turn.token_ids == sent["choices"][0]["token_ids"] and turn.prompt_token_ids == sent["prompt_token_ids"]
        async with httpx.AsyncClient(base_url=url) as raw:
            assert (await raw.post("/v1/chat/completions", content=b"[]")).status_code == 400


def test_app_shutdown_closes_the_backend():
    from fastapi.testclient import TestClient

    backend = RecordingBackend(None)
    with TestClient(create_app(backend)) as client:
        assert client.get("/tracerl/v1/health").json()["status"] == "ok"
        assert client.get("/v1/models").json()["data"] == []
        unserved = client.post("/v1/chat/completions", json={"model": "x@0", "messages": []})
        assert unserved.status_code == 503 and unserved.json()["error"]["type"] == "InferenceServerError"
    assert backend.closed


def test_cli_has_the_serve_command():
    out = subprocess.run([sys.executable, "-m", "tracerl.cli", "serve", "--help"], capture_output=True, text=True, check=True).stdout
    assert "--token" in out and "--inference" in out


# -- real model: a `tracerl serve` subprocess trains SmolLM2-135M --------------------------------
@pytest.mark.real_model
async def test_remote_training_of_the_real_model(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "TRACERL_SERVE_TOKEN": TOKEN}
    command = [sys.executable, "-m", "tracerl.cli", "serve", "--port", str(port), "--path", str(tmp_path), "--inference", "transformers"]
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        remote = tracerl.RemoteBackend(url, token=TOKEN, timeout=5)
        await _wait_healthy(remote, process, tmp_path / "serve.log")
        model = tracerl.TrainableModel("remote-smol", "tests", "smollm2-135m")
        await model.register(remote)
        assert model.get_inference_name() == "remote-smol@0" and model.inference_base_url == f"{url}/v1"
        ti.instrument("openai")
        client = model.openai_client()

        async def attempt(question: str, reward: float) -> tracerl.Trajectory:
            async with tracerl.rollout(model, task=question) as r:
                await client.chat.completions.create(
                    model=model.get_inference_name(), messages=[{"role": "user", "content": question}], max_tokens=8, temperature=1.0
                )
                r.reward = reward
            return r.trajectory

        groups = []
        for question in ("Name a colour.", "Name a fruit."):
            trajectories = await asyncio.gather(attempt(question, 1.0), attempt(question, 0.0))
            groups.append(tracerl.TrajectoryGroup(trajectories))
        for t in (t for g in groups for t in g.trajectories):
            [turn] = t.sampled_turns()
            assert turn.token_ids and turn.prompt_token_ids and len(turn.logprobs) == len(turn.token_ids)
        hi = [{"role": "user", "content": "Hi"}]
        async with remote.policy_lease(model, 0):  # as PipelineTrainer holds one for each group it runs
            result = await remote.train(model, groups, learning_rate=1e-4)
            assert result.step == 1 and result.metrics["num_groups_trainable"] == 2
            assert (tmp_path / "tests" / "models" / "remote-smol" / "checkpoints" / "0001" / "adapter_model.safetensors").exists()
            assert model.get_inference_name() == "remote-smol@1" and await model.get_step() == 1
            reply = await client.chat.completions.create(model=model.get_inference_name(), messages=hi, max_tokens=4)
            assert reply.model == "remote-smol@1" and reply.choices[0].message is not None
            await remote.train(model, groups, learning_rate=1e-4)  # step 2: step 0 is two steps old, and leased
            pinned = await client.chat.completions.create(model="remote-smol@0", messages=hi, max_tokens=1)
            assert pinned.model == "remote-smol@0"
        with pytest.raises(openai.NotFoundError):  # the lease ended: the old policy was retired
            await client.chat.completions.create(model="remote-smol@0", messages=hi, max_tokens=1)
        await remote.close()
    finally:
        _stop(process)
        log.close()


async def _wait_healthy(remote: tracerl.RemoteBackend, process: subprocess.Popen, log_path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            pytest.fail(f"tracerl serve exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            await remote.health()
            return
        except RemoteConnectionError:
            if time.monotonic() > deadline:
                pytest.fail(f"tracerl serve did not answer within {timeout} s:\n{log_path.read_text()[-3000:]}")
            await asyncio.sleep(0.3)


def _stop(process: subprocess.Popen) -> None:
    """Stop the server we started, by its process group (graceful first: it stops its inference server)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
