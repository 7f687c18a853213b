"""Worker processes kept for a run, each talking to the parent over its own socket pair.

:class:`RankPool` starts ``world`` copies of ``python -m MODULE`` once (each told its rank,
the world size and where its end of the channel is through environment variables) and then
sends them commands: every rank gets the same ``(command, payload)``, answers with one reply,
and the parent collects the replies.  Messages are length-prefixed pickles between two
processes of ours on one machine.

Nothing waits forever.  Every wait has a deadline, and while it waits the parent watches every
rank's process: a rank that exits (killed, out of memory, a crash in native code) is an
:class:`~tracerl.errors.InfrastructureError` within about a second, naming the rank, its exit
code and the end of its log, and the pool then stops the other ranks (they may be waiting for
the dead one inside a collective).  :meth:`RankPool.close` asks each rank to stop, then ends
what is left by process id (SIGTERM, then SIGKILL); it also runs when the pool is garbage
collected or the interpreter exits.  A rank whose parent dies reads end-of-file on its channel
and exits.

Why processes we start ourselves and not ``torch.multiprocessing`` or ``torchrun``: spawned
processes re-import the user's ``__main__`` (a script without a ``__main__`` guard would run
again in every rank), and torchrun puts an agent process between the parent and the ranks, so
the parent could neither see a rank die nor stop it by its id.  The ranks follow torchrun's
environment contract (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).
"""

from __future__ import annotations

import os
import pickle
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import weakref
from typing import Any, Callable, Sequence

from .. import errors
from ..errors import InfrastructureError, TracerlError

CHANNEL_FD = "TRACERL_RANK_CHANNEL_FD"
"""The environment variable naming a rank's end of its socket pair (a file descriptor)."""

_HEADER = struct.Struct("!Q")
_TICK = 0.5  # seconds between liveness checks while waiting


# -- messages -----------------------------------------------------------------------
def send_message(sock: socket.socket, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)))
    sock.sendall(data)


def recv_message(sock: socket.socket) -> Any:
    """The next message (blocking); ``EOFError`` when the other end is gone."""
    (size,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    return pickle.loads(_recv_exactly(sock, size))


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the channel was closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def describe_error(error: BaseException) -> tuple[str, str, dict[str, Any]]:
    """``(type name, message, attributes)``: what :func:`rebuild_error` needs to raise it again elsewhere."""
    attributes = {}
    for key, value in vars(error).items():
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001 - an attribute that cannot travel is left behind
            continue
        attributes[key] = value
    return type(error).__name__, str(error), attributes


def rebuild_error(description: Sequence[Any], *, prefix: str = "") -> TracerlError:
    """The error :func:`describe_error` described: the same :mod:`tracerl.errors` type with its
    keyword attributes (``sequences``, ``adapter_changed``, ``metrics``...), else a ``TracerlError``
    that names the original type."""
    kind, message, attributes = description
    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, TracerlError):
        try:
            return cls(prefix + message, **attributes)
        except TypeError:
            try:
                return cls(prefix + message)
            except TypeError:
                pass
    return TracerlError(f"{kind}: {prefix}{message}")


# -- the rank's side ----------------------------------------------------------------
def serve_commands(handle: Callable[[str, Any], Any], stats: Callable[[], dict[str, Any]]) -> None:
    """A rank's loop: answer each command with ``handle(command, payload)`` until ``"stop"`` or
    until the parent is gone.  Every reply carries ``stats()``; an error is sent back described."""
    sock = socket.socket(fileno=int(os.environ[CHANNEL_FD]))
    try:
        while True:
            try:
                command, payload = recv_message(sock)
            except (EOFError, OSError):
                return  # the parent is gone: nobody is left to answer
            if command == "stop":
                send_message(sock, {"ok": True, "result": None, "stats": stats()})
                return
            try:
                reply = {"ok": True, "result": handle(command, payload)}
            except Exception as error:  # noqa: BLE001 - the parent raises it
                reply = {"ok": False, "error": describe_error(error)}
            reply["stats"] = stats()
            send_message(sock, reply)
    finally:
        sock.close()


