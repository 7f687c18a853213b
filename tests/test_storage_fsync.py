"""Durability after a step returns: files, temp dirs and parents are fsynced in the order power loss needs.

The test watches the real ``os.fsync``/``os.rename``/``os.replace`` calls (resolving each fsynced
descriptor through /proc) and checks the order: every file and the temp dir before the rename,
the parent directory after it (a rename is durable only once its directory is).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tracerl.runs.storage import append_jsonl, atomic_dir, atomic_write_text

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name fsynced descriptors")


@pytest.fixture()
def events(monkeypatch):
    seen: list[tuple[str, str, str]] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd):
        seen.append(("fsync", os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}"), ""))
        return real_fsync(fd)

    def rename(src, dst, *a, **k):
        seen.append(("rename", os.fspath(src), os.fspath(dst)))
        return real_rename(src, dst, *a, **k)

    def replace(src, dst, *a, **k):
        seen.append(("rename", os.fspath(src), os.fspath(dst)))
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    return seen


def _index(events, *event):
    return events.index(event)


def test_a_checkpoint_dir_is_fsynced_before_and_after_its_rename(tmp_path, events):
    final = tmp_path / "checkpoints" / "0001"
    with atomic_dir(final) as tmp:
        (tmp / "adapter_model.safetensors").write_text("w")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "optimizer.pt").write_text("o")
    tmp = str(tmp)
    rename = _index(events, "rename", tmp, str(final))
    for path in (f"{tmp}/adapter_model.safetensors", f"{tmp}/sub/optimizer.pt", f"{tmp}/sub", tmp):
        assert _index(events, "fsync", path, "") < rename, f"{path} not fsynced before the rename"
    assert ("fsync", str(final.parent), "") in events[rename + 1 :], "the parent was not fsynced after the rename"


def test_replacing_a_checkpoint_is_fsynced_too(tmp_path, events):
    final = tmp_path / "0001"
    for content in ("old", "new"):
        with atomic_dir(final) as tmp:
            (tmp / "a").write_text(content)
    last_rename = max(i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(final))
    assert ("fsync", str(tmp_path), "") in events[last_rename + 1 :]
    assert (final / "a").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["0001"]


def test_a_small_file_is_fsynced_then_its_directory(tmp_path, events):
    target = tmp_path / "model.json"
    atomic_write_text(target, "{}")
    [(_, tmp, _)] = [e for e in events if e[0] == "rename"]
    rename = _index(events, "rename", tmp, str(target))
    assert _index(events, "fsync", tmp, "") < rename
    assert ("fsync", str(tmp_path), "") in events[rename + 1 :]


def test_an_append_is_fsynced_and_a_new_file_its_directory(tmp_path, events):
    path = tmp_path / "history.jsonl"
    append_jsonl(path, [{"step": 1}])
    assert events == [("fsync", str(path), ""), ("fsync", str(tmp_path), "")]
    events.clear()
    append_jsonl(path, [{"step": 2}])
    assert events == [("fsync", str(path), "")]
