"""Child process for the storage fault tests: runs real tracerl storage code and SIGKILLs itself mid-write.

    python storage_kill_child.py BASE SCENARIO [ARGS]
    python storage_kill_child.py --serve        (a fork server: see :func:`serve`)

Scenarios (no model is loaded: a planted checkpoint 0 and steps whose rewards are all equal,
which ``LocalBackend.train`` commits by copying the previous adapter forward):

* ``steps N``: register, then up to step N: ``train`` + ``model.log(train)`` + ``model.log(val)``
* ``overwrite``: write checkpoint 0001 ("old"), then replace it ("new") with ``atomic_dir``
* ``delete``: ``delete_checkpoints`` of steps 1 and 2 (run ``steps 3`` first)
* ``hold``: register, plant an in-flight temp dir, print ``ready`` and sleep until killed

``KILL_AT`` picks the instant, counted over the patched file operations (``os.rename``,
``os.replace``, ``os.fsync``, ``os.write``, ``os.unlink``, ``os.rmdir``) made after
registration: ``N`` kills before the N-th of them; ``before:OP:SUFFIX:N`` / ``after:OP:SUFFIX:N``
kill around the N-th ``OP`` (``rename`` covers ``replace``) whose destination (or path) ends
with SUFFIX.  ``KILL_AT=count`` reports the number of operations instead.  The patches live
here, in the test's child, never in tracerl.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import tracerl
from tracerl.runs.storage import RunDir, atomic_dir

PROJECT, NAME = "faults", "m"
SPEC = os.environ.get("KILL_AT", "")
_ops = {"count": 0, "armed": False, "matches": 0}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _target(op: str, args: tuple) -> str:
    path = args[1] if op in ("rename", "replace") else args[0]
    return os.fspath(path) if isinstance(path, (str, os.PathLike)) else f"fd:{path}"


def _patch(op: str) -> None:
    real = getattr(os, op)

    def patched(*args, **kwargs):
        if not _ops["armed"]:
            return real(*args, **kwargs)
        _ops["count"] += 1
        if SPEC in ("", "count"):
            return real(*args, **kwargs)
        if SPEC.isdigit():
            if _ops["count"] == int(SPEC):
                _die()
            return real(*args, **kwargs)
        when, kind, suffix, nth = SPEC.split(":")
        hit = kind == ("rename" if op == "replace" else op) and _target(op, args).endswith(suffix)
        if hit:
            _ops["matches"] += 1
            hit = _ops["matches"] == int(nth)
        if hit and when == "before":
            _die()
        result = real(*args, **kwargs)
        if hit:
            _die()
        return result

    setattr(os, op, patched)


for _op in ("rename", "replace", "fsync", "write", "unlink", "rmdir"):
    _patch(_op)


def plant_checkpoint_zero(base: Path) -> None:
    """A stand-in base model folder and adapter, so that registering loads nothing."""
    (base / "base-model").mkdir(parents=True, exist_ok=True)
    (base / "base-model" / "config.json").write_text("{}")
    run = RunDir(base, PROJECT, NAME)
    if run.latest_step() is None:
        with atomic_dir(run.checkpoint_path(0)) as tmp:
            (tmp / "adapter_model.safetensors").write_text("weights-0")
            (tmp / "adapter_config.json").write_text("{}")


def group(step: int, n: int = 2) -> tracerl.TrajectoryGroup:
    return tracerl.TrajectoryGroup(
        [tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": f"task {step}.{i}"}], reward=0.5) for i in range(n)]
    )


async def register(base: Path) -> tuple[tracerl.TrainableModel, tracerl.LocalBackend]:
    plant_checkpoint_zero(base)
    model = tracerl.TrainableModel(NAME, PROJECT, str(base / "base-model"), base_path=base)
    backend = tracerl.LocalBackend(inference=None)
    await model.register(backend)
    return model, backend


async def steps(base: Path, last: int) -> None:
    model, backend = await register(base)
    _ops["armed"] = True
    step = await model.get_step()
    await model.log([group(step, 1)], split="val", step=step)  # idempotent: a rerun does not write it twice
    while step < last:
        groups = [group(step + 1)]
        result = await backend.train(model, groups)
        await model.log(groups, split="train", metrics=result.metrics, step=result.step)
        step = result.step
        await model.log([group(step, 1)], split="val", step=step)
    await backend.close()


def overwrite(base: Path) -> None:
    _ops["armed"] = True
    run = RunDir(base, PROJECT, NAME)
    for content in ("old", "new"):
        with atomic_dir(run.checkpoint_path(1)) as tmp:
            for part in ("adapter_model.safetensors", "adapter_config.json"):
                (tmp / part).write_text(content)


async def delete(base: Path) -> None:
    model, backend = await register(base)
    _ops["armed"] = True
    await backend.delete_checkpoints(model, keep=[])
    await backend.close()


async def hold(base: Path) -> None:
    model, _backend = await register(base)
    (model.run_dir.checkpoints / ".tmp-in-flight").mkdir()
    print(json.dumps({"pid": os.getpid()}), flush=True)
    time.sleep(3600)


def run(base: Path, scenario: str, *args: str) -> dict:
    if scenario == "steps":
        asyncio.run(steps(base, int(args[0])))
    elif scenario == "overwrite":
        overwrite(base)
    elif scenario == "delete":
        asyncio.run(delete(base))
    elif scenario == "hold":
        asyncio.run(hold(base))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    return {"ops": _ops["count"]}


def serve() -> None:
    """Fork server: one process pays for the imports (torch); each request runs in a fresh forked child.

    A request is a JSON line ``{"argv": [BASE, SCENARIO, ...], "kill_at": SPEC, "log": PATH}``;
    the answer is ``{"returncode": ..., "result": ...}`` (returncode -9: it was SIGKILLed).
    """
    global SPEC
    # one run here first, unarmed (no kill spec): what a run imports lazily (torch for a step's advantages,
    # transformers for register's memory plan; ~1 s) is then imported once, not in each of the ~90 children
    import tempfile

    with tempfile.TemporaryDirectory() as warm:
        run(Path(warm), "steps", "1")
    _ops.update(count=0, armed=False, matches=0)

    for line in sys.stdin:
        request = json.loads(line)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            code = 1
            try:
                SPEC = request["kill_at"]
                log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(log_fd, 1)
                os.dup2(log_fd, 2)
                result = run(Path(request["argv"][0]), *request["argv"][1:])
                with os.fdopen(write, "w") as out:
                    out.write(json.dumps(result))
                code = 0
            except BaseException:  # noqa: BLE001 - reported through the log file and the exit code
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(write)
        with os.fdopen(read) as got:
            result = got.read()
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status), "result": json.loads(result or "null")}), flush=True)


def main() -> None:
    if sys.argv[1:] == ["--serve"]:
        serve()
        return
    result = run(Path(sys.argv[1]), *sys.argv[2:])
    if SPEC == "count":
        print(json.dumps(result))


if __name__ == "__main__":
    main()
