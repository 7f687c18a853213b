"""A new run on a CPU starts vLLM while the trainer loads, and a trainer that then fails to load
leaves nothing running.

vLLM's start is the longest wait of a new run, so on a CPU it no longer waits for the trainer to
load and write checkpoint 0.  On a GPU the two would race for its memory, and the transformers
server loads in the trainer's process (transformers' loading is not thread-safe), so those still
go one after the other.
"""

from __future__ import annotations

import time

import httpx
import pytest

import tracerl
from tracerl.inference.vllm_server import vllm_python
from tracerl.train.local_backend import LocalBackend


async def test_vllm_starts_while_the_trainer_loads_and_is_stopped_when_the_trainer_fails(tmp_path, monkeypatch):
    """The trainer's load (injected: out of memory) fails only once vLLM beside it is serving, so
    with the server started after the trainer, as before, no server would ever start and the
    load would time out.  Register raises the trainer's error and stops the server."""
    if vllm_python() is None:
        pytest.skip("the vLLM runtime is not installed (make install-vllm)")
    started = []
    start = LocalBackend._start

    async def recorded(state, server):
        await start(state, server)
        started.append(server)

    def fails_once_vllm_serves(self, state):
        deadline = time.monotonic() + 180
        while not started and time.monotonic() < deadline:
            time.sleep(0.2)
        raise MemoryError(f"injected: the trainer could not load ({'beside' if started else 'without'} a started server)")

    monkeypatch.setattr(LocalBackend, "_start", staticmethod(recorded))
    monkeypatch.setattr(LocalBackend, "_trainer", fails_once_vllm_serves)
    backend = tracerl.LocalBackend(tmp_path, inference="vllm", device="cpu", server_options={"kv_cache_memory_bytes": 256 << 20})
    try:
        with pytest.raises(MemoryError, match="beside a started server"):
            await tracerl.TrainableModel("broken", "tests", "smollm2-135m").register(backend)
        (server,) = started
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{server.base_url}/health", timeout=5)  # stopped with the failed registration
    finally:
        await backend.close()
