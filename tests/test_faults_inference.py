"""Inference-server faults injected for real, inside a rollout: a 5xx answer, a connection
that drops mid-response (plain and streamed), a server shut down mid-rollout, a call that
never answers.  The inference server is ``capture_fake_server.FakeOpenAIServer`` (real HTTP
on loopback, scripted); the agents are plain OpenAI-SDK and LiteLLM loops.

Each fault must end as a typed exception in ``group.exceptions``, never as a trajectory,
even when the agent catches the error and carries on; a retry of the same request that
succeeds leaves the trajectory alone; ``raise_infrastructure_errors=False`` opts out.
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest
from capture_fake_server import FakeOpenAIServer, Reply

import tracerl
import tracerl.integrations as ti
from tracerl.errors import ConfigError


@pytest.fixture(autouse=True)
def hooks():
    ti.instrument("openai")


@pytest.fixture
def policy():
    servers: list[FakeOpenAIServer] = []

    def start(script, **model_options: Any) -> tuple[FakeOpenAIServer, tracerl.Model]:
        server = FakeOpenAIServer(script).start()
        servers.append(server)
        model = tracerl.Model("policy", "tests", inference_base_url=server.base_url, inference_model_name="m", **model_options)
        return server, model

    yield start
    for server in servers:
        server.stop()


def second_call(fault: Reply):
    """The first model call of a rollout is answered; the second meets ``fault``."""
    return lambda body: Reply(content="first answer") if len(body["messages"]) == 1 else fault


async def swallowing_agent(model: tracerl.Model, *, stream: bool = False) -> str:
    """Two turns; a failed call ends the attempt with an apology, as many agents do."""
    client = model.openai_client()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    for _ in range(2):
        try:
            response = await client.chat.completions.create(model="m", messages=messages, stream=stream)
            if stream:
                text = "".join([chunk.choices[0].delta.content or "" async for chunk in response if chunk.choices])
            else:
                text = response.choices[0].message.content
        except Exception:  # noqa: BLE001 - the agent swallows it
            return "sorry, something went wrong"
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "and then?"}]
    return "ok"


async def attempt(model: tracerl.Model, agent=swallowing_agent, **options: Any) -> tracerl.Trajectory:
    async with tracerl.rollout(model, task="two turns", **options) as r:
        r.output = await agent(model)
    return r.trajectory


async def gather(*attempts, max_exceptions: int | float = 1) -> tuple[tracerl.TrajectoryGroup, dict[str, float]]:
    gathered = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(list(attempts))], pbar_desc=None, max_exceptions=max_exceptions
    )
    return gathered[0], gathered.metrics


@pytest.mark.parametrize(
    "fault, cause",
    [(Reply(status=500), "InternalServerError"), (Reply(status=503), "InternalServerError"), (Reply(drop=True), "APIConnectionError")],
    ids=["500", "503", "dropped"],
)
async def test_a_swallowed_inference_failure_is_an_exception_not_a_trajectory(policy, fault, cause):
    server, model = policy(second_call(fault))
    group, metrics = await gather(attempt(model))
    assert group.trajectories == []
    [record] = group.exceptions
    assert record.type == "InferenceServerError"
    assert server.base_url in record.message and "carried on" in record.message
    assert cause in record.traceback  # chained: raise ... from the SDK's error
    assert metrics["infrastructure_exceptions"] == 1
    with pytest.raises(tracerl.TooManyExceptionsError, match="InferenceServerError"):
        await gather(attempt(model), max_exceptions=0)  # counted against max_exceptions


async def test_a_stream_that_breaks_mid_response_fails_the_rollout(policy):
    _, model = policy(second_call(Reply(content="a longer second answer", drop=True)))
    with pytest.raises(tracerl.InferenceServerError, match="lost its connection"):
        await attempt(model, lambda m: swallowing_agent(m, stream=True))


async def test_an_inference_server_shut_down_mid_rollout_fails_the_rollout(policy):
    server, model = policy(lambda body: Reply(content="fine"))

    async def agent(model: tracerl.Model) -> str:
        client = model.openai_client()
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "one"}])
        await asyncio.to_thread(server.stop)  # the inference server goes away between two turns
        try:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "two"}])
        except openai.APIConnectionError:
            return "gave up"
        return "ok"

    with pytest.raises(tracerl.InferenceServerError) as caught:
        await attempt(model, agent)
    assert isinstance(caught.value.__cause__, openai.APIConnectionError)


async def test_a_retry_that_succeeds_keeps_the_trajectory(policy):
    failures = iter([Reply(status=500)])
    server, model = policy(lambda body: next(failures, Reply(content="fine")))

    async def retrying_agent(model: tracerl.Model) -> str:
        client = model.openai_client()
        messages = [{"role": "user", "content": "hi"}]
        for _ in range(3):
            try:
                return (await client.chat.completions.create(model="m", messages=messages)).choices[0].message.content
            except openai.InternalServerError:
                continue  # the same request again
        return "gave up"

    t = await attempt(model, retrying_agent)
    assert t.metadata["output"] == "fine" and len(t.sampled_turns()) == 1
    assert "infrastructure_errors" not in t.metadata and len(server.requests) == 2


async def test_a_fallback_to_another_request_is_not_a_retry(policy):
    """The agent reacted to the failure (a different prompt): the trajectory is the infrastructure's doing."""
    _, model = policy(lambda body: Reply(status=500) if body["messages"][0]["content"] == "long" else Reply(content="short"))

    async def fallback_agent(model: tracerl.Model) -> str:
        client = model.openai_client()
        try:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "long"}])
        except openai.InternalServerError:
            pass
        return (await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "short"}])).choices[0].message.content

    with pytest.raises(tracerl.InferenceServerError):
        await attempt(model, fallback_agent)


