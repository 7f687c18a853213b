"""Each side of a side-by-side benchmark runs in its own process (its memory measured alone).

The script re-runs itself with ``--worker SIDE``; the worker prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def run_worker(script: str, side: str) -> dict[str, Any]:
    """Run ``script --worker side`` with this process's arguments; its ``RESULT`` JSON, or exit with its output."""
    cmd = [sys.executable, os.path.abspath(script), "--worker", side] + sys.argv[1:]
    print(f"running {side} ...", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n")
        raise SystemExit(f"{side} worker failed (rc {proc.returncode})")
    return json.loads(line[len("RESULT ") :])
