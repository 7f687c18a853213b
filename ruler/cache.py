"""An on-disk cache of judge answers, keyed by a content hash.

The key covers everything that determines the answer: the judge (model and endpoint),
the request parameters that matter (temperature, structured output...), and the exact
messages sent, which contain the rubric and the rendered group in the order shown.  Only
validated answers are stored, one small JSON file each, written atomically.  Default
location: ``$TRACERL_CACHE/ruler`` (``~/.cache/tracerl/ruler``).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

CACHE_FORMAT = 1
_SECRET_KEYS = {"api_key", "key", "headers", "extra_headers", "aws_secret_access_key", "vertex_credentials"}


def default_cache_dir() -> Path:
    root = Path(os.environ.get("TRACERL_CACHE", Path.home() / ".cache" / "tracerl"))
    return root / "ruler"


def cache_key(judge: str, messages: list[dict[str, Any]], params: dict[str, Any], occurrence: int = 0) -> str:
    """Hex digest of (judge, messages, non-secret params, which repeat of this prompt)."""
    safe = {k: v for k, v in params.items() if k not in _SECRET_KEYS}
    payload = json.dumps(
        {"format": CACHE_FORMAT, "judge": judge, "messages": messages, "params": safe, "occurrence": occurrence},
        sort_keys=True,
        ensure_ascii=False,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


class RulerCache:
    """``get(key)`` / ``put(key, value)`` on JSON files under ``directory``."""

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_cache_dir()

    def _path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.json"

    def get(self, key: str) -> dict[str, Any] | None:
        try:
            value = json.loads(self._path(key).read_text())
        except (OSError, json.JSONDecodeError):
            return None  # absent or damaged: ask the judge again
        return value if isinstance(value, dict) and value.get("format") == CACHE_FORMAT else None

    def put(self, key: str, value: dict[str, Any]) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"format": CACHE_FORMAT, **value}, f)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def __repr__(self) -> str:
        return f"RulerCache({str(self.directory)!r})"


def resolve_cache(cache: "RulerCache | str | os.PathLike[str] | bool | None") -> RulerCache | None:
    """``True`` → the default directory, ``False``/``None`` → off, a path → that directory."""
    if cache is True:
        return RulerCache()
    if cache is False or cache is None:
        return None
    if isinstance(cache, RulerCache):
        return cache
    return RulerCache(cache)