async def test_opting_out_keeps_the_trajectory_with_the_failures_recorded(policy):
    _, model = policy(second_call(Reply(status=500)))
    t = await attempt(model, raise_infrastructure_errors=False)
    assert t.metadata["output"] == "sorry, something went wrong"
    [failure] = t.metadata["infrastructure_errors"]
    assert (failure["kind"], failure["reason"]) == ("model", "server_error") and "500" in failure["error"]
    assert t.metrics["infrastructure_errors"] == 1


async def test_client_errors_stay_the_agents(policy):
    """A 4xx (e.g. a prompt over the context limit) is not infrastructure: the agent's handling stands."""
    _, model = policy(second_call(Reply(status=400)))
    t = await attempt(model)
    assert t.metadata["output"] == "sorry, something went wrong" and "infrastructure_errors" not in t.metadata


async def one_call(model: tracerl.Model) -> Any:
    return await model.openai_client().chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])


async def test_a_model_call_that_never_answers_times_out_at_the_models_knob(policy):
    _, model = policy(lambda body: Reply(hang=True), inference_timeout=0.5)
    group, _ = await gather(attempt(model, one_call))
    [record] = group.exceptions
    assert record.type == "InferenceTimeoutError"
    assert "timed out after 0.5 s" in record.message and "Model(inference_timeout=...)" in record.message
    assert issubclass(tracerl.InferenceTimeoutError, TimeoutError)


def test_the_model_timeout_is_a_validated_knob_on_both_client_paths():
    model = tracerl.Model("m", "tests", inference_base_url="http://127.0.0.1:9/v1", inference_timeout=42)
    assert model.openai_client().timeout == 42 and model.litellm_completion_params()["timeout"] == 42
    assert tracerl.Model("m", "tests", inference_base_url="http://x/v1").openai_client().timeout == 600
    assert "timeout" not in tracerl.Model("m", "tests", inference_timeout=None).litellm_completion_params()
    for bad in (0, -1, float("nan"), "10"):
        with pytest.raises(ConfigError, match="inference_timeout"):
            tracerl.Model("m", "tests", inference_timeout=bad)


