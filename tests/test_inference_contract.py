"""One contract for every ``InferenceServer``, run on the real SmolLM2-135M model.

Each server kind is started once per session.  The vLLM case is skipped (with the reason)
when its runtime venv is not installed: ``python -m tracerl.inference.vllm_server install``.
Run heavy: ``flock /tmp/tracerl-heavy.lock .venv/bin/python -m pytest -q tests/test_inference_contract.py``.
"""

from __future__ import annotations

import asyncio
import math

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from tracerl.base_models import resolve_base_model
from tracerl.inference import InferenceServer, make_server

pytestmark = [pytest.mark.real_model, pytest.mark.asyncio(loop_scope="session")]

SERVED = "agent"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
# A few-shot history that makes the base model (greedy) call the tool again.
def _call(a: int, b: int, index: int) -> dict:
    arguments = f'{{"a": {a}, "b": {b}}}'
    function = {"name": "add", "arguments": arguments}
    return {"role": "assistant", "content": "", "tool_calls": [{"id": f"call_{index}", "type": "function", "function": function}]}


TOOL_MESSAGES = [
    {"role": "system", "content": "You are a calculator. Always answer by calling the add tool."},
    {"role": "user", "content": "Add 2 and 3."},
    _call(2, 3, 1),
    {"role": "user", "content": "Add 7 and 8."},
    _call(7, 8, 2),
    {"role": "user", "content": "Add 4 and 6."},
]
HELLO = [{"role": "user", "content": "Write one short sentence about the sea."}]


