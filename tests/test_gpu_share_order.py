"""One GPU shared by vLLM and the trainer: the order of starts, sleeps, loads and wakes.

No GPU and no GPU build of vLLM run here, so this checks the *order* LocalBackend gives the
calls, with the server's start, sleep and wake and the trainer's load recorded instead of run:

- a new run starts vLLM before the trainer loads (vLLM's start-up profiles the free GPU memory
  and takes ``gpu_memory_utilization`` of it; a trainer loading meanwhile would race it);
- a step puts vLLM to sleep *before* a trainer is (re)loaded (after a resume or a dropped trainer),
  and PyTorch's cached GPU memory is released before vLLM is woken.

On a CPU vLLM starts *while* the trainer loads (tests/test_register_start.py).
"""

from __future__ import annotations

import pytest

import tracerl
import tracerl.train.local_backend as local_backend
from tracerl.inference.vllm_server import VLLMServer
from tracerl.train.local_backend import LocalBackend


class RecordedVLLM(VLLMServer):
    """A VLLMServer whose process calls are recorded, not made."""

    events: list[str]

    async def start(self) -> None:
        self.events.append("vllm start")

    async def stop(self) -> None:
        self.events.append("vllm stop")

    async def pause(self) -> None:
        self.events.append("vllm sleep")

    async def resume(self) -> None:
        self.events.append("vllm wake")

    async def load_adapter(self, name: str, path: str) -> None:
        self.events.append(f"serve {name}")

    async def unload_adapter(self, name: str) -> None:
        pass


class LoadedTrainer:
    def save(self, folder, *, step: int, with_optimizer: bool) -> None:
        (folder / "adapter_config.json").write_text("{}")


@pytest.fixture()
def recorded(monkeypatch):
    events: list[str] = []

    def make_server(self, state):
        server = RecordedVLLM(state.model_path, served_name=state.model.name)
        server.events = events
        return server

    def load_trainer(self, state):
        if state.trainer is None:
            events.append("trainer load")
            state.trainer = LoadedTrainer()
        return state.trainer

    def run_step(self, trainer, sequences, config, state):
        events.append("step")
        return {}

    monkeypatch.setattr(LocalBackend, "_make_server", make_server)
    monkeypatch.setattr(LocalBackend, "_trainer", load_trainer)
    monkeypatch.setattr(LocalBackend, "_run_step", run_step)
    monkeypatch.setattr(LocalBackend, "_check_memory_plan", lambda self, state: None)  # a plan for a GPU this machine lacks
    monkeypatch.setattr(local_backend, "release_cached_gpu_memory", lambda: events.append("release GPU cache"))
    return events


async def test_on_a_gpu_vllm_starts_first_sleeps_before_a_trainer_reload_and_wakes_after_the_cache_is_released(tmp_path, recorded):
    backend = tracerl.LocalBackend(tmp_path, inference="vllm", device="cuda")
    model = tracerl.TrainableModel("shared", "tests", "smollm2-135m")
    try:
        await model.register(backend)
        assert recorded == ["vllm start", "trainer load", "serve shared@0"]

        recorded.clear()
        state = backend._state(model)
        state.trainer = None  # dropped (a failed step) or never loaded (a resumed run)
        assert await backend._step_or_skip(state, [], object(), {}, "raise")
        assert recorded == ["vllm sleep", "trainer load", "step", "release GPU cache", "vllm wake"]
    finally:
        await backend.close()
