"""Read what an offline W&B run wrote: the records of its ``run-<id>.wandb`` file.

The file is W&B's transaction log: a 7-byte header (``:W&B``, magic, version), then
32 KiB blocks of LevelDB-log records (crc32c, length, type: full/first/middle/last),
each record one serialized ``wandb.proto.wandb_internal_pb2.Record``.  wandb 0.2x+ ships
no Python reader for it (its core is Go), so the tests read it here.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

_BLOCK = 32 * 1024
_HEADER = 7


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    raw = path.read_bytes()
    assert raw[:4] == b":W&B", f"{path} is not a W&B transaction log"
    out, chunk, pos = [], b"", _HEADER
    while pos + 7 <= len(raw):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # block trailer
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        pos += 7
        if kind == 0 and length == 0:  # zero padding up to the block's end
            pos += left - 7
            continue
        chunk += raw[pos : pos + length]
        pos += length
        if kind in (1, 4):  # full, last
            record = pb.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
    return out


def finished_records(run_dir: Path, timeout_s: float = 60.0) -> list[Any]:
    """The run's records once W&B has written its ``exit`` record.

    ``run.finish()`` can return before W&B's core process has flushed the offline log (seen
    here: the file still held only its header right after ``finish``), so wait for the end
    of the run rather than read a half-written file.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        logs = list(run_dir.glob("run-*.wandb"))
        found = records(logs[0]) if len(logs) == 1 else []
        if any(r.WhichOneof("record_type") == "exit" for r in found) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def history(run_dir: Path) -> list[dict[str, Any]]:
    """The ``run.log`` rows of an offline run, in order (W&B's ``_``-keys dropped)."""
    rows = []
    for record in finished_records(run_dir):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_") or k == "_step"})
    return rows
