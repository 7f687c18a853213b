"""OpenAI's Responses API and Anthropic's Messages API on tracerl's endpoint, with the real model.

Each request is translated onto the chat-completions path, so the tests hold every answer
against what that path samples for the same conversation: the same prompt token ids (the
model's own chat template), the same greedy token ids, and logprobs one per sampled token.
The clients are the vendors' own SDKs (``openai`` ``responses``, ``anthropic`` ``messages``).
One transformers server serves the module; the vLLM proxy's routes are in
``tests/test_inference_contract.py``.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from openai import AsyncOpenAI

from tracerl.base_models import resolve_base_model
from tracerl.inference import make_server

pytestmark = [pytest.mark.real_model, pytest.mark.asyncio(loop_scope="module")]

SERVED = "agent"
SEA = "Write one short sentence about the sea."
SYSTEM = "You are a calculator. Always answer by calling the add tool."
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": SCHEMA}}]
RESPONSES_TOOLS = [{"type": "function", "name": "add", "description": "Add two integers.", "parameters": SCHEMA, "strict": True}]
ANTHROPIC_TOOLS = [{"name": "add", "description": "Add two integers.", "input_schema": SCHEMA}]
FEW_SHOT = [(2, 3), (7, 8)]
"""Earlier turns in which the assistant called the tool (as tests/test_inference_contract.py), so that the small
model (greedy) calls it again; with the tool results in them it imitates a result instead."""


def _arguments(a: int, b: int) -> str:
    return f'{{"a": {a}, "b": {b}}}'


def chat_messages() -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}]
    for i, (a, b) in enumerate(FEW_SHOT):
        call = {"id": f"call_{i}", "type": "function", "function": {"name": "add", "arguments": _arguments(a, b)}}
        messages += [{"role": "user", "content": f"Add {a} and {b}."}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    return messages + [{"role": "user", "content": "Add 4 and 6."}]


def responses_input() -> list[dict]:
    items: list[dict] = []
    for i, (a, b) in enumerate(FEW_SHOT):
        items += [{"role": "user", "content": f"Add {a} and {b}."},
                  {"type": "function_call", "call_id": f"call_{i}", "name": "add", "arguments": _arguments(a, b)}]  # fmt: skip
    return items + [{"role": "user", "content": "Add 4 and 6."}]


def anthropic_messages() -> list[dict]:
    messages: list[dict] = []
    for i, (a, b) in enumerate(FEW_SHOT):
        messages += [{"role": "user", "content": f"Add {a} and {b}."},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": f"call_{i}", "name": "add", "input": {"a": a, "b": b}}]}]
    return messages + [{"role": "user", "content": "Add 4 and 6."}]


@pytest.fixture(scope="module")
async def server():
    server = make_server("transformers", resolve_base_model("smollm2-135m"), served_name=SERVED)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_base_model("smollm2-135m"))


@pytest.fixture
def oai(server):
    return AsyncOpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=300)


@pytest.fixture
def claude(server):
    return anthropic.AsyncAnthropic(base_url=server.base_url.removesuffix("/v1"), api_key=server.api_key, max_retries=0, timeout=300)


def rendered(tokenizer, messages, tools=None) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


async def chat_reference(oai, messages, tools=None, max_tokens=12):
    """The chat-completions path's greedy answer to the same conversation: the reference."""
    extra = {"tools": tools} if tools else {}
    return await oai.chat.completions.create(model=SERVED, messages=messages, temperature=0.0, max_tokens=max_tokens,
                                             extra_body={"return_token_ids": True}, **extra)  # fmt: skip


