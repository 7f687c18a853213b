"""The run directory: where checkpoints, history and trained trajectories live.

Layout (ART-compatible, under ``base_path``, default ``.tracerl``)::

    {project}/models/{name}/model.json
    {project}/models/{name}/history.jsonl
    {project}/models/{name}/checkpoints/{step:04d}/      (peft adapter)
    {project}/models/{name}/trajectories/{split}/{step:04d}.jsonl

Every write is atomic (temp file or temp dir, then rename), so a run killed mid-step
leaves only complete checkpoints behind and a rerun resumes from the newest one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable

from .errors import ConfigError

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_CHECKPOINT_RE = re.compile(r"^\d{4,}$")


def validate_name(value: str, what: str) -> str:
    """Reject names that would escape the data directory or make awkward paths."""
    if not isinstance(value, str) or not _NAME_RE.match(value) or ".." in value:
        raise ConfigError(
            f"invalid {what} {value!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (no '/', no '..')"
        )
    return value


class RunDir:
    """Paths and atomic I/O for one model's run directory."""

    def __init__(self, base_path: str | os.PathLike[str], project: str, name: str) -> None:
        validate_name(project, "project name")
        validate_name(name, "model name")
        self.root = Path(base_path).resolve() / project / "models" / name
        self.checkpoints = self.root / "checkpoints"
        self.history_path = self.root / "history.jsonl"

    def checkpoint_path(self, step: int) -> Path:
        return self.checkpoints / f"{step:04d}"

    def trajectories_path(self, split: str, step: int) -> Path:
        validate_name(split, "split")
        return self.root / "trajectories" / split / f"{step:04d}.jsonl"

    def checkpoint_steps(self) -> list[int]:
        """Steps of complete checkpoints (temp dirs of interrupted writes are ignored)."""
        if not self.checkpoints.is_dir():
            return []
        return sorted(int(p.name) for p in self.checkpoints.iterdir() if p.is_dir() and _CHECKPOINT_RE.match(p.name))

    def latest_step(self) -> int | None:
        steps = self.checkpoint_steps()
        return steps[-1] if steps else None

    def write_json(self, path: Path, data: Any) -> None:
        atomic_write_text(path, json.dumps(data, indent=2, default=str))

    def append_history(self, row: dict[str, Any]) -> None:
        append_jsonl(self.history_path, [row])

    def read_history(self) -> list[dict[str, Any]]:
        return read_jsonl(self.history_path)

    def clean_partial_writes(self) -> None:
        """Remove temp dirs left by a run killed while writing a checkpoint."""
        if self.checkpoints.is_dir():
            for p in self.checkpoints.iterdir():
                if p.name.startswith(".tmp-"):
                    shutil.rmtree(p, ignore_errors=True)


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def append_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """Append whole lines in one write, so a crash never leaves half a row behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(dumps_jsonl(rows))
        f.flush()
        os.fsync(f.fileno())


def dumps_jsonl(rows: Iterable[dict[str, Any]]) -> str:
    """One JSON object per line (values JSON cannot hold are written as strings)."""
    return "".join(json.dumps(row, default=str) + "\n" for row in rows)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Read a JSONL file, skipping a torn last line left by a killed writer."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def atomic_dir(final: Path) -> "_AtomicDir":
    """``with atomic_dir(path) as tmp: write into tmp`` — renamed to ``path`` on success."""
    return _AtomicDir(final)


class _AtomicDir:
    def __init__(self, final: Path) -> None:
        self.final = final

    def __enter__(self) -> Path:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(dir=self.final.parent, prefix=".tmp-"))
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        if self.final.exists():
            shutil.rmtree(self.final)
        os.replace(self.tmp, self.final)