# -- LiteLLM ---------------------------------------------------------------------------------------
@pytest.fixture
def litellm(monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    ti.instrument("litellm", "openai")
    return litellm


async def test_a_swallowed_litellm_failure_fails_the_rollout(policy, litellm):
    _, model = policy(second_call(Reply(status=500)))

    async def agent(model: tracerl.Model) -> str:
        messages = [{"role": "user", "content": "hi"}]
        answer = await litellm.acompletion(**model.litellm_completion_params(), messages=messages, num_retries=0)
        try:
            more = [*messages, answer.choices[0].message.model_dump(), {"role": "user", "content": "more"}]
            await litellm.acompletion(**model.litellm_completion_params(), messages=more, num_retries=0)
        except litellm.InternalServerError:
            return "sorry"
        return "ok"

    with pytest.raises(tracerl.InferenceServerError, match="got a server error") as caught:
        await attempt(model, agent)
    assert "(and" not in str(caught.value)  # LiteLLM's own OpenAI SDK call is the same call, not a second failure


async def test_a_litellm_call_that_never_answers_times_out(policy, litellm):
    _, model = policy(lambda body: Reply(hang=True), inference_timeout=0.5)

    async def agent(model: tracerl.Model) -> Any:
        return await litellm.acompletion(**model.litellm_completion_params(), messages=[{"role": "user", "content": "x"}], num_retries=0)

    with pytest.raises(tracerl.InferenceTimeoutError, match="after 0.5 s"):
        await attempt(model, agent)


def test_what_counts_as_infrastructure():
    """The rules behind the tests above, on the libraries' own exception types."""
    import httpx

    from tracerl.integrations.faults import classify

    request = httpx.Request("POST", "http://127.0.0.1:9/v1/chat/completions")

    def status(code: int) -> openai.APIStatusError:
        return openai.APIStatusError("scripted", response=httpx.Response(code, request=request), body=None)

    assert classify(openai.APIConnectionError(request=request)) == "connection"
    assert classify(openai.APITimeoutError(request=request)) == "timeout"
    assert [classify(status(c)) for c in (500, 502, 503, 429)] == ["server_error"] * 4
    assert [classify(status(c)) for c in (400, 401, 404, 422)] == [None] * 4  # the request's fault
    assert classify(httpx.ConnectError("refused")) == "connection" and classify(ConnectionResetError()) == "connection"
    assert classify(ValueError("bad arguments")) is None and classify(tracerl.ConfigError("x")) is None
    wrapped = RuntimeError("the tool failed")
    wrapped.__cause__ = httpx.ReadTimeout("slow")
    assert classify(wrapped) == "timeout"  # explicit causes are followed
    assert classify(ExceptionGroup("g", [ValueError(), ConnectionRefusedError()])) == "connection"


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_a_refused_call_on_the_responses_or_messages_api_fails_the_rollout(api):
    """The Responses and Messages hooks note failures as the chat hook does: a call to a server that is
    not there, swallowed by the agent, is an exception of the group, not a trajectory."""
    anthropic = pytest.importorskip("anthropic")
    from tracerl.net.http_server import free_port

    root = f"http://127.0.0.1:{free_port()}"  # nothing listens: the connection is refused
    model = tracerl.Model("policy", "tests", inference_base_url=root + "/v1", inference_model_name="m")

    async def agent(model: tracerl.Model) -> str:
        try:
            if api == "responses":
                await openai.AsyncOpenAI(base_url=root + "/v1", api_key="k", max_retries=0).responses.create(model="m", input="hi")
            else:
                await anthropic.AsyncAnthropic(base_url=root, api_key="k", max_retries=0).messages.create(
                    model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])  # fmt: skip
        except Exception:  # noqa: BLE001 - the agent swallows it
            return "sorry, something went wrong"
        return "ok"

    group, metrics = await gather(attempt(model, agent=agent))
    assert group.trajectories == []
    [record] = group.exceptions
    assert record.type == "InferenceServerError" and "APIConnectionError" in record.traceback
    assert metrics["infrastructure_exceptions"] == 1
