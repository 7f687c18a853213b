"""A model family trained end to end: Qwen3's real tokenizer and template, a random Qwen3 (issue 32).

A randomly initialised ``Qwen3ForCausalLM`` (``tracerl.families.models``, shrunk) is served by
tracerl's transformers server and trained by ``LocalBackend``.  Random weights never choose to think
or call a tool, so each assistant turn of the conversation is forced: its tokens are the template's
own rendering of the turn, scored through the serving path (``/v1/completions``, the route
distillation uses), so the logprobs are the served policy's.  The conversation thinks before
each of two tool rounds and before its answer; Qwen3's template keeps the reasoning of turns after
the last user message, so the turns extend one another and every sampled token is trained in one
sequence.  A second user question makes the template drop the earlier reasoning: the sequence
breaks there, counted by cause, and the tokens on both sides are still trained, none re-rendered.
"""

from __future__ import annotations

import pytest

import tracerl
from tracerl.families.files import is_installed, last_failure
from tracerl.train.tokenization import TokenizeStats, render_ids, tokenize_trajectory

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}]  # fmt: skip


def _call(i: int, city: str) -> dict:
    return {"id": f"call{i:05d}", "type": "function", "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}


def conversation(answer: str, *, follow_up: bool = False) -> list[dict]:
    """Two tool rounds, each after reasoning, then an answer after reasoning (and, with ``follow_up``, a second question)."""
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris, then Rome?"},
        {"role": "assistant", "content": "", "reasoning_content": "Paris first.", "tool_calls": [_call(1, "Paris")]},
        {"role": "tool", "tool_call_id": "call00001", "content": "sunny"},
        {"role": "assistant", "content": "", "reasoning_content": "Now Rome.", "tool_calls": [_call(2, "Rome")]},
        {"role": "tool", "tool_call_id": "call00002", "content": "rainy"},
        {"role": "assistant", "content": answer, "reasoning_content": "Both are known."},
    ]
    if follow_up:
        messages += [{"role": "user", "content": "And tomorrow?"},
                     {"role": "assistant", "content": "No forecast.", "reasoning_content": "Nothing to call for that."}]  # fmt: skip
    return messages


async def forced(model: tracerl.TrainableModel, tokenizer, messages: list[dict], reward: float) -> tracerl.Trajectory:
    """The conversation as a trajectory whose assistant turns are the template's tokens, scored by the served policy."""
    from tracerl.families.models import stop_token_ids
    from tracerl.train.distill import TeacherQuery, served_teacher

    served = served_teacher(model, model_name=model.get_inference_name())
    stop = stop_token_ids(tokenizer, "qwen3")[0]
    items: list = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            items.append(message)
            continue
        context = messages[:i]
        prompt = render_ids(tokenizer, context, TOOLS, add_generation_prompt=True)
        full = render_ids(tokenizer, [*context, message], TOOLS, add_generation_prompt=False)
        assert full[: len(prompt)] == prompt, "Qwen3 renders the turn after its own generation prompt"
        completion = full[len(prompt) :]
        completion = completion[: completion.index(stop) + 1]  # the turn as the model ends it
        logprobs = await served.score(TeacherQuery(context, TOOLS, prompt, completion))
        items.append(tracerl.Choice(message=message, token_ids=completion, prompt_token_ids=prompt, logprobs=logprobs))
    return tracerl.Trajectory(messages_and_choices=items, tools=TOOLS, reward=reward)


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    if not is_installed("qwen3"):
        pytest.skip(f"Qwen3's tokenizer is not installed ({last_failure('qwen3') or 'make install-model-files'})")
    from tracerl.families.models import write_random_model

    return write_random_model("qwen3", tmp_path_factory.mktemp("qwen3-random"))


async def test_qwen3_thinking_and_two_tool_rounds_train_with_no_drifted_token(qwen3_folder, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_folder)
    backend = tracerl.LocalBackend(tmp_path, inference="transformers")
    model = tracerl.TrainableModel(name="qwen3-random", project="families", base_model=str(qwen3_folder))
    try:
        await model.register(backend)
        right = await forced(model, tokenizer, conversation("Paris is sunny, Rome is rainy."), 1.0)
        wrong = await forced(model, tokenizer, conversation("Both are sunny."), 0.0)
        follow = await forced(model, tokenizer, conversation("Paris is sunny, Rome is rainy.", follow_up=True), 0.5)

        for trajectory, breaks in ((right, {}), (follow, {"sampled_tokens_rerendered": 1})):
            stats = TokenizeStats()
            sequences = tokenize_trajectory(trajectory, tokenizer, stats=stats)
            assert dict(stats.breaks) == breaks and len(sequences) == 1 + sum(breaks.values())
            sampled = [c for c in trajectory.messages_and_choices if isinstance(c, tracerl.Choice)]
            trained = [t for s in sequences for t, w in zip(s.token_ids, s.weights) if w > 0]
            assert trained == [t for c in sampled for t in c.token_ids]  # every sampled token trained, none drifted
            for choice in sampled:  # each at its place: right after exactly the prompt the server scored it with
                start, end = len(choice.prompt_token_ids), len(choice.prompt_token_ids) + len(choice.token_ids)
                assert any(s.token_ids[:start] == choice.prompt_token_ids and s.token_ids[start:end] == choice.token_ids
                           and s.old_logprobs[start:end] == choice.logprobs for s in sequences)  # fmt: skip
        think = tokenizer.convert_tokens_to_ids("<think>")
        assert sum(c.token_ids.count(think) for c in right.messages_and_choices if isinstance(c, tracerl.Choice)) == 3

        result = await backend.train(model, [tracerl.TrajectoryGroup([right, wrong, follow])], learning_rate=1e-3)
        metrics = result.metrics
        assert result.step == 1 and metrics["num_groups_trainable"] == 1
        assert metrics["sequence_breaks/sampled_tokens_rerendered"] == 1 and metrics["sequence_breaks/total"] == 1
        assert metrics["dropped_tokens/total"] == 0
        assert metrics["trained_tokens"] == metrics["sampled_tokens"] > 0  # 100% (the issue asks for >= 90%)
    finally:
        await backend.close()
