"""Crash-safe file primitives: what lets a run be SIGKILLed at any instant (DESIGN §5.8).

Four rules, each for a fault seen in practice:

* A file is written whole or not at all: into a temp file beside it, fsynced, renamed over
  the target, then the directory is fsynced (a rename is durable only once its directory is).
* A directory (a checkpoint) likewise: every file in the temp dir and the dir itself are
  fsynced before the rename.  Replacing an existing directory first moves the old one aside
  (``.old-NAME-*``), so at every instant the old or the new one is on disk, and
  :func:`repair_dir` puts the old one back if a kill lands between the two renames.
  Deleting a directory renames it to a temp name first, so a kill mid-delete never leaves
  a half-deleted directory under its real name.
* A JSONL append never glues onto a torn line: a file that does not end in a newline (a
  writer killed mid-line, a full disk) gets one before the new rows.
* The JSONL reader skips torn or corrupt lines and reports them with their line numbers (a
  logged warning and :func:`read_jsonl_report`), so one bad line never hides the rest.

Temp names start with ``.tmp-`` or ``.old-``; nothing else in this package uses them.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import shutil
import tempfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

__all__ = [
    "JsonlReport",
    "SkippedLine",
    "append_jsonl",
    "atomic_dir",
    "atomic_write_text",
    "dumps_jsonl",
    "fsync_dir",
    "fsync_tree",
    "read_jsonl",
    "read_jsonl_report",
    "remove_dir",
    "repair_dir",
]

log = logging.getLogger("tracerl")

TMP_PREFIX = ".tmp-"
COMPLETE = ".complete"
"""The marker :func:`filled_once` writes last."""
OLD_PREFIX = ".old-"
_WARNED_MAX = 256  # distinct bad-line reports remembered, so a re-read does not warn again


# -- fsync ------------------------------------------------------------------------------------
def fsync_dir(path: Path) -> None:
    """Make the entries of ``path`` (creations, renames, deletions) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (deepest first), then ``root`` itself."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


# -- whole files and directories --------------------------------------------------------------
def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``: readers see the old content or the new, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TMP_PREFIX, suffix=path.suffix)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_dir(final: Path) -> "_AtomicDir":
    """``with atomic_dir(path) as tmp: write into tmp`` — fsynced and renamed to ``path`` on success."""
    return _AtomicDir(final)


def filled_once(target: Path, fill: "Callable[[Path], str]") -> Path:
    """``target``, filled by ``fill(tmp)`` once (a download into the cache): processes that race for it wait
    on a lock, the folder appears whole (:func:`atomic_dir`) with a ``.complete`` file holding what
    ``fill`` returned, and a failed or killed fill leaves nothing that counts as done."""
    if (target / COMPLETE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / COMPLETE).exists():
            with atomic_dir(target) as tmp:
                (tmp / COMPLETE).write_text(fill(tmp))
    return target


class _AtomicDir:
    def __init__(self, final: Path) -> None:
        self.final = final

    def __enter__(self) -> Path:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(dir=self.final.parent, prefix=TMP_PREFIX))
        return self.tmp

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        fsync_tree(self.tmp)
        parent = self.final.parent
        old = None
        if self.final.exists():  # keep the old one on disk until the new one is in place
            old = parent / f"{OLD_PREFIX}{self.final.name}-{secrets.token_hex(4)}"
            os.rename(self.final, old)
        try:
            os.rename(self.tmp, self.final)
        except BaseException:
            if old is not None:  # put the old one back under its name
                os.rename(old, self.final)
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        fsync_dir(parent)
        if old is not None:
            shutil.rmtree(old)


def remove_dir(path: Path) -> None:
    """Delete a directory so that a kill mid-delete leaves a temp dir, never a half-deleted ``path``."""
    doomed = path.parent / f"{TMP_PREFIX}del-{path.name}-{secrets.token_hex(4)}"
    os.rename(path, doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed)


