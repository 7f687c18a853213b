"""The logprobs tracerl's servers return and capture records are those of the distribution sampled.

A turn sampled at temperature 0.7 (or with top-p / top-k) is recorded with the logprobs of that
tempered, filtered distribution (vLLM's ``processed_logprobs``) and with its ``Choice.sampling``,
so the trainer never mistakes it for a temperature-1 sample.  Checked against the model's own
transformers forward over prompt + completion, through the OpenAI SDK inside ``tracerl.rollout``
as a user calls it, on the transformers server (here) and on vLLM (``tests/test_inference_contract.py``
``test_a_rollout_records_the_sampled_distribution``, which reuses that file's servers).

Run heavy: ``flock /tmp/tracerl-heavy.lock .venv/bin/python -m pytest -q tests/test_sampled_distribution.py``.
"""

from __future__ import annotations

import json

import pytest

import tracerl
from tracerl import SamplingParams, TrajectoryError

HELLO = [{"role": "user", "content": "Write one short sentence about the sea."}]
SERVED = "agent"
TOLERANCE = 1e-4


# -- the type --------------------------------------------------------------------------------------------------
def test_sampling_params_are_validated_frozen_and_survive_json():
    assert SamplingParams() == SamplingParams(temperature=1.0, top_p=1.0, top_k=0)
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.7).greedy
    for bad in ({"temperature": -0.1}, {"temperature": float("nan")}, {"temperature": float("inf")}, {"temperature": True},
                {"temperature": "0.7"}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": float("nan")}, {"top_k": -1}, {"top_k": 2.5}):  # fmt: skip
        with pytest.raises(TrajectoryError):
            SamplingParams(**bad)
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5)
    with pytest.raises(TrajectoryError, match="frozen"):
        params.temperature = 1.0  # type: ignore[misc]

    choice = tracerl.Choice(message={"role": "assistant", "content": "hi"}, token_ids=[5], logprobs=[-0.5], sampling=params)
    unknown = tracerl.Choice(message={"role": "assistant", "content": "hi"}, token_ids=[5], logprobs=[-0.5])
    assert unknown.sampling is None  # a hand-built Choice: unknown
    with pytest.raises(TrajectoryError):
        tracerl.Choice(message={"role": "assistant", "content": "x"}, sampling={"temperature": -1})
    trajectory = tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, choice, unknown], reward=1.0)
    stored = json.loads(json.dumps(trajectory.to_json_dict()))
    assert stored["messages_and_choices"][1]["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 5}
    again = tracerl.Trajectory.from_json_dict(stored)
    assert [turn.sampling for turn in again.sampled_turns()] == [params, None]
    group = tracerl.TrajectoryGroup.from_json_dict(json.loads(json.dumps(tracerl.TrajectoryGroup([trajectory]).to_json_dict())))
    assert group.trajectories[0].sampled_turns()[0].sampling == params

    # ART-style code appends the SDK's choice itself: read as a Choice with its sampling
    from openai.types.chat import ChatCompletion

    sdk = ChatCompletion.model_validate({"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [{
        "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}, "token_ids": [5],
        "sampling": {"temperature": 0.7, "top_p": 0.9, "top_k": 5}}]})  # fmt: skip
    assert tracerl.Choice.from_openai(sdk.choices[0], sdk).sampling == params
    assert tracerl.History(messages_and_choices=[sdk.choices[0]]).checked_items()[0].sampling == params

    # what capture reads off a server's answer: the field as sent, or unknown (never a guess)
    assert SamplingParams.from_field({"temperature": 0.7, "top_p": 1.0, "top_k": 0}) == SamplingParams(temperature=0.7)
    assert SamplingParams.from_field(None) is None
    assert SamplingParams.from_field({"temperature": -1}) is None and SamplingParams.from_field("0.7") is None


