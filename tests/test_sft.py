"""SFT without the real model: schedules, settings, loss masks, packing, data loading.

The masks are checked token by token against the SmolLM2 tokenizer's own chat template
(the tokenizer only; no weights are loaded).  Packing is checked on a tiny random Llama.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import tracerl
from sft_helpers import CAPITALS, capital_example, expected_mask, tool_example, write_jsonl
from tracerl.train.sft import batches, pack_batch, sequence_weights, split_examples
from tracerl.train.sft_config import SFTConfig, TrainSFTConfig, create_lr_schedule
from tracerl.train.sft_data import (
    as_sft_examples,
    filter_by_reward,
    load_sft_file,
    openai_example_to_trajectory,
    sft_trajectory,
    tokenize_examples,
)
from tracerl.train.tokenization import TrainingSequence, render_ids


# -- schedules ------------------------------------------------------------------------------------
def test_constant_schedule_with_warmup_ramps_then_holds():
    assert create_lr_schedule(5, 1e-3, "constant", warmup_steps=2) == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3, 1e-3])


def test_linear_schedule_decays_to_min_lr_at_the_last_step():
    rates = create_lr_schedule(6, 1e-3, "linear", warmup_steps=1, min_lr=1e-4)
    assert rates[0] == pytest.approx(1e-3)  # one warm-up step already reaches the peak
    assert rates[1] == pytest.approx(1e-3) and rates[-1] == pytest.approx(1e-4)
    assert all(a > b for a, b in zip(rates[1:], rates[2:]))
    assert rates[3] - rates[2] == pytest.approx(rates[2] - rates[1])


def test_cosine_schedule_is_half_a_cosine_after_warmup():
    rates = create_lr_schedule(10, 2e-3, "cosine", warmup_steps=2)
    assert rates[:2] == pytest.approx([1e-3, 2e-3])
    for k, rate in enumerate(rates[2:]):
        assert rate == pytest.approx(2e-3 * 0.5 * (1 + math.cos(math.pi * k / 7)))
    assert rates[-1] == pytest.approx(0.0, abs=1e-12)


def test_config_schedule_uses_warmup_ratio_and_list_form():
    config = SFTConfig(learning_rate=1e-3, schedule_type="linear", warmup_ratio=0.25)
    assert config.schedule(8) == create_lr_schedule(8, 1e-3, "linear", warmup_steps=2)
    assert SFTConfig(learning_rate=[1e-3, 5e-4]).schedule(2) == [1e-3, 5e-4]
    with pytest.raises(tracerl.ConfigError, match="list of 2 values but this call takes 3"):
        SFTConfig(learning_rate=[1e-3, 5e-4]).schedule(3)
    assert TrainSFTConfig is SFTConfig and SFTConfig().resolved_batch_size == 2


# -- settings -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("learning_rate", float("nan")),
        ("learning_rate", 0.0),
        ("learning_rate", [1e-3, float("inf")]),
        ("learning_rate", []),
        ("learning_rate", True),
        ("batch_size", 0),
        ("batch_size", 2.5),
        ("epochs", 0),
        ("schedule_type", "exponential"),
        ("warmup_ratio", 1.0),
        ("warmup_ratio", -0.1),
        ("min_lr", -1e-5),
        ("min_lr", 1.0),
        ("normalization", "batch"),
        ("max_grad_norm", 0),
        ("val_fraction", 1.0),
        ("val_fraction", float("nan")),
        ("assistant_turns", "first"),
        ("shuffle", 1),
        ("seed", 1.5),
    ],
)
def test_bad_settings_are_config_errors_naming_the_field(field, value):
    with pytest.raises(tracerl.ConfigError, match=field):
        SFTConfig(**{field: value})


def test_config_round_trips_as_a_dict_and_unknown_keys_are_type_errors():
    config = SFTConfig(learning_rate=[1e-3], batch_size=3, schedule_type="cosine", normalization="sequence")
    assert SFTConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(TypeError):
        SFTConfig.from_dict({"learning_rate": 1e-4, "lr_scheduler_type": "cosine"})


# -- batches and splits ---------------------------------------------------------------------------
def test_split_and_epochs_are_deterministic_and_cover_every_example():
    train, val = split_examples(12, 0.25, seed=3)
    assert len(val) == 3 and sorted(train + val) == list(range(12))
    assert split_examples(12, 0.25, seed=3) == (train, val)
    assert split_examples(12, 0.0, seed=3) == (list(range(12)), [])
    steps = batches(train, 4, 2, shuffle=True, seed=0)
    assert [e for e, _ in steps] == [0, 0, 0, 1, 1, 1]
    for epoch in (0, 1):
        assert sorted(i for e, b in steps if e == epoch for i in b) == sorted(train)
    assert [b for _, b in steps[:3]] != [b for _, b in steps[3:]]  # reshuffled each epoch
    assert batches([0, 1, 2], 2, 1, shuffle=False, seed=0) == [(0, [0, 1]), (0, [2])]


# -- normalisation --------------------------------------------------------------------------------
def _seq(n_context: int, n_trained: int, example: int) -> TrainingSequence:
    ids = list(range(1, n_context + n_trained + 1))
    return TrainingSequence(ids, [0.0] * n_context + [1.0] * n_trained, [float("nan")] * len(ids), example, 0)


def test_token_normalisation_weighs_every_token_the_same():
    seqs = [_seq(3, 2, 0), _seq(3, 6, 1), _seq(2, 2, 1)]
    weights = sequence_weights(seqs, "token")
    assert weights == [pytest.approx(1 / 10)] * 3
    assert sum(w * s.num_trainable for w, s in zip(weights, seqs)) == pytest.approx(1.0)


def test_sequence_normalisation_weighs_every_example_the_same():
    seqs = [_seq(3, 2, 0), _seq(3, 6, 1), _seq(2, 2, 1)]  # example 1 has two sequences (a break)
    weights = sequence_weights(seqs, "sequence")
    assert weights[0] * 2 == pytest.approx(0.5)  # example 0: 2 tokens carry half the loss
    assert weights[1] * 6 + weights[2] * 2 == pytest.approx(0.5)  # example 1: 8 tokens carry the other half


# -- packing: one example never sees another -----------------------------------------------------
@pytest.fixture(scope="module")
def tiny_trainer(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tracerl.train.trainer import LoRASettings, LoRATrainer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    path = tmp_path_factory.mktemp("tiny-sft")
    LlamaForCausalLM(config).save_pretrained(path)
    trainer = LoRATrainer(path, lora=LoRASettings(r=4, alpha=8))
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return trainer


def _examples() -> list[TrainingSequence]:
    system = [1, 2, 3]
    return [
        TrainingSequence(system + [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [0, 0, 0] + [1] * 11, [0.0] * 14, 0, 5),
        TrainingSequence(system + [20, 21, 22], [0, 0, 0, 1, 1, 1], [0.0] * 6, 1, 7),
        TrainingSequence([4, 5, 30, 31, 32, 2, 33], [0, 0, 1, 1, 0, 0, 1], [0.0] * 7, 2, 9),
    ]


def test_examples_without_a_shared_prefix_fill_rows_as_long_as_the_longest_and_see_only_themselves():
    examples = _examples()
    [mb] = pack_batch(examples, "token", max_tokens=64, pad_token_id=0)
    # no prefix common to all three: the 14-token example has a row of its own (the row length),
    # the 6- and 7-token ones share the second row (13 <= 14): no row longer than the longest
    assert tuple(mb.input_ids_BT.shape) == (2, 14)
    assert mb.input_ids_BT[0].tolist() == examples[0].token_ids
    assert mb.input_ids_BT[1, :13].tolist() == examples[1].token_ids + examples[2].token_ids
    allowed = mb.allowed_B1TT()[1, 0]
    for span in (range(0, 6), range(6, 13)):  # each example sees exactly itself, causally
        for q in span:
            assert {k for k in range(14) if allowed[q, k]} == set(range(span.start, q + 1))
        assert mb.position_ids_BT[1, span.start] == 0


@pytest.mark.parametrize("max_tokens", [64, 10])
def test_packed_sft_logprobs_equal_each_example_alone(tiny_trainer, max_tokens):
    packed = pack_batch(_examples(), "token", max_tokens=max_tokens, pad_token_id=0)
    together = {}
    for mb in packed:
        lp = tiny_trainer.token_logprobs(mb)
        for i, value in zip(mb.sequence_ids_N.tolist(), lp.tolist()):
            together.setdefault(i, []).append(value)
    for i, example in enumerate(_examples()):
        [alone] = pack_batch([example], "token", max_tokens=64, pad_token_id=0)
        assert together[i] == pytest.approx(tiny_trainer.token_logprobs(alone).tolist(), abs=1e-5)


def test_sft_update_lowers_the_loss_of_its_batch(tiny_trainer):
    from tracerl.train.sft import _nll

    batch = pack_batch(_examples(), "sequence", max_tokens=64, pad_token_id=0)
    with torch.no_grad():
        before = _nll(tiny_trainer, batch, backward=False, where="")
    for _ in range(3):
        tiny_trainer.apply_update(lambda: _nll(tiny_trainer, batch, backward=True, where=""), learning_rate=1e-2, max_grad_norm=1.0)
    with torch.no_grad():
        assert _nll(tiny_trainer, batch, backward=False, where="") < before


# -- masks against the tokenizer's own chat template ---------------------------------------------
@pytest.mark.parametrize(
    "record",
    [capital_example("France", "Paris"), tool_example(17, 25), tool_example(3, 4, first_weight=0), tool_example(3, 4, first_weight=1)],
    ids=["plain", "tool-call", "tool-call-weight-0", "tool-call-weight-1"],
)
def test_exactly_the_assistant_tokens_are_trained(smol_tokenizer, record):
    [[sequence]] = tokenize_examples([openai_example_to_trajectory(record)], smol_tokenizer)
    full, mask = expected_mask(smol_tokenizer, record)
    n = len(sequence.token_ids)
    assert sequence.token_ids == full[:n]
    assert sequence.weights == mask[:n]
    assert all(m == 0 for m in mask[n:]), "only the newline after the last end-of-turn token is left out"
    assert sum(sequence.weights) == sum(mask) > 0


def test_tool_schemas_and_calls_render_through_the_template(smol_tokenizer):
    [[sequence]] = tokenize_examples([openai_example_to_trajectory(tool_example(17, 25))], smol_tokenizer)
    text = smol_tokenizer.decode(sequence.token_ids)
    trained = smol_tokenizer.decode([t for t, w in zip(sequence.token_ids, sequence.weights) if w])
    assert '"name": "add"' in text.split("<|im_end|>")[0], "the tool schema is in the system turn"
    assert trained == '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call><|im_end|>17 + 25 = 42.<|im_end|>'


def test_captured_sampled_turns_keep_their_ids_and_context_assistant_turns_are_trained(smol_tokenizer):
    question = [{"role": "user", "content": "Capital of Peru?"}]
    worked = [{"role": "user", "content": "Capital of Cuba?"}, {"role": "assistant", "content": "Havana."}]
    prompt = render_ids(smol_tokenizer, worked + question, None, add_generation_prompt=True)
    sampled = smol_tokenizer("Lima.", add_special_tokens=False)["input_ids"] + [smol_tokenizer.eos_token_id]
    choice = tracerl.Choice(message={"role": "assistant", "content": "Lima."}, token_ids=sampled, prompt_token_ids=prompt, logprobs=[-0.5] * len(sampled))
    trajectory = tracerl.Trajectory(messages_and_choices=[*worked, *question, choice], reward=1.0)
    [sequences] = tokenize_examples([trajectory], smol_tokenizer)
    [seq] = sequences
    trained = [t for t, w in zip(seq.token_ids, seq.weights) if w]
    havana = smol_tokenizer("Havana.", add_special_tokens=False)["input_ids"] + [smol_tokenizer.eos_token_id]
    assert trained == havana + sampled, "the context assistant turn and the sampled one, in order"
    assert seq.token_ids[-len(sampled) :] == sampled
    [[last_only]] = tokenize_examples([trajectory], smol_tokenizer, assistant_turns="last")
    assert [t for t, w in zip(last_only.token_ids, last_only.weights) if w] == sampled


def test_sft_trajectory_keeps_weight_zero_turns_as_context():
    t = openai_example_to_trajectory(tool_example(1, 2, first_weight=0))
    items = sft_trajectory(t).messages_and_choices
    assert [type(i).__name__ for i in items] == ["dict", "dict", "dict", "dict", "Choice"]
    assert "weight" not in items[-1].message


# -- files ----------------------------------------------------------------------------------------
def test_openai_jsonl_loads_every_record(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [capital_example(*c) for c in CAPITALS[:3]] + ["", tool_example(2, 3)])
    examples = load_sft_file(path)
    assert len(examples) == 4
    assert examples[3].tools and examples[3].metadata["source"] == f"{path} line 5"
    assert examples[0].sampled_turns()[0].message["content"] == "The capital of France is Paris."


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ('{"messages": [{"role": "user", "content": "hi"}, ', "not valid JSON"),
        ({"messages": []}, "'messages' must be a non-empty list"),
        ({"prompt": "hi", "completion": "there"}, "'messages' must be a non-empty list"),
        ({"messages": [{"role": "robot", "content": "beep"}]}, "unknown role 'robot'"),
        ({"messages": [{"role": "user", "content": "hi", "weight": 1}, {"role": "assistant", "content": "x"}]}, "only allowed on assistant"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "weight": 2}]}, "must be 0 or 1"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "weight": 0}]}, "no assistant message to train"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message to train"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}, "needs 'content' or 'tool_calls'"),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{a"}}]}]},
            "'arguments' is not valid JSON",
        ),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}], "tools": {"add": 1}}, "'tools' must be a list"),
        ({"messages": [{"role": "user", "content": {"text": "hi"}}, {"role": "assistant", "content": "x"}]}, "'content' must be a string"),
        ({"messages_and_choices": "nope"}, "malformed trajectory"),
    ],
)
def test_a_bad_record_is_an_error_naming_its_line(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [capital_example("France", "Paris"), "", bad, capital_example("Peru", "Lima")])
    with pytest.raises(tracerl.TrajectoryError, match=message) as caught:
        load_sft_file(path)
    assert f"{path} line 3" in str(caught.value)


def test_a_missing_or_empty_file_is_an_error(tmp_path):
    with pytest.raises(tracerl.TrajectoryError, match="cannot read"):
        load_sft_file(tmp_path / "missing.jsonl")
    with pytest.raises(tracerl.TrajectoryError, match="no examples"):
        load_sft_file(write_jsonl(tmp_path / "empty.jsonl", ["", "  "]))


def test_imported_trajectory_jsonl_is_accepted_and_filtered_by_reward(tmp_path, smol_tokenizer):
    from tracerl.integrations.importers.records import write_jsonl as write_trajectories

    good = openai_example_to_trajectory(capital_example("Peru", "Lima"))
    good.reward = 1.0
    bad = openai_example_to_trajectory(capital_example("Peru", "Quito"))
    bad.reward = 0.2
    imported = tracerl.Trajectory(  # as an importer writes it: plain messages, the retokenized flag
        messages_and_choices=[{"role": "user", "content": "Capital of Chile?"}, tracerl.Choice(message={"role": "assistant", "content": "Santiago."})],
        reward=0.9,
        metadata={"retokenized": True},
    )
    path = tmp_path / "imported.jsonl"
    write_trajectories(path, [tracerl.TrajectoryGroup([good, bad]), tracerl.TrajectoryGroup([imported])])
    assert len(load_sft_file(path)) == 3
    kept = load_sft_file(path, min_reward=0.5)
    assert [t.reward for t in kept] == [1.0, 0.9]
    [[a], [b]] = tokenize_examples(kept, smol_tokenizer)
    assert smol_tokenizer.decode([t for t, w in zip(b.token_ids, b.weights) if w]) == "Santiago.<|im_end|>"


def test_reward_filter_takes_groups_and_rejects_a_nan_threshold():
    group = tracerl.TrajectoryGroup([tracerl.Trajectory(messages_and_choices=[], reward=r) for r in (0.0, 0.5, 1.0)])
    assert [t.reward for t in filter_by_reward([group], 0.5)] == [0.5, 1.0]
    with pytest.raises(tracerl.TrajectoryError):
        filter_by_reward([group], float("nan"))


def test_train_sft_inputs_mix_trajectories_groups_and_dicts(tmp_path):
    t = openai_example_to_trajectory(capital_example("Peru", "Lima"))
    mixed = as_sft_examples([t, tracerl.TrajectoryGroup([t]), capital_example("Cuba", "Havana"), t.to_json_dict()])
    assert len(mixed) == 4 and all(isinstance(x, tracerl.Trajectory) for x in mixed)
    assert len(as_sft_examples(write_jsonl(tmp_path / "d.jsonl", [capital_example("Cuba", "Havana")]))) == 1
    with pytest.raises(tracerl.TrajectoryError, match="example 1: train_sft takes"):
        as_sft_examples([t, 42])
    with pytest.raises(tracerl.TrajectoryError, match="no examples"):
        as_sft_examples([])
