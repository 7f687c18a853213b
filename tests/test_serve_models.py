"""Which models a ``tracerl serve`` client may register is the server's decision (issue 9, item 5).

Real uvicorn and HTTP on loopback with test_remote_backend's recording backend (it records what
the server would load), one real ``tracerl serve`` subprocess (``LocalBackend``, no model
loaded: the refusals come first), and a ``real_model`` check that a failed ``LocalBackend``
registration stops the inference server it started.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import httpx
import pytest
from test_remote_backend import RecordingBackend, upstream  # noqa: F401 - upstream is a fixture
from test_serve_auth import _env, _start, _stop, _wait_listening

import tracerl
from tracerl import RemoteBackendError
from tracerl.net.http_server import BackgroundUvicorn
from tracerl.serve.server import create_app
from tracerl.serve.policy import ForbiddenError, ModelPolicy

REGISTER = "/tracerl/v1/models/register"


class Served:
    def __init__(self, backend: RecordingBackend, policy: ModelPolicy | None) -> None:
        self.backend = backend
        self.http = BackgroundUvicorn(create_app(backend, policy=policy), name="tracerl-serve-models")
        self.url = f"http://127.0.0.1:{self.http.start()}"
        self.registered: list[tracerl.TrainableModel] = []
        original = backend.register

        async def recording_register(model: tracerl.TrainableModel) -> None:
            self.registered.append(model)
            await original(model)

        backend.register = recording_register  # type: ignore[method-assign]

    def post(self, name: str, base_model: str, **lora: int) -> httpx.Response:
        body = {"name": name, "project": "p", "base_model": base_model, "lora_config": lora}
        return httpx.post(self.url + REGISTER, json=body, timeout=30)


@pytest.fixture()
def serve_with(upstream):  # noqa: F811
    started: list[Served] = []

    def start(policy: ModelPolicy | None = None) -> Served:
        started.append(Served(RecordingBackend(upstream.base_url), policy))
        return started[-1]

    yield start
    for served in started:
        served.http.stop()


def _hf_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def _forbidden(response: httpx.Response, *words: str) -> None:
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["type"] == "ForbiddenError" and all(w in error["message"] for w in words), error


def test_by_default_only_the_embedded_model(serve_with, tmp_path):
    served = serve_with()
    assert served.post("a", "smollm2-135m").status_code == 200
    _forbidden(served.post("b", str(_hf_folder(tmp_path / "on-disk"))), "not allowed")  # a real HF folder on the server
    _forbidden(served.post("c", "/etc"))
    _forbidden(served.post("d", "Qwen/Qwen2.5-0.5B-Instruct"), "--allow-hub-downloads")
    assert [m.base_model for m in served.registered] == ["smollm2-135m"]  # nothing refused reached the backend


def test_models_dir_folders_only_inside_it(serve_with, tmp_path):
    root = tmp_path / "models"
    tiny = _hf_folder(root / "tiny")
    outside = _hf_folder(tmp_path / "outside")
    (root / "escape").symlink_to(outside)
    served = serve_with(ModelPolicy(models_dir=root))
    assert served.post("by-name", "tiny").status_code == 200
    assert served.post("by-path", str(tiny)).status_code == 200
    for name, spec in [("up", "../outside"), ("abs", str(outside)), ("link", "escape"), ("root", "."), ("missing", "nope")]:
        _forbidden(served.post(name, spec))
    assert [m.base_model for m in served.registered] == [str(tiny.resolve())] * 2
    assert served.post("by-name", "tiny").status_code == 200  # the same request again: already registered, fine
    conflict = served.post("by-name", str(tiny))
    assert conflict.status_code == 400 and "already served" in conflict.json()["error"]["message"]


def test_hub_ids_only_when_enabled(serve_with, tmp_path):
    served = serve_with(ModelPolicy(allow_hub_downloads=True))
    assert served.post("hub", "HuggingFaceTB/SmolLM2-360M-Instruct").status_code == 200
    _forbidden(served.post("path", str(_hf_folder(tmp_path / "x"))))  # still no arbitrary server paths
    _forbidden(served.post("dots", "../etc"))
    assert [m.base_model for m in served.registered] == ["HuggingFaceTB/SmolLM2-360M-Instruct"]


async def test_lora_rank_and_model_count_are_bounded(serve_with):
    served = serve_with(ModelPolicy(max_lora_rank=16, max_models=2))
    _forbidden(served.post("huge", "smollm2-135m", r=100000), "--max-lora-rank")
    assert served.post("one", "smollm2-135m", r=16).status_code == 200
    async with tracerl.RemoteBackend(served.url) as remote:
        await tracerl.TrainableModel("two", "p", "smollm2-135m").register(remote)
        with pytest.raises(RemoteBackendError, match="--max-models") as caught:
            await tracerl.TrainableModel("three", "p", "smollm2-135m").register(remote)
        assert caught.value.status == 403 and caught.value.error_type == "ForbiddenError"
        await tracerl.TrainableModel("two", "p", "smollm2-135m").register(remote)  # a known name is not one more
        staler = tracerl.TrainableModel("two", "p", "smollm2-135m")
        tracerl.PipelineTrainer(staler, remote, _no_rollout, [], max_steps=1, max_staleness=9)  # 9 vLLM slots' worth: refused
        with pytest.raises(tracerl.ConfigError, match="max_staleness"):  # the server's 400, as the client's ConfigError
            await staler.register(remote)
    assert [m.name for m in served.registered] == ["one", "two"]


async def _no_rollout(model, scenario, config):
    raise AssertionError("no rollout runs here")


def test_policy_arguments_are_checked():
    with pytest.raises(tracerl.ConfigError):
        ModelPolicy(max_lora_rank=0)
    with pytest.raises(ForbiddenError):
        ModelPolicy().check_count(4)


def test_the_cli_refuses_server_paths_before_loading_anything(tmp_path):
    models = tmp_path / "models"
    _hf_folder(models / "tiny")
    process, port, log = _start(tmp_path, "--token", "t0k", "--models-dir", str(models), "--max-lora-rank", "8", env=_env())
    try:
        _wait_listening(process, port, log)
        headers = {"Authorization": "Bearer t0k"}
        for base_model, lora in [(str(tmp_path), {}), ("org/model", {}), ("tiny", {"r": 9})]:
            body = {"name": "m", "project": "p", "base_model": base_model, "lora_config": lora}
            response = httpx.post(f"http://127.0.0.1:{port}{REGISTER}", json=body, headers=headers, timeout=30)
            _forbidden(response)
    finally:
        _stop(process)
    assert not (tmp_path / "data" / "p").exists()  # no run directory was created for a refused model


# -- real model: a failed registration leaves no inference server behind -------------------------
def _server_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name in ("tracerl-transformers", "tracerl-generate") and t.is_alive()]


@pytest.mark.real_model
async def test_a_failed_register_stops_the_inference_server_it_started(tmp_path):
    from tracerl.train.local_backend import LocalBackend

    model = tracerl.TrainableModel("broken", "p", "smollm2-135m", base_path=tmp_path)
    checkpoint = model.run_dir.checkpoint_path(0)  # a checkpoint 0 whose adapter cannot load
    checkpoint.mkdir(parents=True)
    (checkpoint / "adapter_config.json").write_text("{not json")
    (checkpoint / "adapter_model.safetensors").write_bytes(os.urandom(64))
    assert _server_threads() == []
    backend = LocalBackend(tmp_path, inference="transformers")
    with pytest.raises(Exception) as caught:
        await model.register(backend)
    assert "load_adapter" in [entry.name for entry in caught.traceback], caught.value  # it failed after the server started
    assert _server_threads() == []  # the server started, the adapter failed to load, the server was stopped
    assert backend._models == {}
    model.run_dir.lock().acquire()  # and the run lock was released
