"""What each tenant of the Tinker service used — what a serverless service bills by.

:class:`Usage` counts, per tenant, the tokens trained (``forward_backward``), the tokens only
scored (``forward``, ``compute_logprobs``' prompts), the tokens sampled and the prompt tokens
sampled from, and the seconds of compute: ``train_seconds`` on the training thread (every
operation there: forward, backward, optimizer steps, saves and loads) and ``sample_seconds`` in
the sampler (each request from its admission to its answer, so requests decoded together each
count their own time).  Each operation is one log line (``tinker usage: tenant=... op=...``) on
the ``tracerl.tinker.usage`` logger; the totals are on ``GET /api/v1/tracerl/usage`` and are kept
in ``usage.json`` beside the runs (written every sweep and at shutdown, read at start-up), so a
restart keeps them (a SIGKILL loses at most one sweep's worth).

:func:`dir_bytes` is what a checkpoint folder holds on disk (the disk quota's measure).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from ..runs.durable import atomic_write_text

log = logging.getLogger("tracerl.tinker.usage")

COUNTERS = ("operations", "tokens_trained", "tokens_forward", "tokens_sampled", "prompt_tokens_sampled", "train_seconds", "sample_seconds")


class Usage:
    """Per-tenant counters (thread-safe: the training thread and the event loop both add)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tenants: dict[str, dict[str, float]] = {}
        self.dirty = False

    def add(self, tenant: str, op: str, **counts: float) -> None:
        """One operation of ``tenant``'s: its counts added, and one log line."""
        with self.lock:
            totals = self.tenants.setdefault(tenant, dict.fromkeys(COUNTERS, 0))
            totals["operations"] += 1
            for name, value in counts.items():
                totals[name] += value
            self.dirty = True
        shown = " ".join(f"{name}={value:.3f}" if isinstance(value, float) else f"{name}={value}" for name, value in counts.items())
        log.info("tinker usage: tenant=%s op=%s %s", tenant, op, shown)

    def of(self, tenant: str) -> dict[str, Any]:
        with self.lock:
            totals = dict(self.tenants.get(tenant) or dict.fromkeys(COUNTERS, 0))
        for name in COUNTERS:
            totals[name] = round(totals[name], 3) if name.endswith("seconds") else int(totals[name])
        totals["compute_seconds"] = round(totals["train_seconds"] + totals["sample_seconds"], 3)
        return totals

    def save(self, path: Path) -> None:
        """Written (atomically) if anything changed since the last save."""
        with self.lock:
            if not self.dirty:
                return
            text = json.dumps({"tenants": self.tenants}, sort_keys=True)
            self.dirty = False
        atomic_write_text(path, text)

    def load(self, path: Path) -> None:
        """The totals a previous server saved (none: nothing counted yet)."""
        if not path.exists():
            return
        try:
            saved = json.loads(path.read_text())["tenants"]
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("tinker usage: %s is unreadable; counting from zero", path)
            return
        with self.lock:
            for tenant, totals in saved.items():
                mine = self.tenants.setdefault(tenant, dict.fromkeys(COUNTERS, 0))
                for name in COUNTERS:
                    mine[name] += float(totals.get(name, 0))


def dir_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder`` (0 if it is gone: deleted meanwhile)."""
    total = 0
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return 0
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                total += dir_bytes(Path(entry.path))
            elif entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            continue
    return total
