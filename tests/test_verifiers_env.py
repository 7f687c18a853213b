"""verifiers: an environment written with verifiers' own v1 API, run by verifiers in its own venv
(``.venv-verifiers``, ``make install-verifiers``), trained a step through the rollout gateway
(``examples/verifiers_env/``).

Each rollout is a ``run_rollout.py`` process pointed at its rollout's gateway: the model calls
verifiers makes come back as sampled turns with token ids, the environment's score is the
reward, its metrics the trajectory's.  A verifiers process whose endpoint is gone is an
``InfrastructureError`` in its group.
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

import tracerl

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "verifiers_env" / "train.py"


def _example():
    spec = importlib.util.spec_from_file_location("verifiers_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    if not module.VERIFIERS_PYTHON.exists():
        pytest.fail(f"{module.VERIFIERS_PYTHON} is missing: `make install-verifiers` (make test runs it)")
    return module


@pytest.mark.real_model
def test_a_verifiers_environment_trains_a_step_through_the_gateway(tmp_path, capsys):
    example = _example()
    asyncio.run(example.main(example.parse_args(["--steps", "1", "--groups", "2", "--rollouts", "3", "--data", str(tmp_path)])))
    assert "step 1: reward" in capsys.readouterr().out
    from tracerl.integrations.importers import read_jsonl
    from tracerl.runs.storage import RunDir

    run = RunDir(tmp_path, "verifiers", "arithmetic-s0")
    trajectories = read_jsonl(run.trajectories_path("train", 1))
    assert len(trajectories) == 6
    for t in trajectories:
        [turn] = t.sampled_turns()  # verifiers' one chat request, captured by the gateway
        assert turn.token_ids and turn.logprobs and len(turn.token_ids) == len(turn.logprobs)
        assert t.reward in (0.0, 1.0) and t.metrics["has_number"] in (0.0, 1.0)
        expected = example_answer(t.messages_and_choices[-2]["content"])
        assert t.reward == float(_last_int(turn.message.get("content") or "") == expected)  # the environment's own score
    [row] = [r for r in run.read_history() if "train/reward" in r]
    assert row["step"] == 1


@pytest.mark.real_model
def test_a_verifiers_process_past_its_timeout_is_killed_and_is_an_infrastructure_error(tmp_path):
    example = _example()

    async def run() -> tracerl.TrajectoryGroup:
        model = tracerl.TrainableModel("slow", "tests", "smollm2-135m", base_path=tmp_path)
        backend = tracerl.LocalBackend(inference="transformers")
        await model.register(backend)
        try:  # importing verifiers alone takes ~3 s: a 1 s limit always fires
            [group] = await tracerl.gather_trajectory_groups(
                [tracerl.TrajectoryGroup([example.rollout(model, 0, timeout=1)])], pbar_desc=None, max_exceptions=1
            )
            return group
        finally:
            await backend.close()

    group = asyncio.run(run())
    assert group.trajectories == [] and [e.type for e in group.exceptions] == ["InfrastructureError"]
    assert "ran past 1 s" in group.exceptions[0].message


def example_answer(prompt: str) -> int:
    a, b = (int(x) for x in prompt.removeprefix("What is ").split("?")[0].split(" + "))
    return a + b


def _last_int(text: str) -> int | None:
    import re

    found = re.findall(r"-?\d+", text.replace(",", ""))
    return int(found[-1]) if found else None
