"""Capture that cannot fail silently.

A rollout turns the installed hooks on by itself (no ``instrument()`` first, in a fresh
interpreter, whether LangChain was imported before the rollout or inside it); a rollout whose
code sent model requests that capture did not see warns once with the cause (a client with no
hook, the hooks turned off, a thread without the copied context, an endpoint not served by
tracerl); ``backend.train`` on trajectories without sampled turns says which and why.  The
model server is the loopback fake (real HTTP, real SDKs).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from capture_fake_server import FakeOpenAIServer
from openai import OpenAI

import tracerl
import tracerl.integrations as ti
from tracerl.integrations import auto, missed

CHILD = Path(__file__).with_name("auto_capture_child.py")
QUESTION = "What is tracerl?"


@pytest.fixture()
def fresh_warnings():
    """Every cause warns again (the once-per-process memory is reset around each test)."""
    missed.reset()
    yield
    missed.reset()


def run_rollout(body, **options) -> tracerl.Trajectory:
    with tracerl.rollout(task=QUESTION, **options) as r:
        body()
    assert r.trajectory is not None
    return r.trajectory


def chat(base_url: str) -> None:
    client = OpenAI(base_url=base_url, api_key="x", max_retries=0)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": QUESTION}])


def capture_warnings(body, **options) -> tuple[tracerl.Trajectory, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trajectory = run_rollout(body, **options)
    return trajectory, [w for w in caught if issubclass(w.category, ti.CaptureWarning)]


# -- a rollout turns capture on by itself --------------------------------------------------------
@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_a_langgraph_agent_is_captured_without_calling_instrument(mode):
    """``eager``: LangChain imported before the rollout; ``lazy``: first imported inside it."""
    with FakeOpenAIServer() as server:
        env = dict(os.environ, TRACERL_ENDPOINTS=server.base_url)
        env.pop("TRACERL_AUTO_INSTRUMENT", None)
        done = subprocess.run(
            [sys.executable, str(CHILD), server.base_url, mode], capture_output=True, text=True, env=env, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["hooks_before"] == [] and set(seen["hooks_after"]) == {"openai", "langchain"}
    assert seen["roles"] == ["system", "user", "assistant", "tool", "assistant"]
    assert seen["sampled_with_token_ids"] == 2 and seen["tool_results"] == [f"found {QUESTION}"]
    assert not any(line.startswith("tracerl: ") for line in seen["logs"])
    assert "CaptureWarning" not in done.stderr


def test_the_environment_variable_turns_auto_instrumentation_off():
    with FakeOpenAIServer() as server:
        env = dict(os.environ, TRACERL_ENDPOINTS=server.base_url, TRACERL_AUTO_INSTRUMENT="0")
        done = subprocess.run(
            [sys.executable, str(CHILD), server.base_url, "eager"], capture_output=True, text=True, env=env, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["hooks_after"] == [] and seen["roles"] == []  # off means off: no hook, no wire watch


def test_auto_instrumentation_respects_uninstrument_and_is_idempotent(served_fake):
    from openai.resources.chat.completions import Completions

    ti.instrument("openai")
    wrapped = Completions.create
    run_rollout(lambda: chat(served_fake.base_url))
    assert Completions.create is wrapped  # never wrapped twice
    ti.uninstrument("openai")
    try:
        auto.reset()  # as in a fresh process: the next rollout decides again
        ti.uninstrument("openai")
        trajectory = run_rollout(lambda: chat(served_fake.base_url))
        assert Completions.create is wrapped.__tracerl_original__, "a rollout turned a hook back on that the user turned off"
        assert trajectory.metrics["capture_model_calls"] == 0
    finally:
        ti.instrument("openai")
    assert run_rollout(lambda: chat(served_fake.base_url)).metrics["capture_model_calls"] == 1


# -- model requests that capture did not see -------------------------------------------------------
def test_a_client_without_a_hook_warns_once_with_the_cause(served_fake, fresh_warnings):
    def raw_http() -> None:  # a hand-written client: plain httpx, no SDK
        httpx.post(f"{served_fake.base_url}/chat/completions", json={"model": "policy", "messages": []}).raise_for_status()

    first, caught = capture_warnings(raw_http)
    assert len(caught) == 1
    text = str(caught[0].message)
    assert f"{served_fake.base_url}/chat/completions" in text and "has no tracerl hook" in text
    assert "not served by tracerl" not in text  # it is: registered by the fixture
    assert first.metrics["capture_missed_model_requests"] == 1 and text.split(" (warned once")[0] in first.logs
    second, again = capture_warnings(raw_http)
    assert again == [] and second.metrics["capture_missed_model_requests"] == 1  # once per cause, always in the trajectory


def test_hooks_turned_off_warn_that_they_are_off(unserved_fake, fresh_warnings):
    ti.uninstrument()
    try:
        trajectory, caught = capture_warnings(lambda: chat(unserved_fake.base_url), auto_instrument=False)
    finally:
        ti.instrument()
    assert len(caught) == 1 and "capture hooks are off" in str(caught[0].message)
    assert f"{unserved_fake.base_url}/chat/completions is not served by tracerl" in str(caught[0].message)
    assert trajectory.messages() == [] and trajectory.metrics["capture_missed_model_requests"] == 1


def test_a_thread_without_the_copied_context_warns(served_fake, fresh_warnings):
    def in_a_bare_thread() -> None:
        worker = threading.Thread(target=chat, args=(served_fake.base_url,))
        worker.start()
        worker.join()

    trajectory, caught = capture_warnings(in_a_bare_thread)
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "outside every rollout's context" in text and "contextvars.copy_context().run" in text
    assert trajectory.messages() == [] and trajectory.metrics["capture_missed_model_requests"] == 1

    def in_a_thread_with_the_context() -> None:  # the fix the warning names
        context = contextvars.copy_context()
        worker = threading.Thread(target=context.run, args=(chat, served_fake.base_url))
        worker.start()
        worker.join()

    fixed, caught = capture_warnings(in_a_thread_with_the_context)
    assert caught == [] and fixed.metrics["capture_model_calls"] == 1 and fixed.sampled_turns()[0].token_ids


def test_a_rollout_that_calls_no_model_does_not_warn(served_fake, fresh_warnings):
    def no_model() -> None:
        httpx.get(f"{served_fake.base_url}/models")  # not a generation request

    trajectory, caught = capture_warnings(no_model)
    assert caught == [] and "capture_missed_model_requests" not in trajectory.metrics


def test_a_trainable_model_answered_by_an_unserved_endpoint_warns(served_fake, unserved_fake, fresh_warnings):
    model = SimpleNamespace(name="agent", trainable=True, inference_base_url=served_fake.base_url, get_inference_name=lambda: "agent@0")
    trajectory, caught = capture_warnings(lambda: chat(unserved_fake.base_url), model=model)
    assert len(caught) == 1 and "none with sampled token ids" in str(caught[0].message)
    assert unserved_fake.base_url in str(caught[0].message)
    assert trajectory.metrics["capture_unserved_model_calls"] == 1


async def test_concurrent_rollouts_keep_their_own_requests(served_fake, fresh_warnings):
    """A rollout that captured its call is not blamed for another rollout's uncaptured one."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=served_fake.base_url, api_key="x", max_retries=0)

    async def hooked() -> tracerl.Trajectory:
        async with tracerl.rollout(task="hooked") as r:
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "a"}])
        return r.trajectory

    async def raw() -> tracerl.Trajectory:
        async with tracerl.rollout(task="raw") as r:
            async with httpx.AsyncClient() as http:
                await http.post(f"{served_fake.base_url}/chat/completions", json={"model": "policy", "messages": []})
        return r.trajectory

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ti.CaptureWarning)
        good, bad = await asyncio.gather(hooked(), raw())
    assert good.metrics["capture_model_calls"] == 1 and "capture_missed_model_requests" not in good.metrics
    assert bad.metrics["capture_missed_model_requests"] == 1


