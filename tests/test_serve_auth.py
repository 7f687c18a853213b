"""``tracerl serve`` beyond loopback never serves an unauthenticated caller (issue 9, item 5).

Each test starts the real CLI (``python -m tracerl.cli serve``) as a subprocess on a free port,
with a real ``LocalBackend`` (``--inference none``: no model is loaded for these calls), and
talks to it over real sockets.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_remote_backend import _free_port, _stop

from tracerl.serve.auth import check_bind, is_loopback, InsecureBindError

PROTECTED = [("GET", "/v1/models"), ("POST", "/tracerl/v1/models/register"), ("GET", "/tracerl/v1/models/p/m/step")]


def _env(token: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRACERL_SERVE_TOKEN"}
    if token is not None:
        env["TRACERL_SERVE_TOKEN"] = token
    return env


def _start(tmp_path: Path, *args: str, env: dict[str, str]) -> tuple[subprocess.Popen, int, Path]:
    port = _free_port()
    log = tmp_path / f"serve-{port}.log"
    command = [sys.executable, "-m", "tracerl.cli", "serve", "--port", str(port), "--path", str(tmp_path / "data"), "--inference", "none", *args]
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return process, port, log


def _wait_listening(process: subprocess.Popen, port: int, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            pytest.fail(f"tracerl serve exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/tracerl/v1/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"tracerl serve did not answer within {timeout} s:\n{log.read_text()}")
        time.sleep(0.2)


def _refused(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def _assert_all_unauthorized(port: int, headers: dict[str, str]) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        for method, path in PROTECTED:
            response = client.request(method, path, headers=headers, json={} if method == "POST" else None)
            assert response.status_code == 401, (method, path, response.text)
            assert response.json()["error"]["type"] == "Unauthorized"


def _assert_authorized(port: int, token: str) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, headers={"Authorization": f"Bearer {token}"}) as client:
        assert client.get("/v1/models").json() == {"object": "list", "data": []}
        assert client.get("/tracerl/v1/models/p/m/step").status_code == 404  # past the door: just not registered


def test_a_public_bind_without_a_token_refuses_to_start(tmp_path):
    for host in ("0.0.0.0", "::"):
        process, port, log = _start(tmp_path, "--host", host, env=_env())
        try:
            assert process.wait(timeout=60) == 2
        finally:
            _stop(process)
        assert "refusing to serve on" in log.read_text() and "--generate-token" in log.read_text()
        assert _refused(port)  # it never listened
        assert not (tmp_path / "data").exists()  # nor touched the data directory
    empty = _start(tmp_path, "--host", "0.0.0.0", env=_env(""))[0]  # an empty TRACERL_SERVE_TOKEN is no token
    assert empty.wait(timeout=60) == 2


def test_generated_token_is_printed_once_and_required(tmp_path):
    process, port, log = _start(tmp_path, "--host", "0.0.0.0", "--generate-token", env=_env())
    try:
        _wait_listening(process, port, log)
        lines = [line for line in log.read_text().splitlines() if "generated token" in line]
        assert len(lines) == 1
        token = lines[0].rsplit(" ", 1)[-1]
        assert len(token) >= 32
        _assert_all_unauthorized(port, {})
        _assert_all_unauthorized(port, {"Authorization": "Bearer wrong"})
        _assert_authorized(port, token)
    finally:
        _stop(process)
    assert log.read_text().count(token) == 1  # printed once, never logged again


def test_token_from_the_environment_is_required(tmp_path):
    process, port, log = _start(tmp_path, "--host", "0.0.0.0", env=_env("env-s3cret-token"))
    try:
        _wait_listening(process, port, log)
        _assert_all_unauthorized(port, {})
        _assert_all_unauthorized(port, {"Authorization": "env-s3cret-token"})  # not a bearer header
        _assert_authorized(port, "env-s3cret-token")
    finally:
        _stop(process)


def test_insecure_no_auth_is_an_explicit_opt_out(tmp_path):
    process, port, log = _start(tmp_path, "--host", "0.0.0.0", "--insecure-no-auth", env=_env())
    try:
        _wait_listening(process, port, log)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 200
        assert "WARNING: --insecure-no-auth" in log.read_text()
    finally:
        _stop(process)


def test_which_hosts_count_as_loopback():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.5", "10.0.0.1", "myhost.example"))
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", "t")
    check_bind("0.0.0.0", None, insecure_no_auth=True)
    with pytest.raises(InsecureBindError, match="refusing"):
        check_bind("192.168.1.5", None)
