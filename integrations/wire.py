"""Model requests seen on the wire, so a rollout that called a model but captured nothing says so.

The capture hooks see calls through the libraries they patch; a client they do not know, or
a call on a thread that did not copy the context, leaves no span, and the trajectory would
come back empty without a word.  Whatever the client, an HTTP request to a model goes out
through ``httpx`` or its successor ``httpx2`` (the OpenAI SDK, LiteLLM, LangChain's OpenAI
models, plain ``httpx``), so their ``Client.send`` / ``AsyncClient.send`` are wrapped to note each ``POST`` to a
generation route (``/chat/completions``, ``/completions``, ``/responses``, ``/messages``, and
Gemini's ``:generateContent``): on the current rollout when there is one, else — while any
rollout is open — in a short list of requests made outside every rollout.  At its end a
rollout compares this with what it captured (:mod:`.missed`).  Requests made by tracerl's
own servers (the vLLM proxy, ``tracerl serve``) run with OpenTelemetry instrumentation
suppressed and are not noted.  Noting is a path check; it never raises into the request.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import itertools
import threading
from collections import deque
from typing import Any

from opentelemetry.instrumentation.utils import is_instrumentation_enabled

from .current import current_rollout
from .health import guard, record_error
from .patching import Patches
from .processor import get_processor

GENERATION_ROUTES = ("/chat/completions", "/completions", "/responses", "/messages")
_GEMINI_SUFFIXES = (":generateContent", ":streamGenerateContent")
MAX_URLS = 4
"""Distinct URLs a rollout remembers (for the warning's text)."""
MAX_UNJUDGED = 1024
"""Requests a rollout keeps unjudged before judging them (bounds memory in long rollouts)."""
MAX_OUTSIDE = 256
"""Requests made outside every rollout that are remembered, newest kept."""

_patches = Patches()
_lock = threading.Lock()
_sequence = itertools.count(1)
_outside: deque[tuple[int, str]] = deque(maxlen=MAX_OUTSIDE)


class SeenRequests:
    """The model requests one rollout made on the wire.

    A request is kept as its method and URL object when it is sent and judged (is it a
    generation route?) when :attr:`count` or :attr:`urls` is read, at rollout end: the send
    path only appends to a deque (thread-safe), the string work runs once, in a warm batch.
    """

    def __init__(self) -> None:
        self._count = 0
        self._urls: list[str] = []
        self._sent: deque[tuple[str, Any]] = deque()

    def note(self, url: str) -> None:
        """One model request to ``url`` (already judged a generation request)."""
        self._count += 1
        if url not in self._urls and len(self._urls) < MAX_URLS:
            self._urls.append(url)

    def note_request(self, method: str, url: Any) -> None:
        """A request was sent (any route); judged later.  Past :data:`MAX_UNJUDGED` they are judged now."""
        self._sent.append((method, url))
        if len(self._sent) > MAX_UNJUDGED:
            self._judge()

    def _judge(self) -> None:
        sent = self._sent
        while sent:
            try:
                method, url = sent.popleft()
            except IndexError:  # another thread took the last one
                return
            with guard("wire_note"):
                text = model_request_url(method, url)
                if text is not None:
                    self.note(text)

    @property
    def count(self) -> int:
        self._judge()
        return self._count

    @property
    def urls(self) -> list[str]:
        self._judge()
        return self._urls


def model_request_url(method: str, url: Any) -> str | None:
    """``scheme://host:port/path`` of a request that asks a model to generate, else None."""
    if method.upper() != "POST":
        return None
    path = str(getattr(url, "path", "") or "").rstrip("/")
    if not (path.endswith(GENERATION_ROUTES) or path.endswith(_GEMINI_SUFFIXES)):
        return None
    port = f":{url.port}" if getattr(url, "port", None) else ""
    return f"{url.scheme}://{url.host}{port}{path}"  # no user info, no query: nothing secret


def mark() -> int:
    """A position in the stream of requests made outside rollouts (see :func:`outside_since`)."""
    with _lock:
        return _outside[-1][0] if _outside else 0


def outside_since(position: int) -> list[str]:
    """URLs of model requests made outside every rollout after ``position``."""
    with _lock:
        return [url for seq, url in _outside if seq > position]


def _note(request: Any) -> None:
    try:  # try/except rather than ``guard``: this runs on every HTTP request
        if not is_instrumentation_enabled():
            return  # tracerl's own servers forwarding a request
        rollout = current_rollout()
        if rollout is not None:
            rollout.seen_requests.note_request(request.method, request.url)
            return
        url = model_request_url(request.method, request.url)
        if url is not None and get_processor().active_rollouts():
            with _lock:
                _outside.append((next(_sequence), url))
    except Exception as error:  # noqa: BLE001 - never raise into the request
        record_error("wire_note", error)


def _wrap_sync(original: Any) -> Any:
    @functools.wraps(original)
    def send(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        _note(request)
        return original(self, request, *args, **kwargs)

    return send


def _wrap_async(original: Any) -> Any:
    @functools.wraps(original)
    async def send(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        _note(request)
        return await original(self, request, *args, **kwargs)

    return send


HTTP_LIBRARIES = ("httpx", "httpx2")
"""``httpx2`` is what the OpenAI SDK 3.x and the MCP SDK 2.x speak HTTP through."""
_watching = False


def watch() -> None:
    """Wrap ``send`` of ``httpx`` and ``httpx2`` (those installed; idempotent, a flag check once done)."""
    global _watching
    if _watching:
        return
    with guard("wire_watch"), _lock:
        for library in HTTP_LIBRARIES:
            if importlib.util.find_spec(library) is None:
                continue
            module = importlib.import_module(library)
            _patches.apply(module.Client, "send", _wrap_sync)
            _patches.apply(module.AsyncClient, "send", _wrap_async)
        _watching = True
