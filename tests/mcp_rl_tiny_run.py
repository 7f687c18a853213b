"""One tiny real-model run of a checked-answer MCP•RL example (``tracerl.mcp_rl.checked``), checked.

``examples/mcp_rl_calculator.py`` and ``examples/mcp_rl_time_checked.py`` share their loop, so
their real-model tests share this: run the example as a user would (a subprocess, the
transformers server, seed 3), one GRPO step on 1 task × 2 attempts with a held-out eval (1 task) at
step 0, then check what the run left on disk: checkpoint 0001, the history rows, the two
judged trajectories (token ids captured, the shaped reward's metrics) and the reward curve.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_one_step(script: str, tmp_path: Path, *, run_name: str, judge: str, extra: list[str] | None = None) -> list[dict[str, Any]]:
    """Run ``examples/<script>`` for one step, assert the shared outcome, return the step's trajectories."""
    args = [
        sys.executable, str(EXAMPLES / script), "--steps", "1", "--groups-per-step", "1", "--rollouts", "2",
        "--val-tasks", "1", "--eval-every", "100", "--inference", "transformers",
        "--data", str(tmp_path / "data"), "--plot", str(tmp_path / "curve.png"), "--seed", "3", *(extra or []),
    ]  # fmt: skip
    out = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = tmp_path / "data" / "mcp-rl" / "models" / f"{run_name}-s3"
    assert (run / "checkpoints" / "0001" / "adapter_model.safetensors").exists()
    rows = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert [(row["step"], "val/reward" in row) for row in rows] == [(0, True), (1, False)]
    assert "train/reward" in rows[1] and "held-out reward: start" in out.stdout
    trajectories = [json.loads(line) for line in (run / "trajectories" / "train" / "0001.jsonl").read_text().splitlines()]
    assert len(trajectories) == 2
    for t in trajectories:
        assert t["metadata"]["judge"]["judge"] == judge and 0.0 <= t["reward"] <= 1.0
        assert t["metrics"]["capture_turns_with_token_ids"] >= 1 and {"tool_ok", "args_ok", "answer_ok"} <= set(t["metrics"])
    assert (tmp_path / "curve.png").stat().st_size > 1000
    return trajectories
