"""Each model family served and trained end to end with its real tokenizer and template (issue 32).

A randomly initialised model of each family's real architecture (``tracerl.families.models``,
shrunk) is served by tracerl's transformers server and trained by ``LocalBackend``.  Random
weights never choose to think or call a tool, so each assistant turn of the conversation is
forced: its tokens are the template's own rendering of the turn, scored through the serving path
(``/v1/completions``, the route distillation uses), so the logprobs are the served policy's.  One
turn the random model really samples is captured through the OpenAI SDK too.  One GRPO step then
trains every sampled token, each at its place with its served logprob, and the step's policy is
served after it (the supported-models matrix's last column).

Qwen3 in detail: the conversation thinks before each of two tool rounds and before its answer;
the template keeps the reasoning of turns after the last user message, so the turns extend one
another in one sequence.  A second user question makes the template drop the earlier reasoning:
the sequence breaks there, counted by cause, and the tokens on both sides are still trained.
Last, ``TrainableModel``'s serving settings reach the server and the trainer.
"""

from __future__ import annotations

import pytest
import tracerl
import tracerl.integrations as ti
from family_helpers import TOOLS, family_conversation, scored_conversation
from suite_size import FULL
from tracerl.families.files import is_installed, last_failure
from tracerl.train.tokenization import TokenizeStats, tokenize_trajectory


async def forced(model: tracerl.TrainableModel, tokenizer, messages: list[dict], reward: float, *, family: str = "qwen3",
                 tools: list | None = TOOLS) -> tracerl.Trajectory:  # fmt: skip
    """The conversation as a trajectory whose assistant turns are the template's tokens, each scored
    by the served policy (``family_helpers.scored_conversation``)."""
    return await scored_conversation(model, tokenizer, family, messages, tools, reward)


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    if not is_installed("qwen3"):
        pytest.skip(f"Qwen3's tokenizer is not installed ({last_failure('qwen3') or 'make install-model-files'})")
    from tracerl.families.models import write_random_model

    return write_random_model("qwen3", tmp_path_factory.mktemp("qwen3-random"))


FAMILIES = ["qwen3", "qwen2.5", "gemma3", "gptoss", "llama3", "mistral"]
WINDOWED = {"gemma3", "gptoss"}
AGREEMENT = {"float32": ("mismatch_abs_max", 1e-3), "bfloat16": ("mismatch_kl", 5e-3)}
"""What each dtype allows between sampler and trainer: fp32 every token to 1e-3; bf16 the KL limit
set on SmolLM2's real weights (``test_bf16.py``)."""


@pytest.fixture(scope="module")
def random_model(sharp_family_model):
    """Each family's sharp random model (``conftest.sharp_family_model``: the windowed ones with an 8-token window),
    written once a session for both dtypes' cells and the other tests that use it."""
    return sharp_family_model


CELLS = [(family, dtype) for family in FAMILIES for dtype in ("float32", "bfloat16") if FULL or dtype == "float32" or family in WINDOWED]
"""``make test``: every family in fp32 (its cells also sample through the SDK and serve the step) and the windowed
families in bf16 too (where a window changes what bf16 computes; SmolLM2's bf16 agreement: ``test_bf16.py``);
``make test-long`` (``TRACERL_FULL=1``): every family in both dtypes."""


