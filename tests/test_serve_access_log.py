"""``tracerl serve --access-log``: one line per request, never a token or a body (issue 9, item 5).

The real CLI as a subprocess (``LocalBackend``, ``--inference none``), real HTTP.
"""

from __future__ import annotations

import re

import httpx
from test_serve_auth import _env, _start, _stop, _wait_listening

TOKEN = "access-log-t0ken-SECRET"
LINE = re.compile(r"^\S+Z 127\.0\.0\.1:\d+ (GET|POST) (\S+) (\d{3}) [\d.]+ms \d+B$")


def test_one_line_per_request_without_headers_or_bodies(tmp_path):
    log_path = tmp_path / "access.log"
    process, port, log = _start(tmp_path, "--token", TOKEN, "--access-log", str(log_path), "--max-body-mb", "0.01", env=_env())
    try:
        _wait_listening(process, port, log)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            auth = {"Authorization": f"Bearer {TOKEN}"}
            assert client.get("/v1/models", headers=auth).status_code == 200
            assert client.get("/v1/models?api_key=QUERY-SECRET").status_code == 401
            body = {"name": "m", "project": "p", "base_model": "/BODY-SECRET"}
            assert client.post("/tracerl/v1/models/register", json=body, headers=auth).status_code == 403
            assert client.post("/tracerl/v1/models/register", content=b"x" * 20000, headers=auth).status_code == 413
    finally:
        _stop(process)
    text = log_path.read_text()
    lines = [LINE.match(line) for line in text.splitlines()]
    assert all(lines), text
    requests = [(m.group(1), m.group(2), int(m.group(3))) for m in lines if m.group(2) != "/tracerl/v1/health"]
    assert requests == [("GET", "/v1/models", 200), ("GET", "/v1/models", 401), ("POST", "/tracerl/v1/models/register", 403),
                        ("POST", "/tracerl/v1/models/register", 413)]  # fmt: skip
    for secret in (TOKEN, "QUERY-SECRET", "BODY-SECRET", "Bearer"):
        assert secret not in text
