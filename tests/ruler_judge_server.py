"""A local, deterministic judge that speaks the OpenAI chat-completions wire protocol.

It stands in for a hosted judge model in the RULER tests: a real HTTP server on
``127.0.0.1`` (free port, own thread, so it works whatever event loop the test uses)
that answers ``POST /v1/chat/completions`` with a scripted reply and counts requests.

A *script* is a function ``(request_json, n_call) -> str | dict``: a ``str`` becomes the
assistant message content; ``{"content": str, "finish_reason": str}`` sets both; any other
``dict`` is ``{"status": int, "body": {...}}``, an error reply.
Helpers below build the usual judges: by content, by position, and malformed ones.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

Script = Callable[[dict[str, Any], int], "str | dict[str, Any]"]

_TRAJECTORY_RE = re.compile(r'<trajectory id="([^"]+)">(.*?)</trajectory>', re.S)


def trajectories_in(request: dict[str, Any]) -> list[tuple[str, str]]:
    """``(id, text)`` of every ``<trajectory>`` block in the request's first user message."""
    user = next(m for m in request["messages"] if m["role"] == "user")
    return _TRAJECTORY_RE.findall(user["content"])


def answer(scores: list[tuple[str, float]], explanation: str = "scripted") -> str:
    return json.dumps(
        {"scores": [{"trajectory_id": tid, "explanation": f"{explanation} {tid}", "score": s} for tid, s in scores]}
    )


def by_content(rules: dict[str, float], default: float = 0.0) -> Script:
    """Score each trajectory by the first keyword (of ``rules``) found in its text."""

    def script(request: dict[str, Any], n_call: int) -> str:
        scores = []
        for tid, text in trajectories_in(request):
            score = next((value for key, value in rules.items() if key in text), default)
            scores.append((tid, score))
        return answer(scores)

    return script


def prefers_first_position() -> Script:
    """A maximally position-biased judge: whatever is shown first gets 1, the rest 0."""

    def script(request: dict[str, Any], n_call: int) -> str:
        ids = [tid for tid, _ in trajectories_in(request)]
        return answer([(tid, 1.0 if i == 0 else 0.0) for i, tid in enumerate(ids)])

    return script


def malformed_then(bad: Callable[[list[str]], str], then: Script | None = None) -> Script:
    """First answer ``bad(ids)``; later answers come from ``then`` (or stay bad when None)."""

    def script(request: dict[str, Any], n_call: int) -> str:
        ids = [tid for tid, _ in trajectories_in(request)]
        corrective = sum(1 for m in request["messages"] if m["role"] == "user") > 1
        if then is not None and corrective:
            return then(request, n_call)
        return bad(ids)

    return script


class JudgeServer:
    """``with JudgeServer(script) as server: server.base_url ...``; ``server.requests`` holds bodies."""

    def __init__(self, script: Script, *, model: str = "scripted-judge", usage: tuple[int, int] = (100, 20)) -> None:
        self.script = script
        self.model = model
        self.usage = usage
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    @property
    def count(self) -> int:
        return len(self.requests)

    def start(self) -> "JudgeServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> "JudgeServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _reply(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self._lock:
            self.requests.append(body)
            n_call = len(self.requests)
        out = self.script(body, n_call)
        finish_reason = "stop"
        if isinstance(out, dict) and "content" in out:
            out, finish_reason = out["content"], out.get("finish_reason", "stop")
        if isinstance(out, dict):
            return int(out.get("status", 500)), out.get("body", {"error": {"message": "scripted error"}})
        prompt_tokens, completion_tokens = self.usage
        return 200, {
            "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", self.model),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": out},
                    "finish_reason": finish_reason,
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server naming
                if self.path.rstrip("/").endswith("/models"):
                    self._send(200, {"object": "list", "data": [{"id": server.model, "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                except json.JSONDecodeError:
                    self._send(400, {"error": {"message": "body is not JSON", "type": "invalid_request_error"}})
                    return
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
                    return
                if not isinstance(body.get("messages"), list) or not body.get("model"):
                    self._send(400, {"error": {"message": "model and messages are required", "type": "invalid_request_error"}})
                    return
                status, payload = server._reply(body)
                self._send(status, payload)

        return Handler
