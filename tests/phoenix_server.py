"""A real Arize Phoenix server (``phoenix serve``) on free loopback ports, for tests and docs.

Its working directory (SQLite database) is a temporary folder; it is stopped by its
process id (DESIGN §5.6).  Phoenix serves OTLP/HTTP at ``{url}/v1/traces`` and its REST
API (read with ``phoenix.client``) and UI on the same port; its OTLP/gRPC receiver
cannot be turned off, so it gets a free port of its own (Phoenix binds it on every
interface).  Start-up takes ~20 s on two cores.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from loopback_app import free_port

START_TIMEOUT_S = 180.0


class PhoenixServer:
    """``with PhoenixServer() as phoenix:`` then ``phoenix.url``, ``phoenix.client()``."""

    def __init__(self) -> None:
        self.port = free_port()
        self.grpc_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir = Path(tempfile.mkdtemp(prefix="tracerl-phoenix-"))
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> "PhoenixServer":
        executable = Path(sys.executable).with_name("phoenix")
        env = {
            **os.environ, "PHOENIX_WORKING_DIR": str(self.workdir), "PHOENIX_HOST": "127.0.0.1",
            "PHOENIX_PORT": str(self.port), "PHOENIX_GRPC_PORT": str(self.grpc_port),
            "PHOENIX_TELEMETRY_ENABLED": "false",
        }  # fmt: skip
        log = open(self.workdir / "phoenix.log", "wb")
        self.process = subprocess.Popen([str(executable), "serve"], env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"phoenix serve exited with {self.process.returncode}: {self.log()[-2000:]}")
            try:
                if httpx.get(self.url + "/healthz", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"phoenix serve did not answer on {self.url} within {START_TIMEOUT_S:.0f} s")

    def client(self) -> Any:
        from phoenix.client import Client

        return Client(base_url=self.url)

    def spans(self, trace_id: str, *, expected: int, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """The spans of one trace, read back through Phoenix's REST API (it ingests asynchronously)."""
        client = self.client()
        deadline = time.monotonic() + timeout_s
        while True:
            spans = [s for s in client.spans.get_spans(project_identifier="default", limit=10_000)
                     if s["context"]["trace_id"] == trace_id]  # fmt: skip
            if len(spans) >= expected or time.monotonic() > deadline:
                return spans
            time.sleep(0.5)

    def log(self) -> str:
        path = self.workdir / "phoenix.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "PhoenixServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
