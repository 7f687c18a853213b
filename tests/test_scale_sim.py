"""``bench/scale_sim.py`` keeps working: a tiny run (2 replicas, 16 rollouts, 1-token calls) through the real router."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_scale_sim_runs_the_router_and_gather_over_simulated_replicas(tmp_path):
    out = tmp_path / "sim.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale_sim.py"), "--configs", "2x16", "--tokens", "2", "--turns", "2",
         "--rate-at-knee", "4000", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    [result] = json.loads(out.read_text())["results"]
    assert result["replicas"] == 2 and result["rollouts"] == 16 and result["trajectories"] == 16
    assert result["exceptions"] == 0
    assert result["replicas_used"] == 2  # least-loaded spread the two groups over both replicas
    assert result["requests_per_replica_min"] > 0
    assert result["engine_s_median"] > 0 and result["rollout_wall_s_median"] >= result["engine_s_median"]
    assert "| replicas | concurrent rollouts |" in proc.stdout
