"""``bench/scale_sim.py`` keeps working: a tiny run (2 replicas, 16 rollouts, short calls) through the real router,
in both workloads (synchronised, and measured completion lengths with staggered starts)."""

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
         "--rate-at-knee", "4000", "--workloads", "synchronised,measured", "--start-spread-s", "0.1", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = json.loads(out.read_text())["results"]
    assert [r["workload"] for r in results] == ["synchronised", "measured"]
    for result in results:
        assert result["replicas"] == 2 and result["rollouts"] == 16 and result["trajectories"] == 16
        assert result["exceptions"] == 0
        assert result["replicas_used"] == 2  # least-loaded spread the two groups over both replicas
        assert result["requests_per_replica_min"] > 0
        assert result["engine_s_median"] > 0 and result["rollout_wall_s_median"] >= result["engine_s_median"]
        assert {"driver_cpu_ms_per_call", "router_cpu_ms_per_call", "replicas_cpu_ms_per_call"} <= result.keys()
    assert "| workload | replicas | concurrent rollouts |" in proc.stdout
