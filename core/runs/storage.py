"""The run directory: where checkpoints, history and trained trajectories live.

Layout (ART-compatible, under ``base_path``, default ``.tracerl``)::

    {project}/models/{name}/model.json                     (what was trained, and the run format)
    {project}/models/{name}/run.lock                       (held by the backend training it)
    {project}/models/{name}/history.jsonl
    {project}/models/{name}/checkpoints/{step:04d}/        (peft adapter + step.json)
    {project}/models/{name}/trajectories/{split}/{step:04d}.jsonl

It survives SIGKILL at any instant (the primitives are in :mod:`tracerl.runs.durable`).  A
trained step is committed by one atomic rename of its checkpoint directory, which holds
``step.json`` (the history row ``model.log(groups, split="train", metrics=...)`` would
write); its trajectories are written to ``trajectories/train/`` just before that rename.
So a step killed before ``model.log`` ran is not half-recorded: :meth:`RunDir.repair`
(run by ``register``, under the run lock) writes its missing row, marked ``"recovered":
true``, drops what uncommitted steps and interrupted writes left, and restores a
checkpoint whose replacement was interrupted.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .durable import (
    JsonlReport,
    append_jsonl,
    atomic_dir,
    atomic_write_text,
    dumps_jsonl,
    read_jsonl,
    read_jsonl_report,
    remove_dir,
    repair_dir,
)
from .run_lock import RunLock

__all__ = [
    "RUN_FORMAT",
    "STEP_RECORD",
    "TRAIN_SPLIT",
    "RunDir",
    "append_jsonl",
    "atomic_dir",
    "atomic_write_text",
    "dumps_jsonl",
    "history_row",
    "logged_splits",
    "read_jsonl",
    "read_jsonl_report",
    "validate_name",
]

log = logging.getLogger("tracerl")

RUN_FORMAT = 1
"""The on-disk format of a run directory, written into ``model.json`` as ``"format"``.