def test_the_wire_field_and_the_vllm_side_without_a_server():
    from tracerl.errors import ConfigError
    from tracerl.inference.protocol import sampling_field, stream_events
    from tracerl.inference.turns import TurnReader
    from tracerl.inference.vllm_proxy import _with_sampling, finish_chat_body, prepare_chat_body
    from tracerl.inference.vllm_server import VLLMServer

    assert sampling_field(0.7, 0.9, 5) == {"temperature": 0.7, "top_p": 0.9, "top_k": 5}
    assert sampling_field(0.0, 0.5, 5) == sampling_field(1e-6) == {"temperature": 0.0, "top_p": 1.0, "top_k": 0}  # greedy filters nothing
    assert sampling_field(1.0, 1.0, -1)["top_k"] == 0  # vLLM's "off"

    # vLLM applies the request's values, else neutral ones (not the model's generation_config.json's)
    body = {"model": "base", "messages": [], "temperature": 0.7, "top_k": None}
    prepare_chat_body(body, "agent", {"agent", "base"})
    assert (body["temperature"], body["top_p"], body["top_k"], body["min_p"], body["repetition_penalty"]) == (0.7, 1.0, 0, 0.0, 1.0)
    answer = {"choices": [{"index": 0, "finish_reason": "length", "token_ids": [1], "message": {"role": "assistant", "content": "x"}}]}
    hermes = TurnReader(tokenizer=None, tool_call_format="hermes", reasoning=False)
    (choice,) = finish_chat_body(answer, False, hermes, sampling_field(0.7))["choices"]
    assert choice["sampling"] == {"temperature": 0.7, "top_p": 1.0, "top_k": 0}
    events = [e for e in stream_events({"id": "c", "created": 0, "model": "m", "choices": [choice]}, False) if e != "data: [DONE]\n\n"]
    assert all(json.loads(e.removeprefix("data: "))["choices"][0]["sampling"] == choice["sampling"] for e in events)
    completion = json.dumps({"choices": [{"index": 0, "text": "x"}]}).encode()
    assert json.loads(_with_sampling(completion, {"temperature": 0.5}))["choices"][0]["sampling"] == {"temperature": 0.5}
    streamed = b'data: {"choices": [{"index": 0, "text": "x"}]}\n\ndata: [DONE]\n\n'
    first = _with_sampling(streamed, {"temperature": 0.5}).decode().split("\n")[0]
    assert json.loads(first.removeprefix("data: "))["choices"][0]["sampling"] == {"temperature": 0.5}

    command = VLLMServer("/m", python="/py").command(8000)
    assert command[command.index("--logprobs-mode") + 1] == "processed_logprobs"
    with pytest.raises(ConfigError, match="processed_logprobs"):
        VLLMServer("/m", python="/py", extra_args=("--logprobs-mode", "raw_logprobs"))


async def test_capture_does_not_guess_what_a_server_did_not_say(served_fake, served_client, own_provider):
    """A server that sends no ``sampling`` (raw vLLM, another provider): unknown, whatever the request asked."""
    async with tracerl.rollout() as scope:
        await served_client.chat.completions.create(model="m", messages=HELLO, temperature=0.7, top_p=0.9)
    (turn,) = scope.trajectory.sampled_turns()
    assert turn.token_ids and turn.sampling is None


# -- the real model on the transformers server ----------------------------------------------------------------
@pytest.fixture(scope="module")
async def server(smol_path):
    pytest.importorskip("torch")
    import tracerl.integrations as ti
    from tracerl.inference import make_server

    server = make_server("transformers", smol_path, served_name=SERVED)
    await server.start()
    ti.register_endpoint(server.base_url)
    try:
        yield server
    finally:
        ti.unregister_endpoint(server.base_url)
        await server.stop()


@pytest.fixture(scope="module")
def reference(smol_path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smol_path, dtype=torch.float32).eval()


@pytest.fixture
def client(server):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=120)


