"""Trajectories → training sequences, checked against SmolLM2's real tokenizer and shipped template."""

from __future__ import annotations

import pytest

from tracerl import Choice, History, Trajectory, TrajectoryError
from tracerl.train.tokenization import TokenizeStats, render_ids, tokenize_trajectory

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]
CONTEXT = [{"role": "system", "content": "You call tools."}, {"role": "user", "content": "What is 2+3?"}]
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
CALL_MESSAGE = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}],
}


def sample(tok, context, text, message, tools=TOOLS, with_prompt=True):
    """What a tracerl-served model returns: prompt ids, completion ids (stop token included), logprobs."""
    prompt = render_ids(tok, context, tools, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    logprobs = [-0.1 * (i + 1) for i in range(len(ids))]
    return Choice(message=message, token_ids=ids, prompt_token_ids=prompt if with_prompt else None, logprobs=logprobs)


def two_turn_trajectory(tok, with_prompt=True):
    first = sample(tok, CONTEXT, CALL_TEXT, CALL_MESSAGE, with_prompt=with_prompt)
    tool_result = {"role": "tool", "tool_call_id": "call_1", "content": "5"}
    context2 = [*CONTEXT, CALL_MESSAGE, tool_result]
    second = sample(tok, context2, "2+3 is 5.", {"role": "assistant", "content": "2+3 is 5."}, with_prompt=with_prompt)
    return Trajectory(messages_and_choices=[*CONTEXT, first, tool_result, second], tools=TOOLS, reward=1.0), first, second


def test_multi_turn_tool_calls_make_one_append_only_sequence(smol_tokenizer):
    tok = smol_tokenizer
    trajectory, first, second = two_turn_trajectory(tok)
    stats = TokenizeStats()
    [seq] = tokenize_trajectory(trajectory, tok, stats=stats)
    assert sum(stats.breaks.values()) == 0
    # the whole sequence equals the chat template's rendering of the full conversation (up to the final stop token)
    full = render_ids(tok, trajectory.messages(), TOOLS, add_generation_prompt=False)
    assert seq.token_ids == full[: len(seq.token_ids)]
    # exactly the sampled tokens carry weight 1, with their sampler logprobs
    trained = [t for t, w in zip(seq.token_ids, seq.weights) if w == 1.0]
    assert trained == first.token_ids + second.token_ids
    trained_lp = [lp for lp, w in zip(seq.old_logprobs, seq.weights) if w == 1.0]
    assert trained_lp == first.logprobs + second.logprobs
    # the tool result ("5") sits between the two sampled turns with weight 0
    start2 = len(second.prompt_token_ids)
    tool_region = seq.token_ids[len(first.prompt_token_ids) + len(first.token_ids) : start2]
    assert "<tool_response>\n5\n</tool_response>" in tok.decode(tool_region)
    assert all(w == 0.0 for w in seq.weights[len(first.prompt_token_ids) + len(first.token_ids) : start2])


def test_missing_prompt_ids_are_rendered_with_the_template(smol_tokenizer):
    trajectory, _, _ = two_turn_trajectory(smol_tokenizer, with_prompt=False)
    with_prompts, _, _ = two_turn_trajectory(smol_tokenizer, with_prompt=True)
    stats = TokenizeStats()
    [seq] = tokenize_trajectory(trajectory, smol_tokenizer, stats=stats)
    [ref] = tokenize_trajectory(with_prompts, smol_tokenizer)
    assert seq.token_ids == ref.token_ids and stats.rendered_prompts == 2


def test_rewritten_history_starts_a_new_sequence_and_counts_the_break(smol_tokenizer):
    tok = smol_tokenizer
    trajectory, first, second = two_turn_trajectory(tok)
    # a template that re-renders the first turn differently (e.g. reformats the tool-call JSON)
    rewritten = {**CALL_MESSAGE, "tool_calls": [{**CALL_MESSAGE["tool_calls"][0], "function": {"name": "add", "arguments": '{"a":2,"b":3}'}}]}
    ctx2 = [*CONTEXT, rewritten, {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    second = sample(tok, ctx2, "5", {"role": "assistant", "content": "5"})
    trajectory = Trajectory(messages_and_choices=[*CONTEXT, first, *ctx2[-1:], second], tools=TOOLS)
    stats = TokenizeStats()
    sequences = tokenize_trajectory(trajectory, tok, stats=stats)
    assert len(sequences) == 2
    assert stats.breaks == {"sampled_tokens_rerendered": 1}
    assert stats.metrics()["sequence_breaks/total"] == 1.0
    assert [t for t, w in zip(sequences[1].token_ids, sequences[1].weights) if w] == second.token_ids


def test_turns_without_token_ids_need_explicit_permission(smol_tokenizer):
    tok = smol_tokenizer
    choice = Choice(message={"role": "assistant", "content": "Paris."})
    trajectory = Trajectory(messages_and_choices=[{"role": "user", "content": "Capital of France?"}, choice])
    with pytest.raises(TrajectoryError, match="no token ids.*allow_retokenize"):
        tokenize_trajectory(trajectory, tok)
    stats = TokenizeStats()
    [seq] = tokenize_trajectory(trajectory, tok, allow_retokenize=True, stats=stats)
    assert stats.retokenized_turns == 1
    trained = [t for t, w in zip(seq.token_ids, seq.weights) if w]
    assert tok.decode(trained) == "Paris.<|im_end|>"
    assert all(lp != lp for lp, w in zip(seq.old_logprobs, seq.weights) if w)  # NaN: no sampler logprobs


def test_additional_histories_become_their_own_sequences(smol_tokenizer):
    tok = smol_tokenizer
    trajectory, _, _ = two_turn_trajectory(tok)
    sub_ctx = [{"role": "user", "content": "Summarise: 5"}]
    sub = sample(tok, sub_ctx, "Five.", {"role": "assistant", "content": "Five."}, tools=None)
    trajectory.additional_histories.append(History(messages_and_choices=[*sub_ctx, sub]))
    sequences = tokenize_trajectory(trajectory, tok, trajectory_index=3)
    assert len(sequences) == 2 and {s.trajectory_index for s in sequences} == {3}


def test_openai_choice_objects_are_accepted():
    from openai.types.chat import ChatCompletion

    completion = ChatCompletion.model_validate(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": "m@1",
            "prompt_token_ids": [1, 2, 3],
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "hi"},
                    "token_ids": [7, 8],
                    "logprobs": {"content": [{"token": "h", "logprob": -0.5, "bytes": None, "top_logprobs": []}, {"token": "i", "logprob": -0.25, "bytes": None, "top_logprobs": []}]},
                }
            ],
        }
    )
    choice = Choice.from_openai(completion.choices[0], completion)
    assert choice.token_ids == [7, 8] and choice.prompt_token_ids == [1, 2, 3]
    assert choice.logprobs == [-0.5, -0.25] and choice.response_id == "chatcmpl-1"
    # a raw SDK choice inside messages_and_choices is converted on the way in
    t = Trajectory(messages_and_choices=[{"role": "user", "content": "x"}, completion.choices[0]])
    assert isinstance(t.messages_and_choices[1], Choice) and t.messages()[1]["content"] == "hi"
