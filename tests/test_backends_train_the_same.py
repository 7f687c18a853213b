"""One step configuration for every backend: the same keywords, defaults and checks, and the same training.

``LocalBackend.train``, ``TinkerBackend.train``, ``RemoteBackend.train`` and ``PipelineTrainer``
take :class:`~tracerl.train.step_config.StepConfig`'s settings plus ``scale_rewards``,
``allow_retokenize`` and ``on_non_finite``.  Then the same groups, from the same initial adapter,
are trained through ``LocalBackend`` (here) and through ``TinkerBackend`` on a ``tracerl serve
--tinker`` service (in this process, on loopback), with settings that exercise every part of the
loss: a KL penalty to the base model, a stale turn (sampled by ``agent@0`` while step 2 trains from
step 1: decoupled off-policy correction), a turn without sampler logprobs (ratio 1), sequence-level
ratios and PPO in the second step.  Both must report the same loss and gradient norm.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import shutil

import pytest

import tracerl
from tracerl.loops.pipeline import PipelineTrainer
from tracerl.serve.remote_backend import RemoteBackend
from tracerl.tinker.backend import TinkerBackend
from tracerl.train.local_backend import LocalBackend
from tracerl.train.step_config import StepConfig
from tinker_loopback import tinker_on_loopback

KEY = "tml-tracerl-same-steps-key"
SEED = 7
TRAIN_OPTIONS = {"scale_rewards": True, "allow_retokenize": False, "on_non_finite": "raise"}
STEP_SETTINGS = {("importance_sampling_level" if f.name == "importance_level" else f.name): f.default for f in dataclasses.fields(StepConfig)}
ENTRY_POINTS = {
    "LocalBackend.train": LocalBackend.train,
    "TinkerBackend.train": TinkerBackend.train,
    "RemoteBackend.train": RemoteBackend.train,
    "PipelineTrainer": PipelineTrainer.__init__,
}


def test_every_entry_point_takes_stepconfigs_settings_with_its_defaults():
    expected = {**STEP_SETTINGS, **TRAIN_OPTIONS}
    annotations = None
    for name, function in ENTRY_POINTS.items():
        params = inspect.signature(function).parameters
        assert {key: params[key].default for key in expected if key in params} == expected, name
        assert all(params[key].kind is inspect.Parameter.KEYWORD_ONLY for key in expected), name
        found = {key: params[key].annotation for key in expected}
        assert annotations is None or found == annotations, name  # the same types, written the same way
        annotations = found
        if name != "PipelineTrainer":  # a backend takes these and nothing else
            assert {k for k, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY} == set(expected), name
            assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()), name


async def _rollout(model, scenario, config):  # never run
    raise AssertionError


async def test_a_bad_or_unknown_setting_fails_alike_everywhere_before_anything_loads(tmp_path):
    model = tracerl.TrainableModel("agent", "same", "smollm2-135m", base_path=tmp_path)
    local = LocalBackend(tmp_path, inference=None)
    tinker_backend = TinkerBackend("http://127.0.0.1:9", KEY)
    remote = RemoteBackend("http://127.0.0.1:9")
    trains = [local.train, tinker_backend.train, remote.train]
    for bad, match in (({"max_mismatch_kl": -1.0}, "max_mismatch_kl"), ({"mismatch_correction": "clip"}, "mismatch_correction"),
                       ({"learning_rate": math.nan}, "learning_rate"), ({"off_policy_cap": 0.5}, "off_policy_cap"),
                       ({"on_non_finite": "ignore"}, "on_non_finite"), ({"scale_rewards": 1}, "scale_rewards")):  # fmt: skip
        for train in trains:
            with pytest.raises(tracerl.ConfigError, match=match):
                await train(model, [], **bad)
        with pytest.raises(tracerl.ConfigError, match=match):
            PipelineTrainer(model, local, _rollout, [], max_steps=1, **bad)
        with pytest.raises(tracerl.ConfigError, match=match):
            PipelineTrainer(model, local, _rollout, [], max_steps=1, train_kwargs=bad)
    for train in trains:
        with pytest.raises(TypeError, match="learning_rat"):
            await train(model, [], learning_rat=1e-4)
    with pytest.raises(TypeError, match="learning_rat"):
        PipelineTrainer(model, local, _rollout, [], max_steps=1, train_kwargs={"learning_rat": 1e-4})
    with pytest.raises(TypeError, match="twice"):
        PipelineTrainer(model, local, _rollout, [], max_steps=1, learning_rate=1e-4, train_kwargs={"learning_rate": 1e-3})
    pipeline = PipelineTrainer(model, local, _rollout, [], max_steps=1, learning_rate=1e-4, train_kwargs={"max_mismatch_kl": None})
    assert pipeline.train_kwargs == {"learning_rate": 1e-4, "max_mismatch_kl": None}  # what differs from the defaults


# -- the same groups through LocalBackend and TinkerBackend -------------------------------------------------
def _turn(tokenizer, prompt_ids: list[int], text: str, *, served: str, known: bool) -> tracerl.Choice:
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    values = None
    if known:  # made-up sampler logprobs: ratios away from 1, some outside the clips
        values = [-(0.3 + 0.17 * ((i * 7 + len(text)) % 11)) for i in range(len(ids))]
    return tracerl.Choice(
        message={"role": "assistant", "content": text}, token_ids=ids, prompt_token_ids=prompt_ids, logprobs=values, model=served
    )


def _group(tokenizer, question: str, answers: list[tuple[str, float, str, bool]]) -> tracerl.TrajectoryGroup:
    """``answers``: (text, reward, the policy that sampled it, whether its logprobs are known)."""
    messages = [{"role": "user", "content": question}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return tracerl.TrajectoryGroup(
        tracerl.Trajectory(
            messages_and_choices=[*messages, _turn(tokenizer, list(prompt_ids), text, served=served, known=known)],
            reward=reward,
        )
        for text, reward, served, known in answers
    )


FIRST_STEP = dict(learning_rate=2e-3, max_grad_norm=1e3, max_mismatch_kl=None)  # a KL to the base is 0, its gradient too, at step 0
SECOND_STEP = dict(
    learning_rate=2e-3, loss_fn="ppo", importance_sampling_level="sequence", kl_penalty_coef=0.1, max_grad_norm=1e3,
    max_mismatch_kl=None, off_policy_cap=1.5,
)  # fmt: skip
COMPARED = ("loss", "grad_norm", "ratio_mean", "kl", "stale_token_fraction", "off_policy_ratio_mean", "mismatch_kl", "trained_tokens")


def _steps(tokenizer) -> list[list[tracerl.TrajectoryGroup]]:
    first = [
        _group(tokenizer, "Name a color.", [("Blue.", 1.0, "agent@0", True), ("I like green a lot.", 0.0, "agent@0", True),
                                            ("Red", 0.8, "agent@0", False)]),
        _group(tokenizer, "What is 2 + 3?", [("5", 1.0, "agent@0", True), ("It is six.", 0.0, "agent@0", True)]),
    ]  # fmt: skip
    second = [
        _group(tokenizer, "Name a color.", [("Blue.", 1.0, "agent@1", True), ("Purple, I think.", 0.0, "agent@0", True),
                                            ("Red", 0.2, "agent@1", False)]),
        _group(tokenizer, "Say hi.", [("Hi!", 1.0, "agent@1", True), ("Hello there, friend.", 0.3, "agent@0", True)]),
    ]  # fmt: skip
    return [first, second]


@pytest.fixture(scope="module")
def tinker_url(tmp_path_factory):
    """``tracerl serve --tinker``'s app on loopback, in this process (the service started on the server's loop)."""
    with tinker_on_loopback(tmp_path_factory.mktemp("tinker-same"), "tinker-same", token=KEY, base_model="smollm2-135m") as (url, service, _):
        yield url, service


def test_local_and_tinker_backends_train_the_same_groups_to_the_same_loss_and_gradient(tinker_url, tmp_path, smol_tokenizer):
    import torch
    from safetensors.torch import load_file

    url, service = tinker_url
    lora = {"r": 8, "alpha": 8}  # the Tinker service's LoRA alpha is its rank

    async def run() -> list[tuple[dict[str, float], dict[str, float]]]:
        local = LocalBackend(tmp_path / "local", inference=None)
        on_local = tracerl.TrainableModel("agent", "same", "smollm2-135m", lora_config=lora)
        torch.manual_seed(SEED)  # LoRA A as the service draws it for seed=SEED (B starts at 0 on both)
        await on_local.register(local)
        remote = TinkerBackend(url, KEY, seed=SEED)
        on_tinker = tracerl.TrainableModel("agent", "same", "smollm2-135m", base_path=tmp_path / "tinker", lora_config=lora)
        await on_tinker.register(remote)
        start_local = load_file(on_local.run_dir.checkpoint_path(0) / "adapter_model.safetensors")
        (saved,) = service.root.glob("*/sampler_weights/agent@0/adapter_model.safetensors")
        start_tinker = load_file(saved)
        assert start_local.keys() == start_tinker.keys() and all(torch.equal(start_local[k], start_tinker[k]) for k in start_local)
        results = []
        for groups, settings in zip(_steps(smol_tokenizer), (FIRST_STEP, SECOND_STEP)):
            a = await local.train(on_local, groups, **settings)
            b = await remote.train(on_tinker, groups, **settings)
            assert a.step == b.step
            results.append((a.metrics, b.metrics))
            if a.step == 1:
                # Adam's first step turns fp32 rounding in near-zero gradients into updates of up to the learning
                # rate (~600 of 2.4M weights here): step 2 starts both from LocalBackend's step-1 adapter, the
                # Tinker run resumed from its step-1 state (TinkerBackend.register) with these weights in it
                (state,) = service.root.glob("*/weights/step-1/adapter_model.safetensors")
                shutil.copyfile(on_local.run_dir.checkpoint_path(1) / "adapter_model.safetensors", state)
                await on_tinker.register(remote)
        # the default mismatch limit refuses these made-up sampler logprobs alike, so does a non-finite loss: nothing advances
        fresh = [_group(smol_tokenizer, "Name a color.", [("Blue.", 1.0, "agent@2", True), ("Green.", 0.0, "agent@2", True)])]
        for backend, model in ((local, on_local), (remote, on_tinker)):
            with pytest.raises(tracerl.MismatchError, match="mismatch KL"):
                await backend.train(model, fresh, learning_rate=2e-3)
            assert await backend.get_step(model) == 2
            overflowing = [_group(smol_tokenizer, "Say hi.", [("Hi!", 1e39, "agent@2", True), ("Hello.", 0.0, "agent@2", True)])]
            with pytest.raises(tracerl.NonFiniteError, match="the step did not advance"):  # advantages past float32
                await backend.train(model, overflowing, scale_rewards=False, max_mismatch_kl=None)
            assert await backend.get_step(model) == 2
        await local.close()
        await remote.close()
        return results

    results = asyncio.run(run())
    for step, (local_metrics, tinker_metrics) in enumerate(results, start=1):
        print(f"step {step}:", {k: (local_metrics.get(k), tinker_metrics.get(k)) for k in COMPARED})
        for key in COMPARED:
            if key in ("off_policy_ratio_mean", "kl") and step == 1:  # no stale turn, no KL penalty yet
                assert key not in local_metrics and key not in tinker_metrics
                continue
            assert key in local_metrics and key in tinker_metrics, key
            assert math.isclose(local_metrics[key], tinker_metrics[key], rel_tol=1e-5, abs_tol=1e-7), (step, key)
        for key in ("stale_turns", "policy_lag_max", "num_sequences", "num_groups_trainable", "clipped_fraction"):
            assert local_metrics[key] == tinker_metrics[key], (step, key)
    assert results[1][0]["stale_turns"] == 2.0 and results[1][0]["policy_lag_max"] == 1.0
    assert results[1][0]["kl"] > 0 and results[1][0]["grad_norm"] < 1e3  # a KL to pull back, and no clipping
