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

Then each of the six families does the same through a served GRPO step (the supported-models
matrix's last two columns): every sampled token trained, and the step's policy served after it.
"""

from __future__ import annotations

import pytest
import tracerl
from family_helpers import TOOLS, conversation, family_conversation, forced_turns
from tracerl.families.files import is_installed, last_failure
from tracerl.train.tokenization import TokenizeStats, tokenize_trajectory


async def forced(model: tracerl.TrainableModel, tokenizer, messages: list[dict], reward: float, *, family: str = "qwen3",
                 tools: list | None = TOOLS) -> tracerl.Trajectory:  # fmt: skip
    """The conversation as a trajectory whose assistant turns are the template's tokens (``forced_turns``),
    each scored by the served policy: the logprobs a sampler would have returned."""
    from tracerl.train.distill import TeacherQuery, served_teacher

    served = served_teacher(model, model_name=model.get_inference_name())
    items = forced_turns(tokenizer, family, messages, tools)
    for i, item in enumerate(items):
        if isinstance(item, tracerl.Choice):
            query = TeacherQuery(messages[:i], tools, item.prompt_token_ids, item.token_ids)
            items[i] = item.model_copy(update={"logprobs": await served.score(query)})
    return tracerl.Trajectory(messages_and_choices=items, tools=tools, reward=reward)


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


FAMILIES = ["qwen3", "qwen2.5", "gemma3", "gptoss", "llama3", "mistral"]


@pytest.mark.parametrize("family", FAMILIES)
async def test_each_family_serves_trains_a_step_and_serves_the_trained_policy(family, tmp_path):
    """A random model of each family's architecture: forced turns scored by the served policy, one
    GRPO step on every sampled token, then the step's policy served in its place."""
    if not is_installed(family):
        pytest.skip(f"{family}'s files are not installed ({last_failure(family) or 'make install-model-files'})")
    from tracerl.families.models import write_random_model
    from tracerl.train.distill import TeacherQuery, served_teacher
    from transformers import AutoTokenizer

    folder = write_random_model(family, tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    backend = tracerl.LocalBackend(tmp_path / "runs", inference="transformers")
    model = tracerl.TrainableModel(name=f"{family}-random".replace(".", ""), project="families", base_model=str(folder))
    try:
        await model.register(backend)
        trajectories = []
        for reward, follow_up, variant in ((1.0, False, 0), (0.0, False, 1), (0.5, True, 0)):  # different tokens, or their updates cancel
            messages, tools = family_conversation(family, follow_up=follow_up, variant=variant)
            trajectories.append(await forced(model, tokenizer, messages, reward, family=family, tools=tools))
        stats = TokenizeStats()
        for trajectory in trajectories:
            tokenize_trajectory(trajectory, tokenizer, stats=stats)

        result = await backend.train(model, [tracerl.TrajectoryGroup(trajectories)], learning_rate=1e-2)
        metrics = result.metrics
        assert result.step == 1 and metrics["num_groups_trainable"] == 1
        assert metrics["trained_tokens"] == metrics["sampled_tokens"] == stats.sampled_tokens > 0 and metrics["dropped_tokens/total"] == 0
        assert metrics["sequence_breaks/total"] == sum(stats.breaks.values()) and metrics["grad_norm"] > 0

        turn = next(c for c in trajectories[0].messages_and_choices if isinstance(c, tracerl.Choice))
        query = TeacherQuery([], tools, turn.prompt_token_ids, turn.token_ids)
        after = await served_teacher(model, model_name=model.get_inference_name(1)).score(query)
        assert len(after) == len(turn.token_ids) and after != turn.logprobs  # the step's policy is what is served now
    finally:
        await backend.close()