def next_token_logits(reference, turn: tracerl.Choice):
    """The model's own logits for each completion token, from one forward over prompt + completion."""
    import torch

    prompt, ids = turn.prompt_token_ids, turn.token_ids
    with torch.no_grad():
        return reference(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()


def chosen(logprobs, turn: tracerl.Choice):
    import torch

    return logprobs.gather(-1, torch.tensor(turn.token_ids)[:, None])[:, 0]


def filtered(logits, temperature: float, top_p: float = 1.0, top_k: int = 0):
    """The reference filter, written independently of the engine's: logits / T, then all but the k largest
    and all outside the smallest most-likely set whose probability reaches top_p at -inf."""
    import torch

    scaled = logits / temperature
    out = torch.full_like(scaled, float("-inf"))
    for row in range(scaled.shape[0]):
        order = torch.argsort(scaled[row], descending=True)
        keep = order[:top_k] if top_k else order
        probs = torch.softmax(scaled[row][keep], dim=-1)
        before = torch.cumsum(probs, 0) - probs  # the mass of the more likely tokens
        keep = keep[before < top_p]
        out[row, keep] = scaled[row, keep]
    return out


@pytest.mark.real_model
async def test_a_rollout_records_the_tempered_distribution(client, reference):
    """temperature=0.7 through the OpenAI SDK in a rollout: each recorded logprob is log_softmax(logits / 0.7)."""
    import torch

    async with tracerl.rollout() as scope:
        response = await client.chat.completions.create(model=SERVED, messages=HELLO, temperature=0.7, seed=3, max_tokens=12)
    (turn,) = scope.trajectory.sampled_turns()
    assert turn.sampling == SamplingParams(temperature=0.7)
    assert response.choices[0].model_extra["sampling"] == {"temperature": 0.7, "top_p": 1.0, "top_k": 0}
    logits = next_token_logits(reference, turn)
    recorded = torch.tensor(turn.logprobs)
    tempered = chosen(torch.log_softmax(logits / 0.7, dim=-1), turn)
    untempered = chosen(torch.log_softmax(logits, dim=-1), turn)
    assert float((recorded - tempered).abs().max()) < TOLERANCE, (recorded, tempered)
    assert float((recorded - untempered).abs().max()) > 1e-2  # the check can tell them apart


@pytest.mark.real_model
@pytest.mark.parametrize("knobs", [{"top_p": 0.9}, {"extra_body": {"top_k": 5}}], ids=["top_p", "top_k"])
async def test_top_p_and_top_k_record_the_filtered_renormalised_distribution(client, reference, knobs):
    import torch

    async with tracerl.rollout() as scope:
        response = await client.chat.completions.create(model=SERVED, messages=HELLO, temperature=0.7, seed=5, max_tokens=12,
                                                        logprobs=True, top_logprobs=8, **knobs)  # fmt: skip
    (turn,) = scope.trajectory.sampled_turns()
    top_p, top_k = knobs.get("top_p", 1.0), knobs.get("extra_body", {}).get("top_k", 0)
    if top_k:  # the alternatives outside the top 5 were filtered out: -inf, sent as vLLM's floor
        for entry in response.choices[0].logprobs.content:
            assert sorted(alt.logprob == -9999.0 for alt in entry.top_logprobs) == [False] * 5 + [True] * 3
    assert turn.sampling == SamplingParams(temperature=0.7, top_p=top_p, top_k=top_k)
    logits = next_token_logits(reference, turn)
    recorded = torch.tensor(turn.logprobs)
    expected = chosen(torch.log_softmax(filtered(logits, 0.7, top_p, top_k), dim=-1), turn)
    assert float((recorded - expected).abs().max()) < TOLERANCE, (recorded, expected)
    tempered_only = chosen(torch.log_softmax(logits / 0.7, dim=-1), turn)
    assert float((recorded - tempered_only).abs().max()) > 1e-2  # the filter's renormalisation shows


@pytest.mark.real_model
async def test_every_route_carries_the_sampling_and_greedy_stays_raw(server, client, reference):
    """Streamed chat, legacy completions, Anthropic Messages and the Responses API: each answer says what it
    sampled with and capture records it; greedy turns record temperature 0 and the raw logprobs."""
    import anthropic
    import httpx
    import torch

    async with tracerl.rollout() as scope:
        stream = await client.chat.completions.create(model=SERVED, messages=HELLO, temperature=0.5, top_p=0.8, max_tokens=4, stream=True)
        chunks = [chunk async for chunk in stream]
    (turn,) = scope.trajectory.sampled_turns()
    assert turn.sampling == SamplingParams(temperature=0.5, top_p=0.8)
    assert chunks[0].choices[0].model_extra["sampling"] == chunks[-1].choices[0].model_extra["sampling"]

    async with tracerl.rollout() as scope:
        await client.chat.completions.create(model=SERVED, messages=HELLO, temperature=0.0, max_tokens=6)
    (greedy,) = scope.trajectory.sampled_turns()
    assert greedy.sampling == SamplingParams(temperature=0.0) and greedy.sampling.greedy
    raw = chosen(torch.log_softmax(next_token_logits(reference, greedy), dim=-1), greedy)
    assert float((torch.tensor(greedy.logprobs) - raw).abs().max()) < TOLERANCE

    claude = anthropic.AsyncAnthropic(base_url=server.base_url.removesuffix("/v1"), api_key=server.api_key, max_retries=0)
    async with tracerl.rollout() as scope:
        await claude.messages.create(model=SERVED, max_tokens=4, messages=HELLO, extra_body={"temperature": 0.6, "top_k": 7})
        await client.responses.create(model=SERVED, input=HELLO[0]["content"], max_output_tokens=4, temperature=0.9)
    assert [t.sampling for t in scope.trajectory.sampled_turns()] in (
        [SamplingParams(temperature=0.6, top_k=7), SamplingParams(temperature=0.9)],
        [SamplingParams(temperature=0.9), SamplingParams(temperature=0.6, top_k=7)],  # two conversations: either order
    )

    prompt = server.engine.tokenizer("The sea is", add_special_tokens=False)["input_ids"]
    async with httpx.AsyncClient(base_url=server.base_url, headers={"Authorization": f"Bearer {server.api_key}"}) as http:
        answer = (await http.post("/completions", json={"model": SERVED, "prompt": prompt, "max_tokens": 3, "temperature": 0.7,
                                                         "top_k": 5, "logprobs": 0, "seed": 1, "return_token_ids": True})).json()  # fmt: skip
    (choice,) = answer["choices"]
    assert choice["sampling"] == {"temperature": 0.7, "top_p": 1.0, "top_k": 5}
    turn = tracerl.Choice(message={"role": "assistant", "content": choice["text"]}, prompt_token_ids=prompt, token_ids=choice["token_ids"])
    expected = chosen(torch.log_softmax(filtered(next_token_logits(reference, turn), 0.7, top_k=5), dim=-1), turn)
    assert float((torch.tensor(choice["logprobs"]["token_logprobs"]) - expected).abs().max()) < TOLERANCE
