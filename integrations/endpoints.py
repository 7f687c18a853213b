"""Which OpenAI-compatible endpoints are served by tracerl (so requests to them can ask
for exact token ids and logprobs: ``return_token_ids`` + ``logprobs``)."""

from __future__ import annotations

import os
import threading

_lock = threading.Lock()
_endpoints: set[str] = set()
_env_loaded = False


def _normalize(url: str) -> str:
    url = str(url).strip().rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def register_endpoint(base_url: str) -> None:
    """Mark ``base_url`` as served by a tracerl backend (also: env ``TRACERL_ENDPOINTS``, comma separated)."""
    with _lock:
        _endpoints.add(_normalize(base_url))


def unregister_endpoint(base_url: str) -> None:
    with _lock:
        _endpoints.discard(_normalize(base_url))


def is_tracerl_endpoint(base_url: object) -> bool:
    global _env_loaded
    if not _env_loaded:
        _env_loaded = True
        for url in os.environ.get("TRACERL_ENDPOINTS", "").split(","):
            if url.strip():
                register_endpoint(url)
    if not _endpoints or base_url is None:
        return False
    return _normalize(str(base_url)) in _endpoints


def is_tracerl_url(url: object) -> bool:
    """Whether a request URL (``.../v1/chat/completions``) goes to a tracerl-served endpoint."""
    text = str(url).strip()
    is_tracerl_endpoint(None)  # loads TRACERL_ENDPOINTS once
    with _lock:
        return any(text == e or text.startswith(e + "/") for e in _endpoints)