def repair_dir(parent: Path) -> list[str]:
    """Undo what a kill left in ``parent``: drop temp entries, put back an old dir whose replacement never landed.

    Returns one line per action (for the log).  Call it only while no writer is running
    (under the run lock): an in-flight temp entry looks the same as a stale one.
    """
    if not parent.is_dir():
        return []
    actions = []
    for entry in sorted(parent.iterdir()):
        if entry.name.startswith(OLD_PREFIX):
            target = parent / entry.name[len(OLD_PREFIX) :].rsplit("-", 1)[0]
            if target.exists():
                shutil.rmtree(entry)
                actions.append(f"removed {entry} (its replacement {target.name} is complete)")
            else:
                os.rename(entry, target)
                actions.append(f"restored {target} (a kill interrupted its replacement)")
        elif entry.name.startswith(TMP_PREFIX):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            actions.append(f"removed {entry} (an interrupted write)")
    if actions:
        fsync_dir(parent)
    return actions


# -- JSONL --------------------------------------------------------------------------------------
def dumps_jsonl(rows: Iterable[dict[str, Any]]) -> str:
    """One JSON object per line (values JSON cannot hold are written as strings)."""
    return "".join(json.dumps(row, default=str) + "\n" for row in rows)


def append_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """Append whole lines, fsynced; a torn last line (no newline) is terminated first, never glued to."""
    data = dumps_jsonl(rows).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:
        fsync_dir(path.parent)


@dataclass(frozen=True)
class SkippedLine:
    """A line of a JSONL file that the reader could not use."""

    path: Path
    line: int
    """1-based line number."""
    reason: str
    text: str
    """The start of the line (at most 120 characters)."""


@dataclass
class JsonlReport:
    """What :func:`read_jsonl_report` found: the rows it could read and the lines it skipped."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[SkippedLine] = field(default_factory=list)


def read_jsonl_report(path: Path) -> JsonlReport:
    """Read a JSONL file; torn, corrupt or non-object lines are skipped and listed (never raised)."""
    report = JsonlReport()
    if not path.exists():
        return report
    data = path.read_bytes()
    lines = data.split(b"\n")
    complete = len(lines) - 1  # the last element follows the last newline: empty unless torn
    for number, raw in enumerate(lines, start=1):
        text = raw.decode("utf-8", errors="replace").strip()
        if not text:
            continue
        row, reason = _parse_line(text)
        if row is not None:
            report.rows.append(row)
        if reason is not None:
            if number > complete and row is None:
                reason = "torn: the last line has no newline (a writer was killed mid-line)"
            report.skipped.append(SkippedLine(path, number, reason, text[:120]))
    return report


def _parse_line(text: str) -> tuple[dict[str, Any] | None, str | None]:
    """The row on one line and why it is not clean (None when it is)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        return _salvage(text, f"not valid JSON: {error.msg} at column {error.colno}")
    if not isinstance(value, dict):
        return None, "not a JSON object"
    return value, None


def _salvage(text: str, reason: str) -> tuple[dict[str, Any] | None, str]:
    """A row appended after a torn line by an older writer (glued onto it): take the whole object at the end."""
    start = text.find('{"', 1)
    while start != -1:
        if text[:start].rstrip()[-1:] in (":", ",", "["):  # a nested value, not a row of its own
            start = text.find('{"', start + 1)
            continue
        try:
            value = json.loads(text[start:])
        except json.JSONDecodeError:
            start = text.find('{"', start + 1)
            continue
        if isinstance(value, dict):
            return value, f"{reason}; salvaged the row glued on at column {start + 1}"
        break
    return None, reason


_warned: OrderedDict[tuple[str, tuple[tuple[int, str], ...]], None] = OrderedDict()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file; skipped lines are logged once as a warning with their numbers."""
    report = read_jsonl_report(path)
    if report.skipped:
        key = (str(path), tuple((s.line, s.reason) for s in report.skipped))
        if key not in _warned:
            _warned[key] = None
            if len(_warned) > _WARNED_MAX:
                _warned.popitem(last=False)
            details = "; ".join(f"line {s.line}: {s.reason}" for s in report.skipped)
            log.warning("%s: skipped %d unreadable line(s): %s", path, len(report.skipped), details)
    return report.rows
