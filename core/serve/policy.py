"""Which models a ``tracerl serve`` client may register: the server's owner decides, not the client.

A client names a base model, but may only get the embedded one(s) of :mod:`tracerl.base_models`
and the folders under the server's ``models_dir``; any other path on the server's disk is
refused, and a hub id is downloaded only when the owner enabled it.  The LoRA rank and the
number of registered models are bounded, because each costs the server memory (a rank-100000
adapter, one inference server per new name).

Refusals are :class:`ForbiddenError` (answered 403), never a crash of the server.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..base_models import EMBEDDED_ALIASES
from ..errors import ConfigError, TracerlError
from ..validation import lora_values

DEFAULT_MAX_LORA_RANK = 64
DEFAULT_MAX_MODELS = 4
DEFAULT_LORA_RANK = 8  # LoRASettings.r when lora_config has no "r"
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ForbiddenError(TracerlError, PermissionError):
    """The server's policy does not allow this request (a base model, a LoRA rank, one model too many)."""


@dataclass(frozen=True)
class ModelPolicy:
    """Which registrations the server accepts (see the module docstring)."""

    models_dir: Path | None = None
    """Folders directly or deeper under it may be registered, by path or by their path relative to it."""
    allow_hub_downloads: bool = False
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    max_models: int = DEFAULT_MAX_MODELS

    def __post_init__(self) -> None:
        for name in ("max_lora_rank", "max_models"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")

    def base_model(self, requested: str) -> str:
        """The base model spec this server will load for ``requested`` (``ForbiddenError`` if not allowed).

        The embedded aliases pass as they are; a folder under ``models_dir`` comes back as its
        absolute path; an allowed hub id as it is.
        """
        if requested.lower() in EMBEDDED_ALIASES:
            return requested
        inside = self._inside_models_dir(requested)
        if inside is not None:
            return str(inside)
        if self.allow_hub_downloads and _HUB_ID.match(requested) and ".." not in requested and not Path(requested).exists():
            return requested
        allowed = sorted(EMBEDDED_ALIASES)[:1] + ([f"folders under {self.models_dir}"] if self.models_dir else [])
        hint = "" if self.allow_hub_downloads else " (hub downloads are off: --allow-hub-downloads)"
        raise ForbiddenError(
            f"base_model {requested!r} is not allowed on this server: it serves {', '.join(allowed)} "
            f"(--models-dir adds a folder of models){hint}"
        )

    def _inside_models_dir(self, requested: str) -> Path | None:
        if self.models_dir is None:
            return None
        root = self.models_dir.expanduser().resolve()
        candidate = Path(requested).expanduser()
        path = (candidate if candidate.is_absolute() else root / candidate).resolve()  # symlinks and .. resolved
        if path != root and root in path.parents and (path / "config.json").is_file():
            return path
        return None

    def check_lora(self, lora_config: Mapping[str, Any]) -> None:
        """``ForbiddenError`` when the rank asked for is above ``max_lora_rank``."""
        rank = lora_values(lora_config).get("r", DEFAULT_LORA_RANK)
        if isinstance(rank, int) and rank > self.max_lora_rank:
            raise ForbiddenError(f"LoRA rank {rank} is above this server's limit of {self.max_lora_rank} (--max-lora-rank)")

    def check_count(self, registered: int) -> None:
        """``ForbiddenError`` when one more model would exceed ``max_models``."""
        if registered >= self.max_models:
            raise ForbiddenError(
                f"this server already serves {registered} models, its limit (--max-models {self.max_models}); "
                "reuse a name or restart the server with a higher limit"
            )
