"""RULER with the real SmolLM2-135M as the judge, served by tracerl's own transformers server.

The code path is the production one: ``tracerl.Model`` → LiteLLM → HTTP → our
OpenAI-compatible server → the real model.  A 135M model may not follow the answer
format, so the test accepts either N valid scores or the clear ``JudgeError`` raised
after the one corrective retry; anything else (a transport failure, a wrong count
slipping through, scores outside [0, 1]) fails.

Run heavy: ``flock /tmp/tracerl-heavy.lock .venv/bin/python -m pytest -q tests/test_ruler_real_model.py``.
"""

from __future__ import annotations

import importlib.util

import pytest

from tracerl import JudgeError, Model, Trajectory, TrajectoryGroup

pytestmark = [pytest.mark.real_model, pytest.mark.asyncio(loop_scope="session")]

SERVED = "smollm2-judge"
TASK = [{"role": "system", "content": "Answer the question in one word."}, {"role": "user", "content": "What is the capital of France?"}]
FINALS = ["Paris.", "London.", "I do not know."]


@pytest.fixture(scope="module")
async def judge_model(smol_path, tmp_path_factory):
    if importlib.util.find_spec("tracerl.inference.transformers_server") is None:
        pytest.skip("tracerl.inference.transformers_server does not exist yet (serving issue not merged)")
    from tracerl.inference.transformers_server import TransformersServer

    server = TransformersServer(smol_path, served_name=SERVED)
    await server.start()
    try:
        assert await server.health()
        yield Model("ruler-judge", "ruler-real", inference_base_url=server.base_url, inference_model_name=SERVED,
                    inference_api_key=server.api_key,
                    base_path=tmp_path_factory.mktemp("runs"))
    finally:
        await server.stop()


def assert_clear_judge_error(error: JudgeError) -> None:
    message = str(error)
    # the answers came back over HTTP and were judged invalid twice: not a transport failure
    assert "gave no valid scores" in message and "after one corrective retry" in message, message
    assert "last answer starts with" in message and "group" in message, message


async def test_the_real_small_model_judges_a_group_or_fails_clearly(judge_model):
    from tracerl.ruler import ruler

    params = {"max_tokens": 96, "temperature": 0.0}
    try:
        scores = await ruler([TASK + [{"role": "assistant", "content": f}] for f in FINALS], judge_model,
                             extra_litellm_params=params, cache=False)
    except JudgeError as error:
        assert_clear_judge_error(error)
        return
    assert [s.trajectory_id for s in scores] == ["1", "2", "3"]
    assert all(0.0 <= s.score <= 1.0 for s in scores)
    assert scores.metrics["ruler_judge_requests"] in (1.0, 2.0)
    assert scores.metrics["ruler_judge_prompt_tokens"] > 0 and scores.metrics["ruler_judge_completion_tokens"] > 0


async def test_ruler_score_group_with_the_real_judge(judge_model):
    from tracerl.ruler import RulerJudge

    group = TrajectoryGroup(
        [Trajectory(messages_and_choices=TASK + [{"role": "assistant", "content": f}], reward=1.0 if f == "Paris." else 0.0)
         for f in FINALS[:2]],
        metadata={"name": "capital-of-france"},
    )
    judge = RulerJudge(judge_model, extra_litellm_params={"max_tokens": 96, "temperature": 0.0}, cache=False)
    try:
        scored = await judge(group)
    except JudgeError as error:
        assert_clear_judge_error(error)
        assert "capital-of-france" in str(error)
        return
    assert scored is not None and len(scored.trajectories) == 2
    for before, after in zip(group.trajectories, scored.trajectories):
        assert 0.0 <= after.reward <= 1.0 and after.metrics["ruler_score"] == after.reward
        assert after.metrics["independent_reward"] == before.reward
