"""OpenEnv: an environment built with ``openenv-core``'s own classes, served by its ``create_fastapi_app``
on loopback and played through its WebSocket client (``examples/openenv_guess.py``).

The real-model test plays episodes with SmolLM2 served by the transformers server and trains
one step on them: every model turn is a sampled turn with token ids, the reward is the sum of
the environment's step rewards.  The fault test stops the environment server under an
episode: the attempt is an ``InfrastructureError`` in its group, never a trajectory.
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

import tracerl
from tracerl.errors import ConfigError, InfrastructureError
from tracerl.envs.openenv import openenv_episode

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "openenv_guess.py"


def _example():
    spec = importlib.util.spec_from_file_location("openenv_guess", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.mark.real_model
def test_the_example_plays_episodes_through_openenvs_client_and_trains_a_step(tmp_path, capsys):
    example = _example()
    args = example.parse_args(["--steps", "1", "--groups", "2", "--rollouts", "4", "--data", str(tmp_path)])
    asyncio.run(example.main(args))
    assert "step 1: reward" in capsys.readouterr().out
    from tracerl.integrations.importers import read_jsonl
    from tracerl.runs.storage import RunDir

    run = RunDir(tmp_path, "openenv", "guess-s0")
    trajectories = read_jsonl(run.trajectories_path("train", 1))
    assert len(trajectories) == 8
    for t in trajectories:
        turns = t.sampled_turns()
        assert len(turns) == t.metrics["env_steps"] >= 1 and all(c.token_ids and c.logprobs for c in turns)
        assert t.reward == pytest.approx(sum(t.metadata["env_step_rewards"]))
        assert t.metrics["env_done"] == 1.0 or t.metrics["env_steps"] == 4
    [row] = [r for r in run.read_history() if "train/reward" in r]
    # a group whose rollouts all scored the same has no advantage to train on (sampling decides, rarely both)
    varied = sum(len({t.reward for t in trajectories[g * 4 : g * 4 + 4]}) > 1 for g in range(2))
    assert row["step"] == 1 and row["train/num_groups_trainable"] == varied
    if varied:
        assert row["train/trained_tokens"] > 0


def test_a_server_that_goes_away_mid_episode_is_an_infrastructure_error_not_a_trajectory(tmp_path):
    example = _example()
    server = example.serve_environment()
    url = f"http://127.0.0.1:{server.port}"
    model = tracerl.Model("nobody", "tests", inference_base_url="http://127.0.0.1:9/v1", inference_api_key="k", base_path=tmp_path)

    async def run() -> tracerl.TrajectoryGroup:
        from openenv.core import GenericEnvClient

        async def episode() -> tracerl.Trajectory:
            async with GenericEnvClient(base_url=url, connect_timeout_s=2, message_timeout_s=2) as env:
                await env.reset(seed=0)  # the session is open ...
                server.stop()  # ... and the environment's server goes away
                return await openenv_episode(model, env, first_messages=example.first_messages, act=example.act, observe=example.observe)

        [group] = await tracerl.gather_trajectory_groups([tracerl.TrajectoryGroup([episode()])], pbar_desc=None, max_exceptions=1)
        return group

    group = asyncio.run(run())
    assert group.trajectories == [] and len(group.exceptions) == 1
    assert group.exceptions[0].type == "InfrastructureError"
    assert "OpenEnv environment server failed on reset" in group.exceptions[0].message


def test_reward_rules():
    with pytest.raises(ConfigError, match="reward"):
        asyncio.run(openenv_episode(None, None, first_messages=list, act=str, observe=str, reward="mean"))  # type: ignore[arg-type]
    assert issubclass(InfrastructureError, tracerl.TracerlError)
