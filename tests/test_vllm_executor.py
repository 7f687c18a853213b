"""On CPU with one worker, vLLM runs the model inside its engine-core process (no third process).

The flags and environment are checked here; the real servers the suite starts (tests marked
``real_model``) run with them, so a vLLM that refused the single-process executor fails those.
"""

from __future__ import annotations

from tracerl.inference.vllm_server import VLLMServer


def server(**options: object) -> VLLMServer:
    return VLLMServer("/models/m", python="/usr/bin/python3", **options)  # type: ignore[arg-type]


def test_cpu_single_worker_runs_the_model_in_the_engine_process() -> None:
    vllm = server()
    joined = " ".join(vllm.command(8000))
    assert "--distributed-executor-backend uni" in joined
    assert vllm.environment()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # vLLM refuses uni on CPU without it


def test_parallel_servers_and_an_explicit_executor_keep_vllms_choice() -> None:
    for vllm in (server(tensor_parallel_size=2), server(data_parallel_size=2), server(extra_args=("--distributed-executor-backend", "mp"))):
        joined = " ".join(vllm.command(8000))
        assert joined.count("--distributed-executor-backend") == (1 if vllm.extra_args else 0)
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in vllm.environment() or vllm.extra_env


def test_the_users_environment_wins() -> None:
    vllm = server(env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert vllm.environment()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