# -- backend.train on trajectories with no sampled turn ----------------------------------------------
def test_train_on_trajectories_without_sampled_turns_says_which_and_why(served_fake, tmp_path, fresh_warnings):
    def in_a_bare_thread() -> None:
        worker = threading.Thread(target=chat, args=(served_fake.base_url,))
        worker.start()
        worker.join()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ti.CaptureWarning)
        empty = run_rollout(in_a_bare_thread)
    empty.reward = 1.0
    by_hand = tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
    group = tracerl.TrajectoryGroup([empty, by_hand])
    backend = tracerl.LocalBackend(inference=None)
    model = tracerl.TrainableModel("m", "p", "smollm2-135m", base_path=tmp_path)
    with pytest.raises(tracerl.TrajectoryError) as raised:
        asyncio.run(backend.train(model, [group]))
    text = str(raised.value)
    assert "none of the 2 trajectories has a sampled turn" in text
    assert f"trajectory 0 (id {empty.id})" in text and "outside every rollout's context" in text
    assert f"trajectory 1 (id {by_hand.id})" in text and "plain message dicts" in text and "Choice.from_openai" in text
    assert not tmp_path.joinpath("p").exists()  # refused before anything was loaded or written


def test_some_trajectories_without_sampled_turns_are_named_and_counted(caplog):
    from tracerl.train.sampled_turns import check_sampled_turns

    sampled = tracerl.Trajectory(
        messages_and_choices=[{"role": "user", "content": "q"}, tracerl.Choice(message={"role": "assistant", "content": "a"})],
        reward=1.0,
    )
    empty = tracerl.Trajectory(messages_and_choices=[])
    with caplog.at_level("WARNING", logger="tracerl.train"):
        assert check_sampled_turns([tracerl.TrajectoryGroup([sampled, empty])]) == 1
    assert f"trajectory 1 (id {empty.id}): it is empty" in caplog.text and "1 of 2 trajectories" in caplog.text
    assert check_sampled_turns([]) == 0


def test_groups_of_equal_rewards_are_not_checked_they_train_nothing_anyway():
    """A step of equal-reward groups advances with the adapter unchanged (README), whatever they hold."""
    from tracerl.train.sampled_turns import check_sampled_turns

    equal = [tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}], reward=0.5) for _ in range(2)]
    assert check_sampled_turns([tracerl.TrajectoryGroup(equal)]) == 0
    equal[1].reward = 1.0
    with pytest.raises(tracerl.TrajectoryError, match="none of the 2 trajectories"):
        check_sampled_turns([tracerl.TrajectoryGroup(equal)])
