"""Nothing hangs: a judge or scenario generator that never answers, and a rollout stuck in
the agent's own code, end within their knob as typed ``TimeoutError``s.

The judge is ``ruler_judge_server.JudgeServer`` (a real HTTP server on loopback) whose
script blocks until the test ends; every call goes through LiteLLM as with a hosted judge.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from ruler_judge_server import JudgeServer

import tracerl
from tracerl.errors import ConfigError
from tracerl.ruler import JudgeEndpoint, ruler_score_group
from tracerl.ruler.client import resolve_judge
from tracerl.timeouts import DEFAULT_JUDGE_TIMEOUT

session_loop = pytest.mark.asyncio(loop_scope="session")  # LiteLLM keeps clients per loop: use one


@pytest.fixture
def silent_judge(monkeypatch, tmp_path):
    """A judge endpoint that accepts each request and never answers (until the test ends)."""
    import tracerl.mcp_rl.scenarios
    import tracerl.ruler.cache

    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    monkeypatch.setattr(tracerl.ruler.cache, "default_cache_dir", lambda: tmp_path / "ruler")
    monkeypatch.setattr(tracerl.mcp_rl.scenarios, "default_cache_dir", lambda: tmp_path / "mcp_rl")
    release = threading.Event()
    with JudgeServer(lambda request, n: release.wait(120) and "") as server:
        yield server
        release.set()


def two_attempts() -> tracerl.TrajectoryGroup:
    return tracerl.TrajectoryGroup(
        [tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": a}]) for a in ("4", "5")]
    )


@session_loop
async def test_a_judge_that_never_answers_raises_within_its_knob(silent_judge):
    judge = JudgeEndpoint(silent_judge.base_url, "silent")
    with pytest.raises(tracerl.JudgeTimeoutError, match=r"did not answer within 1 s .*extra_litellm_params") as caught:
        await ruler_score_group(two_attempts(), judge, extra_litellm_params={"timeout": 1}, cache=False)
    assert isinstance(caught.value, TimeoutError) and isinstance(caught.value, tracerl.JudgeError)
    assert silent_judge.count == 1  # the bound is the whole call: no silent retry multiplied it


@session_loop
async def test_a_scenario_generator_that_never_answers_raises_within_its_knob(silent_judge):
    from tracerl.mcp_rl import McpTool, generate_scenarios

    tools = [McpTool("add", "Add two integers", {"type": "object", "properties": {}})]
    with pytest.raises(tracerl.JudgeTimeoutError, match=r"scenario generator .* within 1 s .*generator_params"):
        await generate_scenarios(tools, 2, JudgeEndpoint(silent_judge.base_url, "silent"), extra_litellm_params={"timeout": 1}, cache=False)


def test_judge_calls_have_a_default_timeout_and_it_is_validated():
    endpoint = JudgeEndpoint("http://127.0.0.1:9/v1", "j")
    assert resolve_judge(endpoint).timeout == DEFAULT_JUDGE_TIMEOUT == 180
    assert resolve_judge(endpoint, {"timeout": 5}).timeout == 5 and "timeout" not in resolve_judge(endpoint, {"timeout": 5}).params
    policy = tracerl.Model("p", "tests", inference_base_url="http://127.0.0.1:9/v1", inference_timeout=600)
    assert resolve_judge(policy).timeout == DEFAULT_JUDGE_TIMEOUT  # the policy's call limit is not the judge's
    with pytest.raises(ConfigError):
        resolve_judge(endpoint, {"timeout": -1})


# -- a rollout stuck in the agent's own code ---------------------------------------------------------------
async def stuck_rollout(cleaned_up: list[str]) -> tracerl.Trajectory:
    async with tracerl.rollout(None, task="stuck") as r:
        try:
            await asyncio.Event().wait()  # e.g. a lock or a queue nobody feeds
        finally:
            cleaned_up.append("closed")
    return r.trajectory


async def quick_rollout() -> tracerl.Trajectory:
    async with tracerl.rollout(None, task="quick") as r:
        r.reward = 1.0
    return r.trajectory


async def test_rollout_timeout_cancels_a_stuck_rollout_and_keeps_its_siblings():
    cleaned_up: list[str] = []
    gathered = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup([stuck_rollout(cleaned_up), quick_rollout()])], pbar_desc=None, max_exceptions=1, rollout_timeout=0.5
    )  # fmt: skip
    [group] = gathered
    assert [r.type for r in group.exceptions] == ["RolloutTimeoutError"] and cleaned_up == ["closed"]
    assert "rollout_timeout=0.5 s" in group.exceptions[0].message and "stuck_rollout" in group.exceptions[0].traceback
    assert group.rewards == [1.0] and gathered.metrics["rollout_timeouts"] == 1
    with pytest.raises(tracerl.TooManyExceptionsError, match="RolloutTimeoutError"):  # counted against max_exceptions
        await tracerl.gather_trajectory_groups([tracerl.TrajectoryGroup([stuck_rollout([])])], pbar_desc=None, rollout_timeout=0.2)


async def test_rollout_timeout_reaches_groups_built_by_trajectory_group():
    """A group passed as an awaitable (``tracerl.trajectory_group``) gets the gather's limit."""

    async def attempt() -> float:
        await asyncio.Event().wait()
        return 1.0

    [group] = await tracerl.gather_trajectory_groups(
        [tracerl.trajectory_group(attempt, n=2, task="stuck")], pbar_desc=None, max_exceptions=2, rollout_timeout=0.3
    )
    assert [r.type for r in group.exceptions] == ["RolloutTimeoutError", "RolloutTimeoutError"]


async def test_a_rollouts_own_timeout_error_is_not_mistaken_for_the_rollout_timeout():
    async def times_out_itself() -> tracerl.Trajectory:
        async with asyncio.timeout(0.01):
            await asyncio.Event().wait()
        raise AssertionError("unreachable")

    [group] = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup([times_out_itself()])], pbar_desc=None, max_exceptions=1, rollout_timeout=30
    )
    assert [r.type for r in group.exceptions] == ["TimeoutError"]


async def test_gather_trajectories_takes_a_rollout_timeout_too():
    results = await tracerl.gather_trajectories([stuck_rollout([]), quick_rollout()], pbar_desc=None, max_exceptions=1, rollout_timeout=0.3)
    assert isinstance(results[0], tracerl.ExceptionRecord) and results[0].type == "RolloutTimeoutError"
    assert isinstance(results[1], tracerl.Trajectory)


def test_the_progress_bar_shows_timeouts_and_infrastructure_failures(capsys):
    def failing() -> Any:
        async def run() -> tracerl.Trajectory:
            raise tracerl.McpServerError("the MCP server died")

        return run()

    async def main() -> None:
        await tracerl.gather_trajectory_groups(
            [tracerl.TrajectoryGroup([stuck_rollout([]), failing(), quick_rollout()])], pbar_desc="gather", max_exceptions=2, rollout_timeout=0.3
        )  # fmt: skip

    asyncio.run(main())
    err = capsys.readouterr().err
    assert "timeouts=1" in err and "infra=1" in err and "exceptions=2" in err
