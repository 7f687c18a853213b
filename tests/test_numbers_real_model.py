"""Bad numbers never train, on the real SmolLM2-135M (issue 9, item 2; fault 5 of "Why").

Each fault is injected for real into a real ``LocalBackend`` that trains the model and serves
it through the transformers server: a NaN reward set after construction, a non-finite sampler
logprob, token ids outside the vocabulary, a gradient that overflows (a reward of 1e30 with
``scale_rewards=False``), a loss that overflows (1e39: its advantage is inf in float32), a NaN
planted in a LoRA weight, an update that leaves NaN in the adapter (a real optimizer hook),
``learning_rate=NaN`` and ``max_grad_norm<0``; and the typed errors through ``tracerl serve``.
After each: the step has not advanced, no checkpoint was written, the adapter and the optimizer
state are as they were, serving was resumed (a chat request answers), and the next good
``train`` call works.

Run with:  flock /tmp/tracerl-heavy.lock .venv/bin/python -m pytest -q tests/test_numbers_real_model.py
"""

from __future__ import annotations

import copy
import logging
import math

import httpx
import pytest
import torch

import tracerl
from tracerl.train.tokenization import render_ids

pytestmark = pytest.mark.real_model

NAN, INF = float("nan"), float("inf")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def make_group(tok, rewards=(1.0, 0.0)) -> tracerl.TrajectoryGroup:
    prompt = render_ids(tok, QUESTION, None, add_generation_prompt=True)

    def trajectory(text: str, reward: float) -> tracerl.Trajectory:
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        choice = tracerl.Choice(
            message={"role": "assistant", "content": text}, token_ids=ids, prompt_token_ids=prompt, logprobs=None
        )
        return tracerl.Trajectory(messages_and_choices=[*QUESTION, choice], reward=reward)

    texts = ("Paris.", "London is the capital of France.")
    return tracerl.TrajectoryGroup([trajectory(t, r) for t, r in zip(texts, rewards)], metadata={"task": "capital"})


@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    backend = tracerl.LocalBackend(tmp_path_factory.mktemp("numbers"), inference="transformers")
    model = tracerl.TrainableModel("numbers", "tests", "smollm2-135m")
    await model.register(backend)
    yield backend, model
    await backend.close()


def _trainer(backend, model):
    return backend._trainer(backend._state(model))


def _snapshot(backend, model) -> tuple[dict[str, torch.Tensor], dict]:
    trainer = _trainer(backend, model)
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return params, copy.deepcopy(trainer.optimizer.state_dict())


def _same_state(a: dict, b: dict) -> bool:
    """Optimizer state dicts equal, tensors compared exactly."""
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, dict):
            if not isinstance(y, dict) or not _same_state(x, y):
                return False
        elif isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor) or not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


async def _chat(backend, model, name: str) -> dict:
    server = backend._state(model).server
    async with httpx.AsyncClient(timeout=300, headers={"Authorization": f"Bearer {server.api_key}"}) as client:
        reply = await client.post(
            f"{server.base_url}/chat/completions", json={"model": name, "messages": QUESTION, "max_tokens": 2, "temperature": 0}
        )
    assert reply.status_code == 200, reply.text
    return reply.json()


async def _assert_nothing_changed(backend, model, step: int, before: tuple | None = None) -> None:
    """The step did not advance, nothing was written or served, serving runs, the state is as it was."""
    assert await model.get_step() == step and model.run_dir.checkpoint_steps()[-1] == step
    assert not [p for p in model.run_dir.checkpoints.iterdir() if p.name.startswith(".tmp-")]
    assert model.get_inference_name() == f"numbers@{step}"
    server = backend._state(model).server
    assert not server.engine.paused, "serving must be resumed after the error"
    assert f"numbers@{step + 1}" not in server.model_names()
    assert (await _chat(backend, model, f"numbers@{step}"))["model"] == f"numbers@{step}"
    if before is not None:
        params, optimizer = _snapshot(backend, model)
        assert params.keys() == before[0].keys() and all(torch.equal(params[k], before[0][k]) for k in params)
        assert _same_state(optimizer, before[1]), "the optimizer state changed"


