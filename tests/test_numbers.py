"""Bad numbers never train (issue 9, item 2): checked where they enter and again where they are used.

Light tests (no model): rewards, metrics, sampler logprobs and token ids set at construction,
by assignment and in place; hyperparameters and LoRA settings; the errors name what was wrong
and where.  The real-model half (a NaN trained on, non-finite gradients, ids outside the
vocabulary, ``tracerl serve``) is ``tests/test_numbers_real_model.py``.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys

import pytest

import tracerl
import tracerl.integrations as ti
from tracerl.serve.remote_backend import decode_groups, dumps_body, encode_groups

NAN, INF = float("nan"), float("inf")


def _choice(**overrides):
    values = dict(message={"role": "assistant", "content": "hi"}, token_ids=[5, 6, 2], prompt_token_ids=[1, 2, 3], logprobs=[-0.5, -0.2, -0.1])
    return tracerl.Choice(**{**values, **overrides})


def _trajectory(reward=1.0, **kwargs):
    return tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, _choice()], reward=reward, **kwargs)


def _groups():
    return [
        tracerl.TrajectoryGroup([_trajectory(1.0), _trajectory(0.0)], metadata={"task": "first"}),
        tracerl.TrajectoryGroup([_trajectory(1.0, metadata={"task": "second"}), _trajectory(0.0, metadata={"task": "second"})]),
    ]


# -- construction and assignment --------------------------------------------------------------------
@pytest.mark.parametrize("bad", [NAN, INF, -INF, "0.5", None])
def test_a_reward_set_after_construction_is_checked(bad):
    t = _trajectory(0.5)
    with pytest.raises(tracerl.TrajectoryError, match="reward must be a finite number"):
        t.reward = bad
    assert t.reward == 0.5
    with pytest.raises(tracerl.TrajectoryError, match="reward"):
        _trajectory(bad)


def test_metrics_assigned_or_constructed_are_checked():
    t = _trajectory()
    with pytest.raises(tracerl.TrajectoryError, match=r"metrics\['loss'\] must be a finite number"):
        t.metrics = {"ok": 1, "loss": NAN}
    with pytest.raises(tracerl.TrajectoryError, match="metrics"):
        _trajectory(metrics={"x": INF})
    t.metrics = {"flag": True, "n": 3, "x": 0.5}
    assert t.metrics == {"flag": True, "n": 3, "x": 0.5}
    group = tracerl.TrajectoryGroup([t])
    with pytest.raises(tracerl.TrajectoryError, match=r"TrajectoryGroup.metrics"):
        group.metrics = {"judge_cost": NAN}
    with pytest.raises(tracerl.TrajectoryError, match="metrics"):
        tracerl.TrajectoryGroup([t], metrics={"judge_cost": -INF})


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_sampler_logprobs_must_be_finite(bad):
    with pytest.raises(tracerl.TrajectoryError, match=r"Choice.logprobs: the sampler logprob at position 1"):
        _choice(logprobs=[-0.5, bad, -0.1])
    choice = _choice()
    with pytest.raises(tracerl.TrajectoryError, match="logprob"):
        choice.logprobs = [bad, -0.2, -0.1]
    assert choice.logprobs == [-0.5, -0.2, -0.1]


def test_negative_token_ids_are_rejected_where_they_enter():
    with pytest.raises(tracerl.TrajectoryError, match=r"token id -1 at position 2 is outside the vocabulary"):
        _choice(token_ids=[5, 6, -1])
    choice = _choice()
    with pytest.raises(tracerl.TrajectoryError, match="prompt_token_ids"):
        choice.prompt_token_ids = [-3, 1]


def test_openai_choices_with_a_nan_logprob_are_rejected():
    from openai.types.chat.chat_completion import ChatCompletion

    completion = ChatCompletion.model_validate({
        "id": "c1", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "a"},
                     "logprobs": {"content": [{"token": "a", "logprob": NAN, "bytes": None, "top_logprobs": []}]}}],
    })  # fmt: skip
    with pytest.raises(tracerl.TrajectoryError, match="logprob"):
        tracerl.Choice.from_openai(completion.choices[0], completion)


async def test_a_nan_rollout_reward_raises_where_it_is_set():
    with pytest.raises(tracerl.TrajectoryError, match="rollout reward must be a finite number, got nan"):
        async with ti.rollout(task="t") as r:
            r.reward = 0.25
            r.reward = NAN
    assert r.reward == 0.25 and r.trajectory is not None and r.trajectory.reward == 0.25


# -- again where they are used -----------------------------------------------------------------------
def test_numbers_changed_in_place_are_caught_with_the_group_and_trajectory_named():
    from tracerl.types import check_groups

    groups = _groups()
    check_groups(groups)
    t = groups[1].trajectories[1]
    t.metrics["accuracy"] = NAN  # in place: no validator runs
    with pytest.raises(tracerl.TrajectoryError) as caught:
        check_groups(groups)
    message = str(caught.value)
    assert f"group 1 (task 'second'), trajectory 1 (id {t.id}): metrics['accuracy']" in message and "nan" in message
    t.metrics["accuracy"] = 0.5
    t.__dict__["reward"] = INF  # even past pydantic
    with pytest.raises(tracerl.TrajectoryError, match=rf"group 1 \(task 'second'\), trajectory 1 \(id {t.id}\): reward is inf"):
        check_groups(groups)
    t.__dict__["reward"] = 0.0
    groups[0].metrics["spread"] = NAN
    with pytest.raises(tracerl.TrajectoryError, match=r"group 0 \(task 'first'\): metrics\['spread'\]"):
        check_groups(groups)


def test_token_ids_and_logprobs_changed_in_place_name_the_turn():
    from tracerl.types import check_groups

    groups = _groups()
    turn = groups[0].trajectories[0].sampled_turns()[0]
    turn.logprobs[2] = NAN
    with pytest.raises(tracerl.TrajectoryError, match=r"group 0 \(task 'first'\), trajectory 0 \(id \w+\), history 0, turn 1: the sampler logprob at position 2"):
        check_groups(groups)
    turn.logprobs[2] = -0.1
    turn.token_ids[1] = 49152
    check_groups(groups)  # no bound known: only negatives are out
    with pytest.raises(tracerl.TrajectoryError, match=r"turn 1, completion: token id 49152 at position 1 is outside the vocabulary \[0, 49152\)"):
        check_groups(groups, vocab_size=49152)
    turn.token_ids[1] = 6
    turn.prompt_token_ids[0] = -7
    with pytest.raises(tracerl.TrajectoryError, match=r"turn 1, prompt: token id -7 at position 0"):
        check_groups(groups, vocab_size=49152)


def test_model_log_refuses_a_nan_metric_and_writes_nothing(tmp_path):
    model = tracerl.Model("evals", "p", base_path=tmp_path)
    group = tracerl.TrajectoryGroup([_trajectory(1.0, metrics={"correct": 1})], metadata={"task": "q"})
    group.trajectories[0].metrics["correct"] = NAN
    with pytest.raises(tracerl.TrajectoryError, match=r"group 0 \(task 'q'\), trajectory 0 .*metrics\['correct'\]"):
        asyncio.run(model.log([group], split="val", step=1))
    assert model.history() == [] and not model.run_dir.trajectories_path("val", 1).exists()


def test_remote_groups_with_a_nan_name_the_group_and_trajectory():
    payload = json.loads(dumps_body({"groups": encode_groups(_groups())}))
    payload["groups"][1]["trajectories"][0]["metrics"] = {"score": NAN}  # what a NaN in place sends (json writes NaN)
    wire = json.loads(json.dumps(payload))
    with pytest.raises(tracerl.TrajectoryError, match=r"group 1: trajectory 0: malformed trajectory \(id \w+\): Trajectory.metrics: metrics\['score'\]"):
        decode_groups(wire["groups"])


# -- hyperparameters -----------------------------------------------------------------------------------
BAD_ARGUMENTS = [
    ("learning_rate", NAN), ("learning_rate", INF), ("learning_rate", 0.0), ("learning_rate", -1e-5), ("learning_rate", True),
    ("learning_rate", "1e-5"), ("max_grad_norm", -1.0), ("max_grad_norm", 0.0), ("max_grad_norm", NAN), ("max_grad_norm", INF),
    ("epsilon", 0.0), ("epsilon", -0.2), ("epsilon", NAN), ("epsilon", 1.5), ("epsilon_high", 0.0), ("epsilon_high", INF),
    ("kl_penalty_coef", -0.1), ("kl_penalty_coef", NAN), ("loss_fn", "grpo"), ("importance_sampling_level", "seq"),
    ("scale_rewards", "false"), ("allow_retokenize", 1), ("on_non_finite", "ignore"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "value"), BAD_ARGUMENTS)
async def test_bad_train_arguments_are_a_config_error_naming_them(name, value, tmp_path):
    backend = tracerl.LocalBackend(inference=None)
    model = tracerl.TrainableModel("m", "p", "smollm2-135m", base_path=tmp_path)  # not even registered: nothing runs
    with pytest.raises(tracerl.ConfigError, match=rf"^{name} must"):
        await backend.train(model, [], **{name: value})
    assert not tmp_path.joinpath("p").exists()


def test_epsilon_bounds_follow_the_loss():
    from tracerl.validation import check_step_settings

    settings = dict(learning_rate=1e-5, epsilon_high=None, importance_sampling_level="token", kl_penalty_coef=0.0, max_grad_norm=0.1)
    check_step_settings(loss_fn="cispo", epsilon=1.0, **settings)  # CISPO's default: no lower truncation
    check_step_settings(loss_fn="ppo", epsilon=0.2, **settings)
    with pytest.raises(tracerl.ConfigError, match=r"epsilon must be < 1 for loss_fn='ppo'"):
        check_step_settings(loss_fn="ppo", epsilon=1.0, **settings)
    with pytest.raises(tracerl.ConfigError, match=r"epsilon must be <= 1 for loss_fn='cispo'"):
        check_step_settings(loss_fn="cispo", epsilon=4.0, **settings)


def test_a_bad_argument_fails_before_torch_is_imported(tmp_path):
    code = f"""
