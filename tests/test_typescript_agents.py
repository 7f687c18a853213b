"""Agents in TypeScript, through a rollout's gateway: the ``openai`` npm client and a LangGraph.js graph.

The real model on the transformers server; each agent runs as a Node process (``examples/typescript``,
npm packages from ``make install-ts``) with the rollout's gateway in its environment.  Every sampled
turn of its trajectory carries the token ids and logprobs the engine sampled for that call, id for
id, and ``backend.train`` trains a step on the trajectories.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import tracerl
from capture_helpers import served_and_recorded

pytest.importorskip("torch")
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "typescript"


def _driver():
    spec = importlib.util.spec_from_file_location("typescript_train", EXAMPLE / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    async with served_and_recorded("typescript", tmp_path_factory.mktemp("runs")) as served:
        yield served


@pytest.fixture(scope="module")
async def trajectories(served):
    model, _, _ = served
    driver = _driver()
    out = {}
    for agent in ("openai", "langgraph"):
        async with tracerl.rollout(model, task=agent) as r:
            await driver.run_agent(r, model, agent, "Add 17 and 25.")
        out[agent] = r.trajectory
    return out


@pytest.mark.parametrize("agent", ["openai", "langgraph"])
def test_the_agent_becomes_a_trajectory_with_the_engine_tokens(served, trajectories, agent):
    _, _, answers = served
    trajectory = trajectories[agent]
    turns = trajectory.sampled_turns()
    assert turns and trajectory.metrics["capture_turns_without_token_ids"] == 0
    assert "Add 17 and 25." in str(trajectory.messages())
    by_tokens = {(tuple(a["prompt_token_ids"]), tuple(a["choices"][0]["token_ids"])): a for a in answers}
    for turn in turns:
        answer = by_tokens[(tuple(turn.prompt_token_ids), tuple(turn.token_ids))]
        assert turn.logprobs == [e["logprob"] for e in answer["choices"][0]["logprobs"]["content"]]


async def test_a_training_step_on_them(served, trajectories):
    model, backend, _ = served
    group = tracerl.TrajectoryGroup(list(trajectories.values()))
    for reward, trajectory in enumerate(group.trajectories):
        trajectory.reward = float(reward)  # GRPO needs variance within the group
    result = await backend.train(model, [group], learning_rate=1e-5)
    assert result.step == 1 and result.metrics.get("trained_tokens", 0) > 0