@pytest.fixture(scope="session")
def model_path():
    return resolve_base_model("smollm2-135m")


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="session")
def reference_model(model_path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def _make_adapter(model_path, target, seed: int) -> str:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:  # B starts at zero: make the adapter actually change the outputs
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    peft_model.save_pretrained(target)
    return str(target)


@pytest.fixture(scope="session")
def adapters(model_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {seed: _make_adapter(model_path, root / f"seed{seed}", seed) for seed in (1, 2)}


def _vllm_missing() -> str | None:
    from tracerl.inference.vllm_server import vllm_python

    if vllm_python() is None:
        return (
            "the vLLM runtime is not installed (run `python -m tracerl.inference.vllm_server install` "
            "or set TRACERL_VLLM_PYTHON)"
        )
    return None


@pytest.fixture(scope="session", params=["transformers", "vllm"])
async def server(request, model_path):
    if request.param == "vllm" and (reason := _vllm_missing()):
        pytest.skip(reason)
    server = make_server(request.param, model_path, served_name=SERVED)
    assert isinstance(server, InferenceServer)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
def client(server):
    return AsyncOpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=300)


async def _chat(client, messages=HELLO, model=SERVED, **kwargs):
    kwargs.setdefault("max_tokens", 8)
    extra = kwargs.pop("extra_body", {})
    return await client.chat.completions.create(
        model=model, messages=messages, extra_body={"return_token_ids": True, **extra}, **kwargs
    )


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def _rendered(tokenizer, messages, tools=None) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


async def test_a_caller_without_the_servers_key_gets_401(server, adapters):
    """The server listens on loopback, where any local user can connect: without its random
    per-process key nobody generates with it or swaps the adapter being trained."""
    assert len(server.api_key) >= 32
    root = server.base_url.removesuffix("/v1")
    chat = {"model": SERVED, "messages": HELLO, "max_tokens": 2}
    load = {"lora_name": f"{SERVED}@evil", "lora_path": adapters[1], "load_inplace": True}
    async with httpx.AsyncClient(base_url=root, timeout=60) as http:
        assert (await http.get("/health")).status_code == 200  # health stays open (readiness probes)
        for headers in ({}, {"Authorization": "Bearer tracerl"}, {"Authorization": f"Bearer {server.api_key}x"}):
            for method, path, body in [("POST", "/v1/chat/completions", chat), ("GET", "/v1/models", None),
                                       ("POST", "/v1/load_lora_adapter", load)]:  # fmt: skip
                response = await http.request(method, path, json=body, headers=headers)
                assert response.status_code == 401, (path, headers, response.text)
        if getattr(server, "vllm_url", None):  # vLLM's own port, behind the proxy, checks the same key (VLLM_API_KEY)
            for method, path, body in [("POST", "/v1/chat/completions", chat), ("POST", "/v1/load_lora_adapter", load)]:
                assert (await http.request(method, server.vllm_url + path, json=body)).status_code == 401
            # ... and so do the dev-mode routes vLLM's own check leaves open (tracerl's guard middleware)
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": adapters[1]}}
            for method, path, body in [("POST", "/pause", None), ("POST", "/collective_rpc", rpc),
                                       ("POST", "/reset_prefix_cache", None), ("GET", "/metrics", None)]:  # fmt: skip
                response = await http.request(method, server.vllm_url + path, json=body)
                assert response.status_code == 401, (path, response.text)
            assert (await http.get(server.vllm_url + "/health")).status_code == 200
        keyed = {"Authorization": f"Bearer {server.api_key}"}
        names = {m["id"] for m in (await http.get("/v1/models", headers=keyed)).json()["data"]}
        assert f"{SERVED}@evil" not in names  # the unauthorised load did nothing
        assert (await http.post("/v1/chat/completions", json=chat, headers=keyed)).status_code == 200
    from tracerl.redact import redact_text

    assert server.api_key not in redact_text(f"the value {server.api_key} here")  # registered as a secret


async def test_lifecycle_and_models(server, client):
    assert server.base_url.endswith("/v1")
    assert await server.health()
    names = [model.id for model in (await client.models.list()).data]
    assert SERVED in names


async def test_token_ids_and_logprobs_match_the_tokenizer(client, tokenizer):
    response = await _chat(client, logprobs=True, temperature=1.0, seed=7, max_tokens=10)
    prompt_ids = response.model_extra["prompt_token_ids"]
    assert prompt_ids == _rendered(tokenizer, HELLO)
    (choice,) = response.choices
    ids = _ids(choice)
    assert ids and choice.model_extra["prompt_token_ids"] == prompt_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == choice.message.content
    logprobs = [entry.logprob for entry in choice.logprobs.content]
    assert len(logprobs) == len(ids)
    assert all(math.isfinite(lp) and lp <= 0.0 for lp in logprobs)
    assert [entry.token for entry in choice.logprobs.content] == [tokenizer.decode([i]) for i in ids]
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == len(ids)
    if choice.finish_reason == "stop":
        assert ids[-1] == tokenizer.eos_token_id  # the stop token is part of the sampled ids
    else:
        assert choice.finish_reason == "length" and len(ids) == 10


async def test_a_rollout_records_the_sampled_distribution(server, client, reference_model):
    """Sampled at temperature 0.7 through the OpenAI SDK inside a rollout: the answer's logprobs, and the
    captured ``Choice.logprobs``, are those of the tempered distribution (vLLM: ``--logprobs-mode
    processed_logprobs``), and the turn records its sampling (tests/test_sampled_distribution.py: the rest)."""
    import torch

    import tracerl
    import tracerl.integrations as ti

    ti.register_endpoint(server.base_url)
    try:
        async with tracerl.rollout() as scope:
            response = await _chat(client, logprobs=True, temperature=0.7, seed=3, max_tokens=8)
    finally:
        ti.unregister_endpoint(server.base_url)
    (turn,) = scope.trajectory.sampled_turns()
    prompt_ids, ids = turn.prompt_token_ids, turn.token_ids
    assert prompt_ids == response.model_extra["prompt_token_ids"] and ids == _ids(response.choices[0])
    assert response.choices[0].model_extra["sampling"] == {"temperature": 0.7, "top_p": 1.0, "top_k": 0}
    assert turn.sampling == tracerl.SamplingParams(temperature=0.7)
    with torch.no_grad():
        logits = reference_model(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1 : -1].float()
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
    served = torch.tensor([entry.logprob for entry in response.choices[0].logprobs.content])
    assert torch.equal(served, torch.tensor(turn.logprobs))
    assert float((served - expected).abs().max()) < 1e-4, (served, expected)  # measured: < 3e-5 on both servers


async def test_top_logprobs(client):
    choice = (await _chat(client, logprobs=True, top_logprobs=3, temperature=0.0, max_tokens=4)).choices[0]
    for entry in choice.logprobs.content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token is the most likely one
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-3


async def test_n_choices(client, tokenizer):
    response = await _chat(client, n=3, temperature=1.0, logprobs=True, max_tokens=6)
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    for choice in response.choices:
        ids = _ids(choice)
        assert 1 <= len(ids) <= 6 and len(choice.logprobs.content) == len(ids)
        assert tokenizer.decode(ids, skip_special_tokens=True) == choice.message.content
    assert response.usage.completion_tokens == sum(len(_ids(c)) for c in response.choices)


async def test_greedy_and_seeded_sampling_are_reproducible(client):
    greedy = [_ids((await _chat(client, temperature=0.0)).choices[0]) for _ in range(2)]
    assert greedy[0] == greedy[1]
    seeded = [_ids((await _chat(client, temperature=1.0, seed=11)).choices[0]) for _ in range(2)]
    assert seeded[0] == seeded[1]


async def test_max_tokens_and_stop(client):
    response = await _chat(client, temperature=0.0, max_completion_tokens=3)
    assert response.choices[0].finish_reason == "length" and len(_ids(response.choices[0])) == 3
    full = (await _chat(client, temperature=0.0, max_tokens=8)).choices[0].message.content
    word = full.split()[2]
    stopped = (await _chat(client, temperature=0.0, max_tokens=8, stop=[word])).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.message.content == full[: full.index(word)]


async def test_tools_render_and_calls_are_parsed(client, tokenizer):
    response = await _chat(client, messages=TOOL_MESSAGES, tools=TOOLS, temperature=0.0, max_tokens=40)
    assert response.model_extra["prompt_token_ids"] == _rendered(tokenizer, TOOL_MESSAGES, TOOLS)
    choice = response.choices[0]
    raw = tokenizer.decode(_ids(choice), skip_special_tokens=True)
    assert "<tool_call>" in raw, f"the few-shot prompt no longer elicits a tool call: {raw!r}"
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "add"
    assert call.function.arguments in raw  # the model's own text, so re-rendering reproduces the tokens
    assert not choice.message.content
    # tool_choice="none": the text stays content
    plain = (await _chat(client, messages=TOOL_MESSAGES, tools=TOOLS, tool_choice="none", temperature=0.0,
                         max_tokens=40)).choices[0]  # fmt: skip
    assert not plain.message.tool_calls and "<tool_call>" in (plain.message.content or "")


async def _greedy(client, model=SERVED) -> tuple[list[int], list[float]]:
    choice = (await _chat(client, model=model, temperature=0.0, max_tokens=12, logprobs=True)).choices[0]
    return _ids(choice), [entry.logprob for entry in choice.logprobs.content]


def _same(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]], tolerance: float = 1e-3) -> bool:
    return a[0] == b[0] and all(abs(x - y) <= tolerance for x, y in zip(a[1], b[1]))


