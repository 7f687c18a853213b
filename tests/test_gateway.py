"""The rollout gateway: agents in other processes join a rollout's trajectory through its own address.

Real model (SmolLM2 on the transformers server), real clients in separate processes (the OpenAI
SDK, and the standard library's ``urllib`` with the rollout header), no tracerl in them.  Each
call lands in its own rollout only, with the token ids the engine sampled; unknown and finished
tokens get a 404; the API key is still required; the trajectories train a step.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import httpx
import pytest

import tracerl
from capture_helpers import served_and_recorded

pytest.importorskip("torch")
AGENT = Path(__file__).with_name("gateway_agent.py")
ROLLOUTS = 8


@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    async with served_and_recorded("gateway", tmp_path_factory.mktemp("runs")) as served:
        yield served


async def run_agent(r: tracerl.Rollout, model, marker: str, mode: str) -> str:
    env = {**os.environ, **r.gateway_env(), "MODEL": model.get_inference_name(), "PLAIN_BASE_URL": model.inference_base_url,
           "ROLLOUT_HEADER": ": ".join(next(iter(r.gateway_headers.items())))}  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(AGENT), marker, mode, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=600)
    assert process.returncode == 0, err.decode()[-2000:]
    return out.decode()


@pytest.fixture(scope="module")
async def gathered(served):
    model, _, answers = served

    async def one(index: int) -> tracerl.Trajectory:
        async with tracerl.rollout(model, task=f"marker-{index}") as r:
            await run_agent(r, model, f"zebra{index}", "openai" if index % 2 == 0 else "urllib")
            r.reward = float(index % 2)
        return r.trajectory

    trajectories = await asyncio.gather(*(one(i) for i in range(ROLLOUTS)))
    return trajectories, list(answers)


async def test_each_process_call_lands_in_its_own_rollout_with_the_sampled_tokens(gathered):
    trajectories, answers = gathered
    by_tokens = {(tuple(a["prompt_token_ids"]), tuple(a["choices"][0]["token_ids"])): a for a in answers}
    for index, trajectory in enumerate(trajectories):
        sent = str([m for m in trajectory.messages() if m["role"] != "assistant"])  # the model may echo any word
        assert f"zebra{index}" in sent
        assert not [f"zebra{other}" for other in range(ROLLOUTS) if other != index and f"zebra{other}" in sent]
        (turn,) = trajectory.sampled_turns()
        answer = by_tokens[(tuple(turn.prompt_token_ids), tuple(turn.token_ids))]  # id for id, as the engine sampled
        assert turn.logprobs == [e["logprob"] for e in answer["choices"][0]["logprobs"]["content"]]
        assert trajectory.metrics["capture_turns_without_token_ids"] == 0


async def test_unknown_and_finished_tokens_are_refused_and_the_key_still_needed(served):
    model, _, _ = served
    async with tracerl.rollout(model) as r:
        url = r.gateway_url
        async with httpx.AsyncClient(timeout=60) as http:
            keyless = await http.post(f"{url}/chat/completions", json={"model": model.get_inference_name(), "messages": []})
    assert keyless.status_code == 401
    headers = {"Authorization": f"Bearer {model.inference_api_key}"}
    body = {"model": model.get_inference_name(), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    invented = url.replace(r.gateway_headers["X-Tracerl-Rollout"], "not-a-real-token")
    async with httpx.AsyncClient(timeout=60) as http:
        for dead in (url, invented):  # finished with its rollout; never opened
            response = await http.post(f"{dead}/chat/completions", json=body, headers=headers)
            assert response.status_code == 404 and "unknown or finished rollout token" in response.json()["error"]["message"]
        plain = await http.post(f"{model.inference_base_url}/chat/completions", json=body,
                                headers={**headers, **r.gateway_headers})  # fmt: skip
        assert plain.status_code == 404
    assert r.trajectory.metrics["capture_model_calls"] == 0


async def test_the_gateway_trajectories_train_a_step(served, gathered):
    model, backend, _ = served
    trajectories, _ = gathered
    result = await backend.train(model, [tracerl.TrajectoryGroup(trajectories)], learning_rate=1e-5)
    assert result.step == 1 and result.metrics.get("trained_tokens", 0) > 0


class _NoTraining:
    """What ``tracerl serve`` needs of a backend to proxy a model already served (here the test's own)."""

    path = None

    async def close(self) -> None:
        pass


async def test_through_tracerl_serve(served, tmp_path):
    """A remote rollout: its gateway opened through ``tracerl serve``, the agent's call relayed by it."""
    from tracerl.net.http_server import BackgroundUvicorn
    from tracerl.serve.server import create_app

    model, _, answers = served
    app = create_app(_NoTraining(), token="serve-token", base_path=tmp_path)
    app.state.tracerl.models[model.name] = model  # as if registered through the server
    http = BackgroundUvicorn(app, name="tracerl-serve-gateway-test")
    url = f"http://127.0.0.1:{http.start()}"
    try:
        remote = tracerl.Model(model.name, "tests", inference_base_url=f"{url}/v1", inference_api_key="serve-token")
        async with tracerl.rollout(remote) as r:
            await run_agent(r, model, "okapi", "openai")
        (turn,) = r.trajectory.sampled_turns()
        assert "okapi" in str(r.trajectory.messages()) and turn.token_ids
        assert any(tuple(a["choices"][0]["token_ids"]) == tuple(turn.token_ids) for a in answers)
        async with httpx.AsyncClient(timeout=60) as client:
            closed = await client.delete(f"{url}/v1/tracerl/rollouts/{r.gateway_headers['X-Tracerl-Rollout']}",
                                         headers={"Authorization": "Bearer serve-token"})  # fmt: skip
        assert closed.status_code == 404
    finally:
        http.stop()