async def _good_step(backend, model, tok) -> tracerl.TrainResult:
    step = await model.get_step()
    result = await backend.train(model, [make_group(tok)], learning_rate=1e-3)
    assert result.step == step + 1 and result.metrics["trained_tokens"] > 0 and math.isfinite(result.metrics["grad_norm"])
    assert f"numbers@{step + 1}" in backend._state(model).server.model_names()
    return result


async def test_a_nan_reward_set_after_construction_never_trains(served, smol_tokenizer):
    backend, model = served
    step = await model.get_step()
    group = make_group(smol_tokenizer)
    with pytest.raises(tracerl.TrajectoryError, match="reward must be a finite number, got nan"):
        group.trajectories[0].reward = NAN  # the usual pattern: reward set after the rollout
    bad = group.trajectories[1]
    bad.__dict__["reward"] = NAN  # past the validator (what in-place writes or model_construct can do)
    with pytest.raises(tracerl.TrajectoryError, match=rf"group 0 \(task 'capital'\), trajectory 1 \(id {bad.id}\): reward is nan"):
        await backend.train(model, [group])
    await _assert_nothing_changed(backend, model, step)


async def test_a_non_finite_sampler_logprob_never_trains(served, smol_tokenizer):
    backend, model = served
    step = await model.get_step()
    with pytest.raises(tracerl.TrajectoryError, match="sampler logprob at position 0 is nan"):
        tracerl.Choice(message={"role": "assistant", "content": "x"}, token_ids=[1], logprobs=[NAN])
    group = make_group(smol_tokenizer)
    turn = group.trajectories[0].sampled_turns()[0]
    turn.__dict__["logprobs"] = [-1.0, INF] + [-1.0] * (len(turn.token_ids) - 2)  # past the validator
    with pytest.raises(tracerl.TrajectoryError, match=r"trajectory 0 \(id \w+\), history 0, turn 1: the sampler logprob at position 1 is inf"):
        await backend.train(model, [group])
    await _assert_nothing_changed(backend, model, step)


async def test_token_ids_outside_the_vocabulary_never_reach_the_embedding(served, smol_tokenizer):
    backend, model = served
    step = await model.get_step()
    rows = _trainer(backend, model).model.get_input_embeddings().num_embeddings
    group = make_group(smol_tokenizer)
    turn = group.trajectories[1].sampled_turns()[0]
    turn.token_ids[2] = rows  # one past the last embedding row
    with pytest.raises(tracerl.TrajectoryError, match=rf"trajectory 1 \(id \w+\), history 0, turn 1, completion: token id {rows} at position 2 is outside the vocabulary \[0, {rows}\)"):
        await backend.train(model, [group])
    turn.token_ids[2] = 0
    turn.prompt_token_ids[0] = -1
    with pytest.raises(tracerl.TrajectoryError, match=r"turn 1, prompt: token id -1 at position 0"):
        await backend.train(model, [group])
    await _assert_nothing_changed(backend, model, step)
    # the trainer's own last line: a packed batch with an id past the embedding never runs
    from tracerl.train.packing import pack_sequences
    from tracerl.train.tokenization import TrainingSequence
    from tracerl.train.trainer import StepConfig

    sequence = TrainingSequence([1, 2, rows + 5, 3], [0.0, 1.0, 1.0, 1.0], [NAN] * 4, trajectory_index=0, group_index=0, advantage=1.0)
    with pytest.raises(tracerl.TrajectoryError, match=rf"token id {rows + 5} is outside the model's embedding \[0, {rows}\)"):
        _trainer(backend, model).step(pack_sequences([sequence], [1.0]), StepConfig())


async def test_an_overflowing_gradient_raises_and_leaves_everything_as_it_was(served, smol_tokenizer):
    backend, model = served
    await _good_step(backend, model, smol_tokenizer)  # so that the optimizer has state to keep
    step, before = await model.get_step(), _snapshot(backend, model)
    assert before[1]["state"], "AdamW should hold moments after a step"
    overflowing = make_group(smol_tokenizer, rewards=(1e30, 0.0))  # finite, but its gradient is not
    with pytest.raises(tracerl.NonFiniteError, match=r"the gradient norm is inf \(the loss was finite") as caught:
        await backend.train(model, [overflowing], scale_rewards=False)
    assert "the step did not advance" in str(caught.value) and isinstance(caught.value, FloatingPointError)
    await _assert_nothing_changed(backend, model, step, before)
    await _good_step(backend, model, smol_tokenizer)


