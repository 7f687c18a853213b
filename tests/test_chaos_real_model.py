"""Chaos, short version (``make chaos`` runs the long one): a real training loop SIGKILLed in each short phase.

The child (``chaos_loop.py``) trains SmolLM2-135M served by the transformers server; it is
killed inside the commit (save), the hot-load, ``model.log`` and at a random instant, each
time rerun, and finally run to completion.  ``history.jsonl`` must then hold every step once,
every checkpoint load with peft, every step's trajectories be there and no temp file remain.
"""

from __future__ import annotations

import json

import pytest

from chaos import run_chaos

pytestmark = pytest.mark.real_model


def test_a_training_loop_killed_in_each_short_phase_loses_nothing(tmp_path):
    result = run_chaos(tmp_path, 4, seed=1, targets=["save", "hotload", "log_train", None])
    assert result["passed"], json.dumps({k: v for k, v in result.items() if k != "kill_log"}, indent=2)
    assert result["kills"] == 4 and {"save", "hotload", "log_train"} <= set(result["landed"]), result["landed"]


def test_the_pipelined_loop_killed_in_each_short_phase_loses_nothing_and_trains_nothing_twice(tmp_path):
    result = run_chaos(tmp_path, 4, seed=2, targets=["save", "log_train", "hotload", None], pipelined=True)
    assert result["passed"], json.dumps({k: v for k, v in result.items() if k != "kill_log"}, indent=2)
    assert result["checks"]["no_trajectory_trained_twice"] and result["kills"] == 4
