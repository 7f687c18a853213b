"""Storage under SIGKILL: a real child process kills itself between two file operations, then a rerun.

The child (``storage_kill_child.py``) runs real ``LocalBackend``/``model.log``/``atomic_dir``
code on a run directory; no model is loaded (a planted checkpoint 0 and all-equal rewards,
which ``train`` commits by copying the adapter forward).  After each kill the tests check
what a user would: every step's history row exactly once, its trajectories present, every
checkpoint complete, no temp files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import tracerl
from tracerl.runs.storage import RunDir

CHILD = Path(__file__).with_name("storage_kill_child.py")


class ForkServer:
    """The child script's fork server: imports once, then forks a fresh process for each run (a kill costs ms, not an import of torch)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.runs = 0

    def run(self, base: Path, *args: str, kill_at: str = "") -> tuple[int, dict | None, str]:
        self.runs += 1
        log = self.logs / f"run-{self.runs}.log"
        self.proc.stdin.write(json.dumps({"argv": [str(base), *args], "kill_at": kill_at, "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        assert answer, "the fork server died"
        reply = json.loads(answer)
        return reply["returncode"], reply["result"], log.read_text()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def forks(tmp_path_factory):
    server = ForkServer(tmp_path_factory.mktemp("child-logs"))
    yield server
    server.close()


@pytest.fixture()
def child(forks):
    """``child(base, scenario, *args, kill_at=SPEC)``: run the scenario in a fresh process; it must die by SIGKILL iff a kill was asked."""

    def run(base: Path, *args: str, kill_at: str = "") -> dict | None:
        returncode, result, log = forks.run(base, *args, kill_at=kill_at)
        expected = -signal.SIGKILL if kill_at and kill_at != "count" else 0
        assert returncode == expected, f"rc={returncode} (kill_at={kill_at!r})\n{log[-3000:]}"
        return result

    return run


def run_dir(base: Path) -> RunDir:
    return RunDir(base, "faults", "m")


def temp_files(base: Path) -> list[Path]:
    return [p for p in base.rglob("*") if p.name.startswith((".tmp-", ".old-"))]


def assert_complete(base: Path, last: int) -> None:
    """What a finished run must hold: each step's rows once, its trajectories, whole checkpoints, no temp files."""
    run = run_dir(base)
    report = run.history_report()
    assert report.skipped == []
    counts = Counter((row["step"], split) for row in report.rows for split in {k.split("/")[0] for k in row if "/" in k})
    assert counts == Counter({**{(s, "train"): 1 for s in range(1, last + 1)}, **{(s, "val"): 1 for s in range(last + 1)}})
    assert run.checkpoint_steps() == list(range(last + 1))
    for step in range(last + 1):
        assert sorted(p.name for p in run.checkpoint_path(step).iterdir()) >= ["adapter_config.json", "adapter_model.safetensors"]
        assert run.trajectories_path("val", step).exists()
    for step in range(1, last + 1):
        rows = run.trajectories_path("train", step).read_text().splitlines()
        assert [json.loads(r)["messages_and_choices"][0]["content"] for r in rows] == [f"task {step}.0", f"task {step}.1"]
    assert temp_files(base) == []


def test_a_step_killed_between_train_and_log_is_recovered_on_resume(tmp_path, child):
    """Killed right after checkpoint 0002 was renamed into place, before ``model.log``: the row is not lost."""
    child(tmp_path, "steps", "3", kill_at="after:rename:checkpoints/0002:1")
    assert [r["step"] for r in run_dir(tmp_path).read_history() if "train/reward" in r] == [1]
    child(tmp_path, "steps", "3")
    assert_complete(tmp_path, 3)
    [row] = [r for r in run_dir(tmp_path).read_history() if r["step"] == 2 and "train/reward" in r]
    assert row["recovered"] is True and row["train/num_trajectories"] == 2.0 and "train/num_groups_trainable" in row


def test_a_step_killed_before_its_commit_leaves_nothing_behind(tmp_path, child):
    """Killed just before checkpoint 0002's rename: its trajectories and temp dir are orphans, cleaned on resume."""
    child(tmp_path, "steps", "2", kill_at="before:rename:checkpoints/0002:1")
    run = run_dir(tmp_path)
    assert run.latest_step() == 1 and run.trajectories_path("train", 2).exists() and temp_files(tmp_path)
    child(tmp_path, "steps", "1")  # a rerun that only resumes
    assert not run.trajectories_path("train", 2).exists() and temp_files(tmp_path) == []
    assert_complete(tmp_path, 1)


def test_killed_at_every_file_operation_a_rerun_completes_the_run(tmp_path, child):
    """SIGKILL before each file operation of two steps (train, commit, both logs) in turn; rerun; check."""
    total = child(tmp_path / "count", "steps", "2", kill_at="count")["ops"]
    assert total > 10
    for n in range(1, total + 1):
        base = tmp_path / f"kill-{n}"
        child(base, "steps", "2", kill_at=str(n))
        child(base, "steps", "2")
        assert_complete(base, 2)


def test_overwriting_a_checkpoint_killed_at_any_operation_keeps_the_old_or_the_new(tmp_path, child):
    """Replacing an existing checkpoint, killed before each file operation in turn: the old or the new one survives."""
    total = child(tmp_path / "count", "overwrite", kill_at="count")["ops"]
    for n in range(1, total + 1):
        base = tmp_path / f"kill-{n}"
        child(base, "overwrite", kill_at=str(n))
        run = run_dir(base)
        run.repair()
        assert temp_files(base) == []
        if not run.checkpoint_path(1).exists():
            assert n <= 4, f"killed at operation {n}: checkpoint 0001 is gone"  # the first version's own write
            continue
        contents = {(run.checkpoint_path(1) / part).read_text() for part in ("adapter_model.safetensors", "adapter_config.json")}
        assert contents in ({"old"}, {"new"}), f"killed at operation {n}: {contents}"


def test_overwrite_killed_between_its_renames_restores_the_old_checkpoint(tmp_path, child):
    """The exact instant ``atomic_dir`` used to leave neither: old removed, new not yet renamed in."""
    child(tmp_path, "overwrite", kill_at="before:rename:checkpoints/0001:2")
    run = run_dir(tmp_path)
    run.repair()
    assert (run.checkpoint_path(1) / "adapter_model.safetensors").read_text() == "old"
    assert temp_files(tmp_path) == []


def test_a_kill_mid_delete_never_leaves_a_half_deleted_checkpoint(tmp_path, child):
    child(tmp_path, "steps", "3")
    child(tmp_path, "delete", kill_at="after:unlink::2")  # two files of checkpoint 0000 gone, more to go
    child(tmp_path, "steps", "3")
    run = run_dir(tmp_path)
    for step in run.checkpoint_steps():
        names = {p.name for p in run.checkpoint_path(step).iterdir()}
        assert {"adapter_config.json", "adapter_model.safetensors"} <= names, f"checkpoint {step} is half deleted"
    assert run.checkpoint_steps() == [1, 2, 3]  # the kill landed in deleting 0000
    assert temp_files(tmp_path) == []


def test_register_removes_stray_temp_files_everywhere(tmp_path, child):
    child(tmp_path, "steps", "1")
    run = run_dir(tmp_path)
    planted = [
        run.root / ".tmp-abc.json",
        run.checkpoints / ".tmp-xyz",
        run.checkpoints / ".tmp-del-0000-1234",
        run.root / "trajectories" / "val" / ".tmp-q.jsonl",
        run.root / "trajectories" / "train" / ".tmp-r.jsonl",
    ]
    for path in planted:
        if path.suffix:
            path.write_text("partial")
        else:
            path.mkdir()
            (path / "adapter_model.safetensors").write_text("partial")
    run.trajectories_path("train", 7).write_text("{}\n")  # an uncommitted step's trajectories
    child(tmp_path, "steps", "1")
    assert temp_files(tmp_path) == [] and not run.trajectories_path("train", 7).exists()
    assert_complete(tmp_path, 1)


# -- the run lock ---------------------------------------------------------------------------------
def _holder(base: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(CHILD), str(base), "hold"], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line, "the holder died before taking the lock"
    return proc


async def _register(base: Path) -> tuple[tracerl.TrainableModel, tracerl.LocalBackend]:
    model = tracerl.TrainableModel("m", "faults", str(base / "base-model"), base_path=base)
    backend = tracerl.LocalBackend(inference=None)
    await model.register(backend)
    return model, backend


def test_a_second_trainer_fails_at_once_naming_the_holder_and_recovers_from_a_dead_one(tmp_path, child):
    import asyncio
    import socket

    proc = _holder(tmp_path)
    try:
        with pytest.raises(tracerl.RunLockedError, match=f"pid {proc.pid} on host {socket.gethostname()}") as info:
            asyncio.run(_register(tmp_path))
        assert info.value.pid == proc.pid and isinstance(info.value, RuntimeError)
        assert (run_dir(tmp_path).checkpoints / ".tmp-in-flight").is_dir(), "the holder's in-flight write was touched"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    async def after_the_holder_died():
        model, backend = await _register(tmp_path)
        holder = json.loads((model.run_dir.root / "run.lock").read_text())
        await backend.close()
        return holder

    assert asyncio.run(after_the_holder_died())["pid"] == os.getpid()
    assert not (run_dir(tmp_path).checkpoints / ".tmp-in-flight").exists()  # stale now: cleaned


def test_close_releases_the_lock_within_one_process(tmp_path, child):
    import asyncio

    child(tmp_path, "steps", "1")

    async def scenario():
        first_model, first = await _register(tmp_path)
        with pytest.raises(tracerl.RunLockedError, match="this process"):
            await _register(tmp_path)
        await first.close()
        model, second = await _register(tmp_path)
        await second.train(model, [tracerl.TrajectoryGroup([tracerl.Trajectory(messages_and_choices=[], reward=1.0)] * 2)])
        group = tracerl.TrajectoryGroup([tracerl.Trajectory(messages_and_choices=[], reward=1.0)] * 2)
        with pytest.raises(tracerl.RunLockedError):
            await first.train(first_model, [group])  # the closed backend cannot train while the second holds the lock
        assert await first.get_step(first_model) == 2  # reading needs no lock
        await second.close()
        return (await first.train(first_model, [group])).step  # ...and trains again once the lock is free

    assert asyncio.run(scenario()) == 3


def test_a_failed_registration_leaves_the_lock_free(tmp_path, child):
    import asyncio

    child(tmp_path, "steps", "1")

    async def scenario():
        broken = tracerl.TrainableModel("m", "faults", str(tmp_path / "no-such-model"), base_path=tmp_path)
        with pytest.raises(tracerl.ConfigError):
            await tracerl.LocalBackend(inference=None).register(broken)  # never closed
        model, backend = await _register(tmp_path)
        await backend.close()
        return await model.get_step()

    assert asyncio.run(scenario()) == 1