async def test_an_overflowing_loss_names_the_trajectories(served, smol_tokenizer):
    backend, model = served
    step, before = await model.get_step(), _snapshot(backend, model)
    group = make_group(smol_tokenizer, rewards=(1e39, 0.0))  # advantages ±5e38: inf in float32
    with pytest.raises(tracerl.NonFiniteError, match=r"the loss of micro-batch 1/1 is nan") as caught:
        await backend.train(model, [group], scale_rewards=False)
    for t in group.trajectories:
        assert f"group 0 (task 'capital'), trajectory {group.trajectories.index(t)} (id {t.id})" in str(caught.value)
    assert "advantage 5e+38" in str(caught.value)
    await _assert_nothing_changed(backend, model, step, before)


async def test_a_nan_planted_in_a_lora_weight_is_never_saved_or_served(served, smol_tokenizer):
    backend, model = served
    step, before = await model.get_step(), _snapshot(backend, model)
    trainer = _trainer(backend, model)
    name, weight = next((n, p) for n, p in trainer.model.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        kept = weight[0, 0].item()
        weight[0, 0] = NAN
    try:
        with pytest.raises(tracerl.NonFiniteError, match=rf"the adapter holds NaN or infinite weights before the step .*{name}"):
            await backend.train(model, [make_group(smol_tokenizer)])
    finally:
        with torch.no_grad():
            weight[0, 0] = kept
    await _assert_nothing_changed(backend, model, step, before)
    await _good_step(backend, model, smol_tokenizer)


async def test_an_update_that_leaves_nan_in_the_adapter_is_rolled_back(served, smol_tokenizer):
    backend, model = served
    step, before = await model.get_step(), _snapshot(backend, model)
    trainer = _trainer(backend, model)

    def poison(optimizer, args, kwargs):  # runs right after AdamW's real update
        with torch.no_grad():
            optimizer.param_groups[0]["params"][0].view(-1)[0] = NAN

    hook = trainer.optimizer.register_step_post_hook(poison)
    try:
        with pytest.raises(tracerl.NonFiniteError, match="the adapter holds NaN or infinite weights after the update"):
            await backend.train(model, [make_group(smol_tokenizer)], learning_rate=1e-3)
    finally:
        hook.remove()
    assert backend._state(model).trainer is None, "the poisoned trainer is dropped, to be reloaded from the checkpoint"
    await _assert_nothing_changed(backend, model, step, before)  # reloaded: same weights and moments as before
    await _good_step(backend, model, smol_tokenizer)


@pytest.mark.parametrize(("name", "value"), [("learning_rate", NAN), ("max_grad_norm", -1.0)])
async def test_a_nan_learning_rate_or_negative_clip_never_reaches_the_adapter(served, smol_tokenizer, name, value):
    backend, model = served
    step, before = await model.get_step(), _snapshot(backend, model)
    with pytest.raises(tracerl.ConfigError, match=rf"^{name} must be a finite number > 0"):
        await backend.train(model, [make_group(smol_tokenizer)], **{name: value})
    await _assert_nothing_changed(backend, model, step, before)


async def test_skip_is_loud_and_advances_like_a_step_without_trainable_groups(served, smol_tokenizer, caplog):
    from safetensors.torch import load_file

    backend, model = served
    step, before = await model.get_step(), _snapshot(backend, model)
    with caplog.at_level(logging.WARNING, logger="tracerl"):
        result = await backend.train(model, [make_group(smol_tokenizer, rewards=(1e39, 0.0))], scale_rewards=False, on_non_finite="skip")
    assert result.step == step + 1 and result.metrics["skipped_non_finite"] == 1.0
    assert any("on_non_finite='skip'" in r.getMessage() and "loss of micro-batch" in r.getMessage() for r in caplog.records)
    old = load_file(model.run_dir.checkpoint_path(step) / "adapter_model.safetensors")
    new = load_file(model.run_dir.checkpoint_path(step + 1) / "adapter_model.safetensors")
    assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)
    assert f"numbers@{step + 1}" in backend._state(model).server.model_names()
    params, optimizer = _snapshot(backend, model)
    assert all(torch.equal(params[k], before[0][k]) for k in params) and _same_state(optimizer, before[1])
    good = await _good_step(backend, model, smol_tokenizer)
    assert good.metrics["skipped_non_finite"] == 0.0