async def test_adapters_load_swap_and_unload(server, client, adapters):
    base = await _greedy(client)
    assert _same(base, await _greedy(client, model="base"))
    await server.load_adapter(f"{SERVED}@1", adapters[1])
    first = await _greedy(client, f"{SERVED}@1")
    assert not _same(first, base)
    await server.load_adapter(f"{SERVED}@1", adapters[2])  # replaced in place
    swapped = await _greedy(client, f"{SERVED}@1")
    assert not _same(swapped, first)
    await server.load_adapter(f"{SERVED}@2", adapters[1])
    assert _same(await _greedy(client, f"{SERVED}@2"), first, tolerance=1e-2)
    assert _same(await _greedy(client, f"{SERVED}@1"), swapped, tolerance=1e-2)
    assert _same(await _greedy(client), base)  # the base model is untouched
    names = {model.id for model in (await client.models.list()).data}
    assert {SERVED, f"{SERVED}@1", f"{SERVED}@2"} <= names
    async with httpx.AsyncClient(base_url=server.base_url, headers={"Authorization": f"Bearer {server.api_key}"}) as http:
        response = await http.post("/unload_lora_adapter", json={"lora_name": f"{SERVED}@2"})
        assert response.status_code == 200, response.text
        response = await http.post("/load_lora_adapter", json={"lora_name": f"{SERVED}@2", "lora_path": adapters[1]})
        assert response.status_code == 200, response.text
        response = await http.post("/load_lora_adapter", json={"lora_name": "x@1", "lora_path": "/nonexistent"})
        assert response.status_code in (400, 404) and "error" in response.json()


async def _stream_text(client, model: str) -> tuple[str, set[str]]:
    """A greedy streamed completion: its text and every ``model`` its chunks named."""
    stream = await client.chat.completions.create(model=model, messages=HELLO, temperature=0.0, max_tokens=24, stream=True)
    text, names = "", set()
    async for chunk in stream:
        names.add(chunk.model)
        text += "".join(choice.delta.content or "" for choice in chunk.choices)
    return text, names


async def _requests_running(server) -> int:
    """Requests being generated: the transformers engine's rows so far, or vLLM's running gauge.

    (Both servers stream a completion once it is generated, so a first chunk cannot say this.)"""
    engine = getattr(server, "engine", None)
    if engine is not None:
        return engine.stats["rows"]  # counted when their batch starts decoding; batches run one at a time
    async with httpx.AsyncClient(timeout=10, headers=server.auth_headers()) as http:
        metrics = (await http.get(server.vllm_url + "/metrics")).text
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith("vllm:num_requests_running")))


