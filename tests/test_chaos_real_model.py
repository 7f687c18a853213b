"""Chaos, short version (``make chaos`` runs the long one): a real training loop SIGKILLed in each short phase.

The child (``chaos_loop.py``) trains a model served by the transformers server; it is killed
inside the commit (save), the hot-load and ``model.log``, each time rerun, and finally run to
completion.  ``history.jsonl`` must then hold every step once, every checkpoint load with peft,
every step's trajectories be there and no temp file remain.

``make test`` runs the tiny configuration: the child's model is the session's tiny random Llama
(``conftest.tiny_llama``, shared by both tests; the run directory, the commit, the hot-load and
``model.log`` are the same code whatever the weights, and a child runs in ~5 s instead of ~17 s),
one kill in each short phase.  ``TRACERL_FULL=1`` (``make test-long``) runs the full one:
SmolLM2-135M, and a fourth kill at a random instant of its ~17 s run.
"""

from __future__ import annotations

import json

import pytest

from chaos import run_chaos
from suite_size import FULL

pytestmark = [pytest.mark.real_model] if FULL else []


@pytest.fixture(scope="module")
def chaos_model(request) -> dict:
    """``run_chaos``'s model: SmolLM2-135M under ``TRACERL_FULL=1``, else the tiny Llama."""
    return {"base_model": "smollm2-135m" if FULL else str(request.getfixturevalue("tiny_llama"))}


def test_a_training_loop_killed_in_each_short_phase_loses_nothing(tmp_path, chaos_model):
    targets = ["save", "hotload", "log_train"] + ([None] if FULL else [])  # None: a random instant
    result = run_chaos(tmp_path, len(targets), seed=1, targets=targets, **chaos_model)
    assert result["passed"], json.dumps({k: v for k, v in result.items() if k != "kill_log"}, indent=2)
    assert result["kills"] == len(targets) and {"save", "hotload", "log_train"} <= set(result["landed"]), result["landed"]


def test_the_pipelined_loop_killed_in_each_short_phase_loses_nothing_and_trains_nothing_twice(tmp_path, chaos_model):
    targets = ["save", "log_train", "hotload"] + ([None] if FULL else [])
    result = run_chaos(tmp_path, len(targets), seed=2, targets=targets, pipelined=True, **chaos_model)
    assert result["passed"], json.dumps({k: v for k, v in result.items() if k != "kill_log"}, indent=2)
    assert result["checks"]["no_trajectory_trained_twice"] and result["kills"] == len(targets)
