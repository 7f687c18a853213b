"""``examples/agents_sdk_learns.py`` in a tiny configuration: an OpenAI Agents SDK agent (``Runner.run``,
a function tool, the SDK's default Responses model) captured and trained a step on the real model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("agents")
pytest.importorskip("torch")
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "agents_sdk_learns.py"


async def test_the_example_trains_a_step(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("agents_sdk_learns", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # type: ignore[union-attr]
    args = example.parse_args(["--steps", "1", "--rollouts", "2", "--groups-per-step", "1", "--val-tasks", "1",
                               "--eval-every", "1", "--inference", "transformers", "--data", str(tmp_path)])  # fmt: skip
    await example.main(args)
    out = capsys.readouterr().out
    assert "held-out reward at step 0:" in out and "held-out reward at step 1:" in out
    history = (tmp_path / "agents-sdk" / "models" / "agents-sdk-s0" / "history.jsonl").read_text()
    assert '"train/reward"' in history  # the step's rollouts were logged: they became trajectories