async def test_the_trainers_hot_load_under_16_streams_fails_none_and_mixes_no_policies(server, client, adapters):
    """What a step does to the server while rollouts stream: pause, load ``name@s``, unload
    ``name@s-2``, resume.  Here all 16 streams use the adapter being unloaded, the worst case: each
    finishes on the adapter it started on (its text is that adapter's greedy text), none fails,
    and only requests that start after the unload are refused."""
    old, new = f"{SERVED}@31", f"{SERVED}@32"
    await server.load_adapter(old, adapters[1])
    before, _ = await _stream_text(client, old)
    running = await _requests_running(server)
    streams = [asyncio.ensure_future(_stream_text(client, old)) for _ in range(16)]
    try:
        async with asyncio.timeout(120):
            while await _requests_running(server) < running + 16:  # all 16 are being generated
                await asyncio.sleep(0.01)
        await server.pause()
        try:
            assert not all(stream.done() for stream in streams)  # paused mid-generation
            await server.load_adapter(new, adapters[2])
            await server.unload_adapter(old)
        finally:
            await server.resume()
        finished = await asyncio.wait_for(asyncio.gather(*streams), 300)
    finally:
        for stream in streams:
            stream.cancel()
    after, names = await _stream_text(client, new)
    assert after != before and names == {new}  # the two policies write different greedy text
    assert all(text == before and names == {old} for text, names in finished), finished
    with pytest.raises(openai.NotFoundError):
        await _chat(client, model=old)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"model": "no-such-model"}, openai.NotFoundError),
        ({"temperature": -1.0}, openai.BadRequestError),
        ({"n": 0}, openai.BadRequestError),
        ({"max_tokens": 0}, openai.BadRequestError),
        ({"messages": []}, openai.BadRequestError),
    ],
)
async def test_bad_requests_get_openai_errors(client, kwargs, error):
    with pytest.raises(error) as caught:
        await _chat(client, **kwargs)
    body = caught.value.body
    assert isinstance(body, dict) and isinstance(body.get("message"), str) and body["message"]
    assert "type" in body


async def test_concurrent_requests(server, client, tokenizer):
    prompts = [[{"role": "user", "content": f"Name a color number {i}."}] for i in range(6)]
    responses = await asyncio.gather(*[_chat(client, messages=m, temperature=1.0, max_tokens=6) for m in prompts])
    for messages, response in zip(prompts, responses):
        assert response.model_extra["prompt_token_ids"] == _rendered(tokenizer, messages)
        assert 1 <= len(_ids(response.choices[0])) <= 6
    engine = getattr(server, "engine", None)
    if engine is not None:  # the transformers server batches rather than serving one by one
        assert engine.stats["max_rows"] >= 2


async def test_pause_holds_generation_until_resume(server, client, adapters):
    await server.pause()
    try:
        pending = asyncio.ensure_future(_chat(client, temperature=0.0, max_tokens=4))
        await asyncio.sleep(1.5)
        assert not pending.done()
        # a trainer loads its new checkpoint while rollouts are paused
        await asyncio.wait_for(server.load_adapter(f"{SERVED}@9", adapters[1]), 60)
        assert not pending.done()
    finally:
        await server.resume()
    response = await asyncio.wait_for(pending, 120)
    assert _ids(response.choices[0])


async def test_streaming_clients_get_the_same_completion(client):
    expected = (await _chat(client, temperature=0.0, max_tokens=6)).choices[0]
    stream = await client.chat.completions.create(
        model=SERVED, messages=HELLO, temperature=0.0, max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    content, finish, usage = "", None, None
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    assert content == expected.message.content and finish == expected.finish_reason
    assert usage is not None and usage.completion_tokens == len(_ids(expected))
    tool_stream = await client.chat.completions.create(
        model=SERVED, messages=TOOL_MESSAGES, tools=TOOLS, temperature=0.0, max_tokens=40, stream=True
    )
    names = []
    async for chunk in tool_stream:
        for choice in chunk.choices:
            names += [call.function.name for call in choice.delta.tool_calls or []]
    assert names == ["add"]


async def test_responses_and_messages_routes_sample_as_chat_does(server, client):
    """OpenAI's Responses API and Anthropic's Messages API on each server (tests/test_api_protocols.py holds the rest)."""
    import anthropic

    reference = (await _chat(client, temperature=0.0, max_tokens=6)).choices[0]
    response = await client.responses.create(model=SERVED, input=HELLO[0]["content"], max_output_tokens=6, temperature=0.0)
    assert response.model_extra["token_ids"] == _ids(reference) and response.output_text == reference.message.content
    claude = anthropic.AsyncAnthropic(base_url=server.base_url.removesuffix("/v1"), api_key=server.api_key, max_retries=0, timeout=300)
    message = await claude.messages.create(model=SERVED, max_tokens=6, messages=HELLO, extra_body={"temperature": 0.0})
    assert message.model_extra["token_ids"] == _ids(reference) and message.content[0].text == reference.message.content
    with pytest.raises(anthropic.BadRequestError, match="frobnicate"):
        await claude.messages.create(model=SERVED, max_tokens=6, messages=HELLO, extra_body={"frobnicate": 1})