# -- the parent's side --------------------------------------------------------------
class _Processes:
    """The started ranks and their channels; :meth:`stop` is the pool's finalizer (it holds no pool)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.socks: list[socket.socket] = []
        self.logs: list[str] = []
        self.folder = tempfile.mkdtemp(prefix="tracerl-ranks-")

    def stop(self, grace: float = 10.0) -> None:
        for sock, proc in zip(self.socks, self.procs):
            if proc.poll() is None:
                try:
                    sock.settimeout(1.0)
                    send_message(sock, ("stop", None))
                except OSError:
                    pass
        deadline = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for sock in self.socks:
            sock.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def log_tail(self, rank: int, size: int = 3000) -> str:
        try:
            with open(self.logs[rank], "rb") as f:
                f.seek(max(0, os.path.getsize(self.logs[rank]) - size))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""


class RankPool:
    """``world`` processes running ``python -m module``, started once and kept until :meth:`close`."""

    def __init__(self, module: str, world: int, *, env: Callable[[int], dict[str, str]], what: str = "rank") -> None:
        """``env(rank)``: the variables rank ``rank`` needs beside the parent's own environment."""
        self.world, self.what = world, what
        self.failure: str | None = None
        self.stats: list[dict[str, Any]] = [{} for _ in range(world)]
        self._processes = processes = _Processes()
        self._finalizer = weakref.finalize(self, processes.stop)
        try:
            for rank in range(world):
                parent_end, child_end = socket.socketpair()
                log_path = os.path.join(processes.folder, f"rank-{rank}.log")
                with open(log_path, "wb") as log:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", module],
                        env={**os.environ, **env(rank), CHANNEL_FD: str(child_end.fileno())},
                        pass_fds=(child_end.fileno(),), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    )  # fmt: skip
                child_end.close()  # only the rank holds its end: the rank's exit is an end-of-file here
                processes.procs.append(proc)
                processes.socks.append(parent_end)
                processes.logs.append(log_path)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._processes.procs]

    def call(self, command: str, payload: Any = None, *, timeout: float, ranks: Sequence[int] | None = None) -> list[Any]:
        """Send ``(command, payload)`` to ``ranks`` (default: all) and return their results in rank order.

        A rank's own error is raised as its type (:func:`rebuild_error`; the lowest failing rank's);
        a rank that died, or no answer within ``timeout`` seconds, is an ``InfrastructureError``
        and stops the pool."""
        if self.failure is not None:
            raise InfrastructureError(f"the data-parallel {self.what}s were stopped after an earlier failure: {self.failure}")
        ranks = list(range(self.world)) if ranks is None else list(ranks)
        deadline = time.monotonic() + timeout
        try:
            for rank in ranks:
                sock = self._processes.socks[rank]
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    send_message(sock, (command, payload))
                except (OSError, socket.timeout) as error:
                    self._lost(rank, command, f"could not be sent {command!r} ({type(error).__name__}: {error})")
            replies = self._gather(ranks, command, deadline, timeout)
        except BaseException as error:
            if not isinstance(error, InfrastructureError):  # interrupted mid-call: the ranks are out of step with us
                self.failure = f"{command!r} was interrupted ({type(error).__name__})"
            self.close()
            raise
        for rank in ranks:
            self.stats[rank] = replies[rank].get("stats", {})
        failed = [rank for rank in ranks if not replies[rank]["ok"]]
        if failed:
            raise rebuild_error(replies[failed[0]]["error"])
        return [replies[rank]["result"] for rank in ranks]

    def _gather(self, ranks: list[int], command: str, deadline: float, timeout: float) -> dict[int, dict[str, Any]]:
        """One reply from each of ``ranks``, read side by side while every rank's process is watched."""
        socks = self._processes.socks
        buffers = {rank: bytearray() for rank in ranks}
        replies: dict[int, dict[str, Any]] = {}
        for rank in ranks:
            socks[rank].setblocking(False)
        try:
            while len(replies) < len(ranks):
                for rank, proc in enumerate(self._processes.procs):
                    if proc.poll() is not None:  # any rank: the others may be waiting for it in a collective
                        self._lost(rank, command, f"exited with code {proc.returncode}")
                left = deadline - time.monotonic()
                if left <= 0:
                    waiting = sorted(set(ranks) - set(replies))
                    self._lost(waiting[0], command, f"did not answer within {timeout:g} s")
                pending = {socks[rank]: rank for rank in ranks if rank not in replies}
                readable, _, _ = select.select(list(pending), [], [], min(_TICK, left))
                for sock in readable:
                    rank = pending[sock]
                    try:
                        chunk = sock.recv(1 << 20)
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:  # reset by a rank that died: as an end-of-file
                        chunk = b""
                    if not chunk:
                        proc = self._processes.procs[rank]
                        try:
                            code = proc.wait(timeout=2)
                        except subprocess.TimeoutExpired:
                            code = None
                        self._lost(rank, command, "closed its channel" if code is None else f"exited with code {code}")
                    buffers[rank] += chunk
                    buffer = buffers[rank]
                    if len(buffer) >= _HEADER.size:
                        (size,) = _HEADER.unpack_from(buffer)
                        if len(buffer) >= _HEADER.size + size:
                            replies[rank] = pickle.loads(bytes(buffer[_HEADER.size : _HEADER.size + size]))
        finally:
            for rank in ranks:
                if socks[rank].fileno() != -1:  # not closed by a failure
                    socks[rank].setblocking(True)
        return replies

    def _lost(self, rank: int, command: str, what: str) -> None:
        proc = self._processes.procs[rank]
        tail = self._processes.log_tail(rank)
        self.failure = f"data-parallel {self.what} {rank} (pid {proc.pid}) {what} during {command!r}"
        message = self.failure + "; the other ranks were stopped" + (f". Its log ends:\n{tail}" if tail.strip() else "")
        self.close()
        raise InfrastructureError(message)

    def close(self) -> None:
        """Stop every rank (asked first, then by process id) and forget them; safe to call twice."""
        if self.failure is None:
            self.failure = "the ranks were closed"
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive
