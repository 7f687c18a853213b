"""vLLM's GPU knobs: parallelism and memory-share flags, sleep mode while training, the free-memory check.

No GPU here, so what can run does: the flags vLLM gets, the refusal of sleep mode on CPU (vLLM
itself refuses it there), the arithmetic of the start-up check on a GPU's numbers, the
``nvidia-smi`` reading through a real executable that prints nvidia-smi's CSV, and the routes
``pause``/``resume`` call, checked against the installed vLLM's own router.
"""

from __future__ import annotations

import asyncio
import os
import re
import stat
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tracerl.inference.devices import GIB, nvidia_smi_memory
from tracerl.errors import ConfigError, InsufficientMemoryError
from tracerl.inference.vllm_server import VLLMServer, runtime_dir


def server(**options: object) -> VLLMServer:
    return VLLMServer("/models/m", python="/usr/bin/python3", **options)  # type: ignore[arg-type]


def test_defaults_add_no_gpu_flags_on_cpu() -> None:
    vllm = server()
    assert vllm.gpu_args() == []
    assert vllm.sleep_while_training is False


def test_parallelism_and_memory_share_reach_vllm() -> None:
    command = server(tensor_parallel_size=2, data_parallel_size=4, gpu_memory_utilization=0.45).command(8000)
    joined = " ".join(command)
    assert "--tensor-parallel-size 2" in joined
    assert "--data-parallel-size 4" in joined
    assert "--gpu-memory-utilization 0.45" in joined


@pytest.mark.parametrize(
    "options", [{"tensor_parallel_size": 0}, {"data_parallel_size": -1}, {"gpu_memory_utilization": 0.0}, {"gpu_memory_utilization": 1.5}]
)
def test_bad_knobs_are_refused_before_start(options: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        server(**options)


def test_sleep_mode_on_cpu_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="sleep_while_training=True needs a GPU"):
        server(sleep_while_training=True)


def test_too_little_free_gpu_memory_is_explained_before_vllm_starts() -> None:
    vllm = server(tensor_parallel_size=2, gpu_memory_utilization=0.5)
    vllm.check_gpu_memory([(80 * GIB, 140 * GIB), (90 * GIB, 140 * GIB)])  # 70 GiB wanted on each: room
    with pytest.raises(InsufficientMemoryError) as caught:
        vllm.check_gpu_memory([(80 * GIB, 140 * GIB), (30 * GIB, 140 * GIB)])
    message = str(caught.value)
    assert "cuda:1 has 30.0 GiB free of 140.0 GiB" in message
    assert "vLLM (gpu_memory_utilization=0.5" in message
    assert "needs about 70.0 GiB" in message
    server().check_gpu_memory([])  # no GPU: nothing to check


def test_nvidia_smi_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tool = tmp_path / "nvidia-smi"
    tool.write_text("#!/bin/sh\nprintf '0, 120000, 143771\\n1, 4000, 143771\\n'\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    mib = 1024 * 1024
    assert nvidia_smi_memory() == [(120000 * mib, 143771 * mib), (4000 * mib, 143771 * mib)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert nvidia_smi_memory() == [(4000 * mib, 143771 * mib)]


class _Recorder(BaseHTTPRequestHandler):
    routes: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        type(self).routes.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("sleep", [False, True])
def test_pause_and_resume_call_vllms_routes(sleep: bool) -> None:
    vllm = server()
    vllm.sleep_while_training = sleep  # as on a GPU machine (the constructor refuses it here)
    _Recorder.routes = []
    http = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        vllm.vllm_url = f"http://127.0.0.1:{http.server_address[1]}"
        asyncio.run(vllm.pause())
        asyncio.run(vllm.resume())
    finally:
        http.shutdown()
    expected = ["/sleep?level=1&mode=wait", "/wake_up"] if sleep else ["/pause?mode=keep", "/resume"]
    assert _Recorder.routes == expected


def test_the_sleep_routes_exist_in_the_installed_vllm() -> None:
    """The routes and query parameters pause/resume use, read from vLLM's own router source."""
    routers = list(runtime_dir().glob("lib/python3*/site-packages/vllm/entrypoints/serve/dev/sleep/api_router.py"))
    if not routers:
        pytest.skip("the vLLM runtime is not installed")
    source = routers[0].read_text()
    assert '@router.post("/sleep")' in source and '@router.post("/wake_up")' in source
    signature = source[source.index("async def sleep(") : source.index("@router.post", source.index("async def sleep("))]
    assert re.search(r"\blevel\b", signature) and re.search(r"\bmode\b", signature)
    engine = routers[0].parents[4] / "v1" / "engine" / "core.py"
    assert '"wait"' in engine.read_text() or "'wait'" in engine.read_text()


def test_serve_refuses_vllm_knobs_for_the_transformers_server(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from tracerl.cli import app

    result = CliRunner().invoke(
        app, ["serve", "--path", str(tmp_path), "--inference", "transformers", "--gpu-memory-utilization", "0.5"]
    )
    assert result.exit_code == 2
    assert "are vLLM's" in result.output


def test_kv_cache_size_on_cpu_defaults_to_one_gib_and_can_be_set() -> None:
    from tracerl.inference.vllm_server import CPU_KV_CACHE_BYTES

    assert CPU_KV_CACHE_BYTES == GIB
    assert " --kv-cache-memory-bytes 1073741824 " in " ".join(server().command(8000)) + " "
    assert "--kv-cache-memory-bytes 536870912" in " ".join(server(kv_cache_memory_bytes=GIB // 2).command(8000))
    assert "VLLM_CPU_KVCACHE_SPACE" not in server().environment() or "VLLM_CPU_KVCACHE_SPACE" in os.environ
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes must be positive"):
        server(kv_cache_memory_bytes=0)