import asyncio, sys, tracerl
backend = tracerl.LocalBackend(inference=None)
model = tracerl.TrainableModel("m", "p", "smollm2-135m", base_path={str(tmp_path)!r})
try:
    asyncio.run(backend.train(model, [], learning_rate=float("nan")))
except tracerl.ConfigError as error:
    print(type(error).__name__, error)
assert "torch" not in sys.modules, "torch was imported"
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("ConfigError learning_rate must be a finite number > 0, got nan")


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"r": 0}, r"lora_config\['r'\]"), ({"r": 2.5}, r"lora_config\['r'\]"), ({"r": True}, r"lora_config\['r'\]"),
        ({"alpha": 0}, r"lora_config\['alpha'\]"), ({"lora_alpha": NAN}, r"lora_config\['alpha'\]"),
        ({"dropout": 1.0}, r"lora_config\['dropout'\]"), ({"lora_dropout": -0.1}, r"lora_config\['dropout'\]"),
        ({"target_modules": []}, "target_modules"), ({"target_modules": "q_proj"}, "target_modules"),
    ],
)  # fmt: skip
def test_bad_lora_settings_fail_when_the_model_is_created(config, match, tmp_path):
    with pytest.raises(tracerl.ConfigError, match=match):
        tracerl.TrainableModel("m", "p", "smollm2-135m", base_path=tmp_path, lora_config=config)


def test_lora_settings_keep_art_spellings_and_reject_unknown_keys(tmp_path):
    from tracerl.train.trainer import LoRASettings

    assert LoRASettings.from_dict({"r": 16, "lora_alpha": 32, "lora_dropout": 0.05}) == LoRASettings(r=16, alpha=32, dropout=0.05)
    assert LoRASettings.from_dict({"r": 8.0, "target_modules": ["q_proj"]}).target_modules == ("q_proj",)
    with pytest.raises(TypeError, match="rank"):
        tracerl.TrainableModel("m", "p", "smollm2-135m", base_path=tmp_path, lora_config={"rank": 4})
    with pytest.raises(tracerl.ConfigError, match=r"lora_config\['r'\]"):
        LoRASettings(r=0)
    assert math.isfinite(LoRASettings().alpha)