async def test_errors_come_back_typed_through_tracerl_serve(tmp_path, smol_tokenizer):
    from tracerl.net.http_server import BackgroundUvicorn
    from tracerl.serve.server import create_app

    http = BackgroundUvicorn(create_app(tracerl.LocalBackend(tmp_path, inference=None)), name="tracerl-serve-numbers")
    url = f"http://127.0.0.1:{http.start()}"
    try:
        async with tracerl.RemoteBackend(url) as remote:
            model = tracerl.TrainableModel("remote-numbers", "tests", "smollm2-135m")
            await model.register(remote)
            with pytest.raises(tracerl.ConfigError, match="learning_rate must be a finite number > 0, got nan"):
                await remote.train(model, [make_group(smol_tokenizer)], learning_rate=NAN)
            with pytest.raises(tracerl.ConfigError, match="max_grad_norm must be a finite number > 0, got -1"):
                await remote.train(model, [make_group(smol_tokenizer)], max_grad_norm=-1)
            group = make_group(smol_tokenizer)
            group.trajectories[1].metrics["score"] = NAN
            with pytest.raises(tracerl.TrajectoryError, match=r"group 0: trajectory 1: .*metrics\['score'\]"):
                await remote.train(model, [group])
            with pytest.raises(tracerl.NonFiniteError, match="the loss of micro-batch 1/1 is nan"):
                await remote.train(model, [make_group(smol_tokenizer, rewards=(1e39, 0.0))], scale_rewards=False)
            assert await model.get_step() == 0 and await remote.list_checkpoints(model) == [0]
    finally:
        http.stop()


async def test_a_step_whose_sampler_is_not_the_trained_policy_fails_by_default(served, smol_tokenizer):
    """Turns a policy served under another policy's name (a hot-load that did not happen): the
    trainer's logprobs disagree with the recorded ones, the step fails with MismatchError naming
    the likely causes and changes nothing; measured (and trained) only when the user opts out."""
    backend, model = served
    await backend.train(model, [make_group(smol_tokenizer)], learning_rate=3e-2)  # a policy far from the last one
    step, before = await model.get_step(), _snapshot(backend, model)
    client = model.openai_client()
    trajectories = []
    for seed, reward in ((1, 1.0), (2, 0.0)):
        async with tracerl.rollout(model) as captured:
            await client.chat.completions.create(model=model.get_inference_name(step - 1), messages=QUESTION,
                                                 max_tokens=12, temperature=1.0, seed=seed)  # fmt: skip
        (turn,) = captured.trajectory.sampled_turns()
        turn.model = model.get_inference_name(step)  # answered under the new name by the old policy
        captured.trajectory.reward = reward
        trajectories.append(captured.trajectory)
    group = tracerl.TrajectoryGroup(trajectories)
    with pytest.raises(tracerl.MismatchError, match=r"mismatch KL .* > max_mismatch_kl=0\.01.*served policy is not the trained one") as error:
        await backend.train(model, [group])
    assert error.value.metrics["mismatch_kl"] > 0.01 and error.value.metrics["mismatch_tokens"] > 0
    await _assert_nothing_changed(backend, model, step, before)
    assert backend._state(model).trainer is not None  # nothing was applied: the trainer is kept
    result = await backend.train(model, [group], max_mismatch_kl=None)
    assert result.step == step + 1 and result.metrics["mismatch_kl"] == pytest.approx(error.value.metrics["mismatch_kl"], rel=1e-6)
