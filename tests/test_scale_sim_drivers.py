"""``bench/scale_sim.py --driver-processes 2 --profile DIR``: the rollouts split over two driver processes
against one router (every rollout measured, none lost), and a CPU profile of each process summarised by
component (tracerl's own work apart from the OpenAI SDK's, the HTTP layers' and the simulator's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_rollouts_over_two_driver_processes_with_profiles(tmp_path):
    out = tmp_path / "sim.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale_sim.py"), "--configs", "2x32", "--tokens", "2", "--turns", "2",
         "--rate-at-knee", "4000", "--workloads", "measured", "--start-spread-s", "0.1", "--driver-processes", "2",
         "--profile", str(tmp_path / "prof"), "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (result,) = json.loads(out.read_text())["results"]
    assert result["driver_processes"] == 2 and result["rollouts"] == 32 and result["trajectories"] == 32
    assert result["exceptions"] == 0 and result["replicas_used"] == 2
    profile = result["profile"]
    assert len(profile["driver"]["files"]) == 2  # one profile per driver process, merged
    for name in ("driver", "router", "replicas"):
        assert abs(sum(profile[name]["self_share"].values()) - 1.0) < 1e-6
    assert "OpenAI SDK" in profile["driver"]["self_share"] and "tracerl" in profile["router"]["self_share"]
    assert any("cluster/app.py" in f["function"] for f in profile["router"]["tracerl_top_self"])