@pytest.mark.parametrize("family,dtype", CELLS)
async def test_each_family_serves_trains_a_step_and_serves_the_trained_policy(family, dtype, random_model, tmp_path):
    """A random model of each family's architecture: forced turns scored by the served policy (and in
    fp32 a turn sampled through the OpenAI SDK), one GRPO step on every sampled token, then (fp32)
    the step's policy served in its place.  The step's
    train-inference agreement (docs/supported-models.md): the trainer's logprobs of the served
    turns, the windowed families' window shrunk to 8 tokens so the conversation is far longer."""
    if not is_installed(family):
        pytest.skip(f"{family}'s files are not installed ({last_failure(family) or 'make install-model-files'})")
    from tracerl.train.distill import TeacherQuery, served_teacher
    from transformers import AutoTokenizer

    folder = random_model(family)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    backend = tracerl.LocalBackend(tmp_path / "runs", inference="transformers", dtype=dtype)
    model = tracerl.TrainableModel(name=f"{family}-random".replace(".", ""), project="families", base_model=str(folder))
    try:
        await model.register(backend)
        trajectories = []
        for reward, follow_up, variant in ((1.0, False, 0), (0.0, False, 1), (0.5, True, 0)):  # different tokens, or their updates cancel
            messages, tools = family_conversation(family, follow_up=follow_up, variant=variant)
            trajectories.append(await forced(model, tokenizer, messages, reward, family=family, tools=tools))
        full = dtype == "float32"  # the bf16 cell measures the agreement only; the fp32 cell proves the rest
        if full:
            async with ti.rollout(model) as captured:  # a turn the random model really sampled, captured
                await model.openai_client().chat.completions.create(  # through the OpenAI SDK and read by the family's reader
                    model=model.get_inference_name(), messages=messages[:2], tools=tools, max_tokens=12, temperature=1.0, seed=3,
                )  # fmt: skip
            (sampled,) = [c for c in captured.trajectory.messages_and_choices if isinstance(c, tracerl.Choice)]
            assert sampled.token_ids and len(sampled.logprobs) == len(sampled.token_ids) and sampled.model == model.get_inference_name()
            captured.trajectory.reward = 0.25
            trajectories.append(captured.trajectory)
        stats = TokenizeStats()
        for trajectory in trajectories:
            sequences = tokenize_trajectory(trajectory, tokenizer, stats=stats)
            for choice in (c for c in trajectory.messages_and_choices if isinstance(c, tracerl.Choice)):
                start, end = len(choice.prompt_token_ids), len(choice.prompt_token_ids) + len(choice.token_ids)
                assert any(s.token_ids[:start] == choice.prompt_token_ids and s.token_ids[start:end] == choice.token_ids
                           and s.old_logprobs[start:end] == choice.logprobs for s in sequences)  # fmt: skip
                # ^ every sampled token at its place: right after exactly the prompt the server scored it with
        if family == "qwen3":  # thinking before two tool rounds and the answer; the second question drops it
            think = tokenizer.convert_tokens_to_ids("<think>")
            assert sum(c.token_ids.count(think) for c in trajectories[0].messages_and_choices if isinstance(c, tracerl.Choice)) == 3
            assert dict(stats.breaks) == {"sampled_tokens_rerendered": 1}

        result = await backend.train(model, [tracerl.TrajectoryGroup(trajectories)], learning_rate=1e-2)  # forced and sampled turns
        metrics = result.metrics
        print(f"agreement {family} {dtype} transformers: mismatch_kl={metrics['mismatch_kl']:.3g} "
              f"max_abs={metrics['mismatch_abs_max']:.3g} tokens={metrics['mismatch_tokens']:.0f}")
        key, limit = AGREEMENT[dtype]
        assert metrics[key] <= limit
        assert metrics["mismatch_tokens"] == metrics["trained_tokens"]  # every trained token had a served logprob
        assert result.step == 1 and metrics["num_groups_trainable"] == 1
        assert metrics["trained_tokens"] == metrics["sampled_tokens"] == stats.sampled_tokens > 0 and metrics["dropped_tokens/total"] == 0
        assert metrics["sequence_breaks/total"] == sum(stats.breaks.values()) and metrics["grad_norm"] > 0

        if not full:
            return
        turn = next(c for c in trajectories[0].messages_and_choices if isinstance(c, tracerl.Choice))
        query = TeacherQuery([], tools, turn.prompt_token_ids, turn.token_ids)
        after = await served_teacher(model, model_name=model.get_inference_name(1)).score(query)
        assert len(after) == len(turn.token_ids) and after != turn.logprobs  # the step's policy is what is served now
    finally:
        await backend.close()


async def test_serving_settings_reach_the_server_and_the_trainer(qwen3_folder, tmp_path):
    """``TrainableModel``'s serving settings: a tool-call parser the template contradicts is refused at
    registration; a chat-template override is what the server renders and what the trainer reads."""
    from transformers import AutoTokenizer

    backend = tracerl.LocalBackend(tmp_path / "runs", inference="transformers")
    try:
        wrong = tracerl.TrainableModel(name="wrong", project="families", base_model=str(qwen3_folder), tool_call_parser="mistral")
        with pytest.raises(tracerl.ConfigError, match="writes tool calls as 'hermes'"):
            await wrong.register(backend)

        template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip
        model = tracerl.TrainableModel(name="plain", project="families", base_model=str(qwen3_folder), chat_template=template)
        await model.register(backend)
        reply = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        tokenizer = AutoTokenizer.from_pretrained(qwen3_folder)
        rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        assert reply.model_extra["prompt_token_ids"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
        info = model.run_dir.read_model_info()
        assert info["chat_template"] == template and info["tool_call_parser"] == "auto"
        assert AutoTokenizer.from_pretrained(info["resolved_base_model"]).chat_template == template  # the trainer's folder
    finally:
        await backend.close()

    with pytest.raises(tracerl.ConfigError, match="tool_call_parser must be"):
        tracerl.TrainableModel(name="x", project="families", base_model=str(qwen3_folder), tool_call_parser="xml")
