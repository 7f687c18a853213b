"""Agents on OpenAI's Responses API and Anthropic's Messages API become trajectories, with the real model.

Inside ``tracerl.rollout`` the vendors' own SDKs call tracerl's endpoint unchanged
(``responses.create``, ``responses.stream``, ``messages.create``, ``messages.stream``, each with
a tool, and the OpenAI Agents SDK's ``Runner.run`` with a function tool on its default Responses
model class); each sampled turn of the trajectory carries exactly the token ids and logprobs the
server sampled for that call (read from the server's own answers, never re-tokenised), the
conversation and the tools are there, and one GRPO step trains on them.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

import tracerl
from capture_helpers import served_and_recorded

pytestmark = [pytest.mark.real_model, pytest.mark.asyncio(loop_scope="module")]
anthropic = pytest.importorskip("anthropic")
agents = pytest.importorskip("agents")  # the OpenAI Agents SDK (openai-agents)
pytest.importorskip("torch")
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")  # offline: it would export its own traces to OpenAI

SYSTEM = "You are a calculator. Always answer by calling the add tool."
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
FEW_SHOT = [(2, 3), (7, 8)]


@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    """A trainable model on a LocalBackend (transformers server); every answer the server gives, recorded."""
    async with served_and_recorded("capture-apis", tmp_path_factory.mktemp("runs")) as served:
        yield served


def responses_input(a: int, b: int) -> list[dict]:
    items: list[dict] = []
    for i, (x, y) in enumerate(FEW_SHOT):
        items += [{"role": "user", "content": f"Add {x} and {y}."},
                  {"type": "function_call", "call_id": f"call_{i}", "name": "add", "arguments": f'{{"a": {x}, "b": {y}}}'}]  # fmt: skip
    return items + [{"role": "user", "content": f"Add {a} and {b}."}]


def anthropic_messages(a: int, b: int) -> list[dict]:
    messages: list[dict] = []
    for i, (x, y) in enumerate(FEW_SHOT):
        messages += [{"role": "user", "content": f"Add {x} and {y}."},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": f"call_{i}", "name": "add", "input": {"a": x, "b": y}}]}]
    return messages + [{"role": "user", "content": f"Add {a} and {b}."}]


def run_add(arguments: object) -> str:
    """The tool, as an agent runs it: a sampled call with bad arguments (a list, a word) gets an error back, not a crash."""
    try:
        return str(int(arguments["a"]) + int(arguments["b"]))  # type: ignore[index]
    except (KeyError, TypeError, ValueError) as error:
        return f"error: add needs integers a and b ({error})"


async def responses_agent(model, a: int, b: int, *, stream: bool) -> float:
    """An agent on the Responses API: call the tool it asks for, give the result back by previous_response_id."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key, max_retries=0)
    tools = [{"type": "function", "name": "add", "description": "Add two integers.", "parameters": SCHEMA}]
    settings = {"model": model.get_inference_name(), "instructions": SYSTEM, "tools": tools, "max_output_tokens": 40, "temperature": 1.0}
    if stream:
        response = None
        async with client.responses.stream(input=responses_input(a, b), **settings) as events:
            async for event in events:
                if event.type in ("response.completed", "response.incomplete"):  # a cut answer ends "incomplete"
                    response = event.response
        assert response is not None
    else:
        response = await client.responses.create(input=responses_input(a, b), **settings)
    calls = [item for item in response.output if item.type == "function_call"]
    if not calls:
        return 0.0
    try:
        arguments = json.loads(calls[0].arguments)
    except json.JSONDecodeError:
        arguments = calls[0].arguments
    result = run_add(arguments)
    await client.responses.create(previous_response_id=response.id, input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": result}], **{**settings, "max_output_tokens": 8})  # fmt: skip
    return float(arguments == {"a": a, "b": b})


async def anthropic_agent(model, a: int, b: int, *, stream: bool) -> float:
    """An agent on the Messages API: call the tool it asks for, give the result back in the conversation."""
    client = anthropic.AsyncAnthropic(base_url=model.inference_base_url.removesuffix("/v1"), api_key=model.inference_api_key, max_retries=0)
    settings = {"model": model.get_inference_name(), "system": SYSTEM, "max_tokens": 40,
                "tools": [{"name": "add", "description": "Add two integers.", "input_schema": SCHEMA}]}  # fmt: skip
    messages = anthropic_messages(a, b)
    if stream:
        async with client.messages.stream(messages=messages, **settings) as events:
            message = await events.get_final_message()
    else:
        message = await client.messages.create(messages=messages, **settings)
    uses = [block for block in message.content if block.type == "tool_use"]
    if not uses:
        return 0.0
    result = run_add(uses[0].input)
    follow = [*messages, {"role": "assistant", "content": [block.model_dump() for block in message.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": result}]}]  # fmt: skip
    await client.messages.create(messages=follow, **{**settings, "max_tokens": 8})
    return float(uses[0].input == {"a": a, "b": b})


async def agents_sdk_agent(model, a: int, b: int) -> float:
    """An OpenAI Agents SDK agent with a function tool, on the SDK's default (Responses) model class."""
    from openai import AsyncOpenAI

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    client = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key, max_retries=0)
    agent = agents.Agent(
        name="calculator", instructions=SYSTEM, tools=[add],
        model=agents.OpenAIResponsesModel(model=model.get_inference_name(), openai_client=client),
        model_settings=agents.ModelSettings(max_tokens=60, temperature=1.0),
    )  # fmt: skip
    try:
        result = await agents.Runner.run(agent, f"Add {a} and {b}.", max_turns=3)
    except agents.exceptions.AgentsException:  # the untrained model may ramble past its budget or its turns
        return 0.0
    return float(str(a + b) in str(result.final_output))


def _get(item, key):
    return item.get(key) if isinstance(item, dict) else getattr(item, key, None)


async def litellm_responses_agent(model, a: int, b: int) -> float:
    """One call on LiteLLM's Responses route (``litellm.aresponses``), to tracerl's ``/v1/responses``."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    tools = [{"type": "function", "name": "add", "description": "Add two integers.", "parameters": SCHEMA}]
    response = await litellm.aresponses(
        model=f"openai/{model.get_inference_name()}", input=responses_input(a, b), instructions=SYSTEM, tools=tools,
        max_output_tokens=40, temperature=1.0, api_base=model.inference_base_url, api_key=model.inference_api_key,
    )  # fmt: skip
    calls = [item for item in _get(response, "output") or () if _get(item, "type") == "function_call"]
    return float(bool(calls) and _get(calls[0], "arguments") == json.dumps({"a": a, "b": b}))


async def litellm_messages_agent(model, a: int, b: int) -> float:
    """One call on LiteLLM's Anthropic route (``litellm.anthropic_messages``), to tracerl's ``/v1/messages``."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    message = await litellm.anthropic_messages(
        model=f"anthropic/{model.get_inference_name()}", messages=anthropic_messages(a, b), system=SYSTEM, max_tokens=40,
        tools=[{"name": "add", "description": "Add two integers.", "input_schema": SCHEMA}],
        api_base=model.inference_base_url.removesuffix("/v1"), api_key=model.inference_api_key,
    )  # fmt: skip
    uses = [block for block in _get(message, "content") or () if _get(block, "type") == "tool_use"]
    return float(bool(uses) and _get(uses[0], "input") == {"a": a, "b": b})


AGENTS = {
    "agents.Runner.run": agents_sdk_agent,
    "responses.create": lambda model, a, b: responses_agent(model, a, b, stream=False),
    "responses.stream": lambda model, a, b: responses_agent(model, a, b, stream=True),
    "messages.create": lambda model, a, b: anthropic_agent(model, a, b, stream=False),
    "messages.stream": lambda model, a, b: anthropic_agent(model, a, b, stream=True),
    "litellm.aresponses": litellm_responses_agent,
    "litellm.anthropic_messages": litellm_messages_agent,
}


@pytest.fixture(scope="module")
async def captured(served):
    """Every client's group of two rollouts, all at once (the server batches them), and every answer the server gave."""
    model, _, answers = served
    groups = await tracerl.gather_trajectory_groups(
        [tracerl.trajectory_group((agent(model, 4, 6) for _ in range(2)), model=model, task=f"{name}: 4 + 6") for name, agent in AGENTS.items()],
        pbar_desc=None, max_exceptions=0,
    )  # fmt: skip
    return dict(zip(AGENTS, groups)), list(answers)


def _key(prompt_ids, token_ids) -> tuple:
    return tuple(prompt_ids), tuple(token_ids)


@pytest.mark.parametrize("client", list(AGENTS))
async def test_each_client_yields_trajectories_with_the_sampled_tokens(captured, client):
    groups, answers = captured
    sampled: dict[tuple, list[list[float]]] = {}  # two calls may sample the same ids (batched: logprobs differ in the last bits)
    for answer in answers:
        choice = answer["choices"][0]
        sampled.setdefault(_key(answer["prompt_token_ids"], choice["token_ids"]), []).append([e["logprob"] for e in choice["logprobs"]["content"]])
    group = groups[client]
    assert len(group.trajectories) == 2
    for trajectory in group.trajectories:
        assert trajectory.messages_and_choices[0] == {"role": "system", "content": SYSTEM}
        assert [tool["function"]["name"] for tool in trajectory.tools] == ["add"]
        assert trajectory.metrics["capture_turns_without_token_ids"] == 0
        assert trajectory.sampled_turns()
        for choice in trajectory.sampled_turns():
            # what the engine sampled for one of its calls, id for id and logprob for logprob
            assert choice.logprobs in sampled[_key(choice.prompt_token_ids, choice.token_ids)]


async def test_every_answered_call_is_in_exactly_one_trajectory(captured):
    """The clients ran at once: the server's answers and the trajectories' sampled turns are the same multiset."""
    groups, answers = captured
    answered = Counter(_key(a["prompt_token_ids"], a["choices"][0]["token_ids"]) for a in answers)
    turns = Counter(_key(c.prompt_token_ids, c.token_ids) for g in groups.values() for t in g.trajectories for c in t.sampled_turns())
    assert turns == answered and sum(turns.values()) >= len(AGENTS) * 2


async def test_one_training_step_on_the_captured_trajectories(served, captured):
    model, backend, _ = served
    groups = list(captured[0].values())
    for group in groups:  # GRPO needs variance within a group, whatever the small model scored
        for i, trajectory in enumerate(group.trajectories):
            trajectory.reward = float(i % 2)
    result = await backend.train(model, groups, learning_rate=1e-5)
    assert result.step == 1 and Path(result.checkpoint_path).exists()
    assert result.metrics.get("trained_tokens", 0) > 0 and result.metrics.get("num_groups_trainable", 0) == len(groups)


async def test_legacy_completions_become_a_turn_with_the_sampled_tokens(served):
    """``completions.create(prompt=...)``: the prompt is the user message, the text the sampled turn."""
    from openai import AsyncOpenAI

    model, _, _ = served
    client = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key, max_retries=0)
    async with tracerl.rollout(model) as r:
        completion = await client.completions.create(model=model.get_inference_name(), prompt="The capital of France is", max_tokens=6)
    (turn,) = r.trajectory.sampled_turns()
    choice = completion.choices[0]
    assert r.trajectory.messages()[0] == {"role": "user", "content": "The capital of France is"}
    assert turn.message["content"] == choice.text and turn.token_ids == choice.model_extra["token_ids"]
    assert turn.prompt_token_ids == choice.model_extra["prompt_token_ids"]  # on the choice, as vLLM puts it
    assert turn.logprobs == choice.logprobs.token_logprobs and len(turn.logprobs) == len(turn.token_ids)