Runs written before formats were numbered (tracerl 0.1.0 until 2026-12-04) have no
``"format"`` and are format 1: the layout above has not changed since.  Raise it when a
change would make an older tracerl misread a run, and teach :meth:`RunDir.read_model_info`
to read the older formats, so a run keeps loading across upgrades."""

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_CHECKPOINT_RE = re.compile(r"\d{4,}")
STEP_RECORD = "step.json"
TRAIN_SPLIT = "train"


def validate_name(value: str, what: str) -> str:
    """Reject names that would escape the data directory or make awkward paths."""
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value) or ".." in value:
        raise ConfigError(
            f"invalid {what} {value!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (no '/', no '..')"
        )
    return value


def history_row(step: int, split: str, metrics: dict[str, Any], *, at: float | None = None) -> dict[str, Any]:
    """A ``history.jsonl`` row: the step, the time and each metric prefixed by ``split/``."""
    return {"step": step, "time": time.time() if at is None else at, **{f"{split}/{k}": v for k, v in metrics.items()}}


def logged_splits(row: dict[str, Any]) -> set[str]:
    """The splits a history row holds metrics of (``train/reward`` -> ``train``)."""
    return {key.split("/", 1)[0] for key in row if "/" in key}


class RunDir:
    """Paths, crash-safe I/O and resume repair for one model's run directory."""

    def __init__(self, base_path: str | os.PathLike[str], project: str, name: str) -> None:
        validate_name(project, "project name")
        validate_name(name, "model name")
        self.project, self.name = project, name
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
        return sorted(int(p.name) for p in self.checkpoints.iterdir() if p.is_dir() and _CHECKPOINT_RE.fullmatch(p.name))

    def latest_step(self) -> int | None:
        steps = self.checkpoint_steps()
        return steps[-1] if steps else None

    def lock(self) -> RunLock:
        """The run lock (not yet acquired): one trainer process per model."""
        return RunLock(self.root / "run.lock", f"model {self.project}/{self.name} ({self.root})")

    # -- files ------------------------------------------------------------------------------------
    @property
    def model_info_path(self) -> Path:
        return self.root / "model.json"

    def read_model_info(self) -> dict[str, Any] | None:
        """``model.json`` (None before the first registration); a run of a newer format is refused."""
        if not self.model_info_path.exists():
            return None
        info = json.loads(self.model_info_path.read_text())
        run_format = info.get("format", 1)
        if not isinstance(run_format, int) or isinstance(run_format, bool) or run_format < 1:
            raise ConfigError(f"{self.model_info_path}: run format {run_format!r} is not a positive integer")
        if run_format > RUN_FORMAT:
            raise ConfigError(
                f"{self.root} was written by a newer tracerl (run format {run_format}); this one reads formats up to "
                f"{RUN_FORMAT}: upgrade tracerl to use this run"
            )
        return info

    def write_model_info(self, info: dict[str, Any]) -> None:
        """Write ``model.json`` with this tracerl's :data:`RUN_FORMAT`."""
        self.write_json(self.model_info_path, {**info, "format": RUN_FORMAT})

    def write_json(self, path: Path, data: Any) -> None:
        atomic_write_text(path, json.dumps(data, indent=2, default=str))

    def append_history(self, row: dict[str, Any]) -> None:
        append_jsonl(self.history_path, [row])

    def read_history(self) -> list[dict[str, Any]]:
        """The history rows; unreadable lines are skipped and logged (see :meth:`history_report`)."""
        return read_jsonl(self.history_path)

    def history_report(self) -> JsonlReport:
        """The history rows and the lines skipped as torn or corrupt, with their numbers."""
        return read_jsonl_report(self.history_path)

    def write_trajectories(self, split: str, step: int, text: str) -> None:
        atomic_write_text(self.trajectories_path(split, step), text)

    def delete_checkpoint(self, step: int) -> None:
        remove_dir(self.checkpoint_path(step))

    # -- steps ------------------------------------------------------------------------------------
    @staticmethod
    def write_step_record(checkpoint_tmp: Path, step: int, metrics: dict[str, Any], *, split: str = TRAIN_SPLIT) -> None:
        """Put the step's history row (``split``: ``train``, or ``sft`` for ``train_sft``) into its
        (not yet renamed) checkpoint, so it commits with it."""
        record = {"step": step, "split": split, "time": time.time(), "metrics": metrics}
        (checkpoint_tmp / STEP_RECORD).write_text(json.dumps(record, default=str))

    def read_step_record(self, step: int) -> dict[str, Any] | None:
        path = self.checkpoint_path(step) / STEP_RECORD
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and record.get("step") == step else None

    # -- resume -----------------------------------------------------------------------------------
    def repair(self) -> list[str]:
        """Undo whatever a kill left; returns one line per action.  Run it only under the run lock."""
        actions = repair_dir(self.root) + repair_dir(self.checkpoints)
        splits = self.root / "trajectories"
        for split_dir in sorted(splits.iterdir()) if splits.is_dir() else []:
            actions += repair_dir(split_dir)
        actions += self._drop_uncommitted_trajectories()
        actions += self._recover_train_rows()
        for action in actions:
            log.warning("%s: %s", self.root, action)
        return actions

    def _drop_uncommitted_trajectories(self) -> list[str]:
        """``train`` writes a step's trajectories just before committing it: beyond the newest checkpoint they are orphans."""
        latest = self.latest_step() or 0
        split_dir = self.root / "trajectories" / TRAIN_SPLIT
        actions = []
        for path in sorted(split_dir.glob("*.jsonl")) if split_dir.is_dir() else []:
            if _CHECKPOINT_RE.fullmatch(path.stem) and int(path.stem) > latest:
                path.unlink()
                actions.append(f"removed {path} (its step was never committed)")
        return actions

    def step_records(self, after: int = 0) -> list[dict[str, Any]]:
        """The ``step.json`` records of the committed steps after ``after`` (what ``train`` would have logged)."""
        records = (self.read_step_record(step) for step in self.checkpoint_steps() if step > after)
        return [record for record in records if record is not None]

    def recover_rows(self, records: list[dict[str, Any]], *, source: str = "its checkpoint") -> list[str]:
        """Append the history row of each step record whose ``model.log`` never ran (killed before it).

        Also used by :class:`~tracerl.RemoteBackend`, whose history lives on the client while the
        records live in the server's checkpoints."""
        logged = {(row.get("step"), split) for row in self.read_history() for split in logged_splits(row)}
        actions = []
        for record in records:
            step, split = record.get("step"), record.get("split")
            if not isinstance(step, int) or not isinstance(split, str) or (step, split) in logged:
                continue
            row = history_row(step, split, record.get("metrics") or {}, at=record.get("time"))
            self.append_history({**row, "recovered": True})
            logged.add((step, split))
            actions.append(f"recovered the {split} row of step {step} from {source} (killed before model.log)")
        return actions

    def _recover_train_rows(self) -> list[str]:
        return self.recover_rows(self.step_records())