async def chat_ids(oai, messages, tools=None, max_tokens=12) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy sampled ids) of :func:`chat_reference`."""
    response = await chat_reference(oai, messages, tools, max_tokens)
    return response.model_extra["prompt_token_ids"], response.choices[0].model_extra["token_ids"]


def sampled(answer) -> tuple[list[int], list[int], list[float]]:
    extra = answer.model_extra
    return extra["prompt_token_ids"], extra["token_ids"], extra["token_logprobs"]


# -- OpenAI Responses --------------------------------------------------------------------------------------
async def test_responses_create_keeps_the_sampled_tokens(oai, tokenizer):
    response = await oai.responses.create(model=SERVED, input=SEA, max_output_tokens=12, temperature=0.0)
    prompt, ids, logprobs = sampled(response)
    reference = await chat_reference(oai, [{"role": "user", "content": SEA}])
    assert (prompt, ids) == (reference.model_extra["prompt_token_ids"], reference.choices[0].model_extra["token_ids"])
    assert prompt == rendered(tokenizer, [{"role": "user", "content": SEA}])
    assert response.output_text == reference.choices[0].message.content
    assert response.status == ("incomplete" if reference.choices[0].finish_reason == "length" else "completed")
    assert len(logprobs) == len(ids) and all(lp <= 0.0 for lp in logprobs)
    assert response.usage.input_tokens == len(prompt) and response.usage.output_tokens == len(ids)


async def test_responses_tool_call_then_previous_response_id(oai, tokenizer):
    response = await oai.responses.create(model=SERVED, input=responses_input(), instructions=SYSTEM, tools=RESPONSES_TOOLS,
                                          max_output_tokens=40, temperature=0.0)  # fmt: skip
    prompt, ids, _ = sampled(response)
    messages = chat_messages()
    assert (prompt, ids) == await chat_ids(oai, messages, CHAT_TOOLS, max_tokens=40)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "add" and json.loads(call.arguments) == {"a": 4, "b": 6}
    assert call.arguments in tokenizer.decode(ids)  # the model's own text
    follow = await oai.responses.create(
        model=SERVED, previous_response_id=response.id, instructions=SYSTEM, tools=RESPONSES_TOOLS, max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "10"}], temperature=0.0,
    )  # fmt: skip
    next_prompt = sampled(follow)[0]
    assert next_prompt[: len(prompt) + len(ids)] == prompt + ids  # the conversation extends what was sampled, token for token


async def test_responses_stream_ends_with_the_same_response(oai):
    reference = await oai.responses.create(model=SERVED, input=SEA, max_output_tokens=8, temperature=0.0)
    kinds, text, final = [], "", None
    async with oai.responses.stream(model=SERVED, input=SEA, max_output_tokens=8, temperature=0.0) as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type in ("response.completed", "response.incomplete"):  # 8 tokens: usually cut, as the API says
                final = event.response
    assert kinds[0] == "response.created" and kinds[-1] == f"response.{reference.status}"
    assert final is not None and text == final.output_text == reference.output_text
    assert sampled(final)[:2] == sampled(reference)[:2]
    seen = [e for e in kinds if e.startswith("response.output_item")]
    assert seen == ["response.output_item.added", "response.output_item.done"]


async def test_responses_errors_say_what_to_fix(oai):
    with pytest.raises(openai.BadRequestError, match="web_search"):
        await oai.responses.create(model=SERVED, input=SEA, tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        await oai.responses.create(model=SERVED, input=SEA, text={"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}})
    with pytest.raises(openai.BadRequestError, match="unsupported field.*frobnicate"):
        await oai.responses.create(model=SERVED, input=SEA, extra_body={"frobnicate": 1})
    with pytest.raises(openai.NotFoundError, match="previous_response_id 'resp_nope' is unknown"):
        await oai.responses.create(model=SERVED, input=SEA, previous_response_id="resp_nope")


# -- Anthropic Messages ------------------------------------------------------------------------------------
async def test_anthropic_messages_create_keeps_the_sampled_tokens(claude, oai):
    message = await claude.messages.create(model=SERVED, max_tokens=12, extra_body={"temperature": 0.0}, messages=[{"role": "user", "content": SEA}])
    prompt, ids, logprobs = sampled(message)
    assert (prompt, ids) == await chat_ids(oai, [{"role": "user", "content": SEA}])
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens") and len(logprobs) == len(ids)
    assert message.usage.input_tokens == len(prompt) and message.usage.output_tokens == len(ids)


async def test_anthropic_tool_use_round_trips_as_sampled(claude, oai):
    message = await claude.messages.create(model=SERVED, max_tokens=40, extra_body={"temperature": 0.0}, system=SYSTEM, tools=ANTHROPIC_TOOLS,
                                           messages=anthropic_messages())  # fmt: skip
    prompt, ids, _ = sampled(message)
    assert (prompt, ids) == await chat_ids(oai, chat_messages(), CHAT_TOOLS, max_tokens=40)
    assert message.stop_reason == "tool_use"
    (use,) = [block for block in message.content if block.type == "tool_use"]
    assert use.name == "add" and use.input == {"a": 4, "b": 6}
    follow = await claude.messages.create(
        model=SERVED, max_tokens=8, extra_body={"temperature": 0.0}, system=SYSTEM, tools=ANTHROPIC_TOOLS,
        messages=[*anthropic_messages(), {"role": "assistant", "content": [b.model_dump() for b in message.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "10"}]}],
    )  # fmt: skip
    next_prompt = sampled(follow)[0]
    assert next_prompt[: len(prompt) + len(ids)] == prompt + ids  # the call's text is rendered as the model wrote it


async def test_anthropic_stream_ends_with_the_same_message(claude):
    reference = await claude.messages.create(model=SERVED, max_tokens=8, extra_body={"temperature": 0.0}, messages=[{"role": "user", "content": SEA}])
    async with claude.messages.stream(model=SERVED, max_tokens=8, extra_body={"temperature": 0.0}, messages=[{"role": "user", "content": SEA}]) as stream:
        text = "".join([piece async for piece in stream.text_stream])
        final = await stream.get_final_message()
    assert text == final.content[0].text == reference.content[0].text
    assert final.stop_reason == reference.stop_reason
    assert sampled(final)[:2] == sampled(reference)[:2]


async def test_anthropic_sdk_key_header_and_error_shape(server, claude):
    assert isinstance(claude.api_key, str)  # the SDK sends it as x-api-key, which the server accepts
    with pytest.raises(anthropic.BadRequestError, match="image"):
        await claude.messages.create(model=SERVED, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])  # fmt: skip
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        await claude.messages.create(model=SERVED, max_tokens=0, messages=[{"role": "user", "content": SEA}])
    async with httpx.AsyncClient(timeout=60) as http:
        url = server.base_url + "/messages"
        body = {"model": SERVED, "max_tokens": 2, "messages": [{"role": "user", "content": SEA}]}
        assert (await http.post(url, json=body, headers={"x-api-key": server.api_key + "x"})).status_code == 401
        bad = await http.post(url, json={**body, "frobnicate": 1}, headers={"x-api-key": server.api_key})
        assert bad.status_code == 400 and bad.json()["type"] == "error"
        assert bad.json()["error"] == {"type": "invalid_request_error", "message": "unsupported field(s) for /v1/messages: frobnicate"}
