"""``RemoteBackend.train_sft`` through ``tracerl serve`` over real HTTP on loopback.

Light: the real app and uvicorn around a recording stand-in backend (no model) check the wire:
examples travel as Trajectory JSON with sampled turns kept, the config as a dict, errors come
back typed, the client writes the ``sft`` history row.  Real model: a ``tracerl serve``
subprocess fine-tunes SmolLM2-135M from an OpenAI JSONL file and serves ``name@1``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

import tracerl
from sft_helpers import CAPITALS, capital_example, tool_example, write_jsonl
from test_remote_backend import TOKEN, _free_port, _stop, _wait_healthy
from tracerl.net.http_server import BackgroundUvicorn
from tracerl.serve.server import create_app
from tracerl.train.sft_config import SFTConfig


class RecordingSFTBackend:
    """Stands in for ``LocalBackend`` behind the app: records ``train_sft`` calls, checks like it does."""

    def __init__(self) -> None:
        self.path = None
        self.calls: list[tuple[list[tracerl.Trajectory], SFTConfig, Any]] = []
        self.step = 0

    async def register(self, model: tracerl.TrainableModel) -> None:
        model._step_cache = self.step

    async def train_sft(self, model: Any, trajectories: Any, config: Any = None, *, val_trajectories: Any = None) -> tracerl.TrainResult:
        from tracerl.train.sft_data import as_sft_examples

        examples = as_sft_examples(trajectories)
        self.calls.append((examples, config, val_trajectories))
        self.step += 1
        model._step_cache = self.step
        return tracerl.TrainResult(step=self.step, metrics={"loss": 0.5, "val_loss": 0.4}, checkpoint_path=f"/ckpt/{self.step:04d}")

    async def get_step(self, model: Any) -> int:
        return self.step

    async def close(self) -> None:
        pass


@pytest.fixture()
def served():
    backend = RecordingSFTBackend()
    http = BackgroundUvicorn(create_app(backend), name="tracerl-serve-sft-test")
    port = http.start()
    yield backend, f"http://127.0.0.1:{port}"
    http.stop()


async def test_train_sft_travels_as_trajectory_json_and_logs_the_row_here(served, tmp_path):
    backend, url = served
    remote = tracerl.RemoteBackend(url)
    model = tracerl.TrainableModel("agent", "remote-sft", "smollm2-135m", base_path=tmp_path)
    await model.register(remote)
    path = write_jsonl(tmp_path / "data.jsonl", [capital_example("Peru", "Lima"), tool_example(2, 3, first_weight=0)])
    config = SFTConfig(learning_rate=[1e-4, 5e-5], batch_size=1, schedule_type="cosine", normalization="sequence")
    result = await remote.train_sft(model, path, config, val_trajectories=[capital_example("Cuba", "Havana")])
    assert result.step == 1 and model.get_inference_name() == "agent@1"
    [(examples, sent_config, val)] = backend.calls
    assert sent_config == config
    assert [len(t.sampled_turns()) for t in examples] == [1, 1], "trained turns arrive as Choices, weight-0 ones as context"
    assert examples[1].tools and examples[1].messages_and_choices[2]["weight"] == 0
    assert len(val) == 1
    [row] = model.history()
    assert row["step"] == 1 and row["sft/loss"] == 0.5
    await remote.train_sft(model, path, config)  # the next step gets its own row, once
    assert [r["step"] for r in model.history()] == [1, 2]
    await remote.close()


async def test_bad_data_fails_on_the_client_and_bad_settings_come_back_typed(served, tmp_path):
    backend, url = served
    remote = tracerl.RemoteBackend(url)
    model = tracerl.TrainableModel("agent", "remote-sft", "smollm2-135m", base_path=tmp_path)
    await model.register(remote)
    path = write_jsonl(tmp_path / "bad.jsonl", [capital_example("Peru", "Lima"), "{nope"])
    with pytest.raises(tracerl.TrajectoryError, match="bad.jsonl line 2"):
        await remote.train_sft(model, path)
    with pytest.raises(tracerl.ConfigError, match="batch_size"):
        await remote.train_sft(model, [capital_example("Peru", "Lima")], {"batch_size": 0})
    import httpx

    async with httpx.AsyncClient(base_url=url) as client:  # what an older or foreign client could send
        answer = await client.post("/tracerl/v1/models/remote-sft/agent/train_sft", json={"trajectories": [], "config": {"lr_scheduler_type": "cosine"}})
        assert answer.status_code == 400 and answer.json()["error"]["type"] == "TypeError"
        answer = await client.post("/tracerl/v1/models/remote-sft/agent/train_sft", json={"trajectories": {"a": 1}})
        assert answer.status_code == 400 and answer.json()["error"]["type"] == "ConfigError"
        answer = await client.post(
            "/tracerl/v1/models/remote-sft/agent/train_sft", json={"trajectories": [{"messages": [{"role": "user", "content": "x"}]}]}
        )
        assert answer.status_code == 400 and "no assistant message" in answer.json()["error"]["message"]
    assert backend.calls == [] and model.history() == []
    await remote.close()


@pytest.mark.real_model
async def test_remote_sft_of_the_real_model_then_serves_the_new_step(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "TRACERL_SERVE_TOKEN": TOKEN}
    server_dir, client_dir = tmp_path / "server", tmp_path / "client"
    command = [sys.executable, "-m", "tracerl.cli", "serve", "--port", str(port), "--path", str(server_dir), "--inference", "transformers"]
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        remote = tracerl.RemoteBackend(url, token=TOKEN, timeout=5)
        await _wait_healthy(remote, process, tmp_path / "serve.log")
        model = tracerl.TrainableModel("remote-warm", "tests", "smollm2-135m", base_path=client_dir)
        await model.register(remote)
        path = write_jsonl(tmp_path / "capitals.jsonl", [capital_example(*c) for c in CAPITALS[:8]])
        result = await remote.train_sft(model, path, SFTConfig(learning_rate=1e-3, batch_size=4, val_fraction=0.25, show_progress=False))
        assert result.step == 1 and result.metrics["val_loss"] < result.metrics["val_loss_before"]
        checkpoint = server_dir / "tests" / "models" / "remote-warm" / "checkpoints" / "0001"
        assert json.loads((checkpoint / "step.json").read_text())["split"] == "sft"
        assert [r["step"] for r in model.history()] == [1] and "sft/val_loss" in model.history()[0]
        reply = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=[{"role": "user", "content": "What is the capital of Peru?"}], max_tokens=8
        )
        assert reply.model == "remote-warm@1"
        await remote.close()
    finally:
        _stop(process)
        log.close()
