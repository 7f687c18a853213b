"""Public API surface, light import, run-directory safety, logging, gather, dataset and retry."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tracerl
from tracerl.runs.storage import RunDir, atomic_dir

EXPECTED_ALL = {
    "Backend", "CheckpointError", "Choice", "ConfigError", "DatasetBatch", "ExceptionRecord", "History",
    "InferenceServerError", "JudgeError", "LocalBackend", "Model", "NonFiniteError", "PipelineTrainer", "RemoteBackend", "RemoteBackendError",
    "RemoteConnectionError", "RunLockedError", "TooManyExceptionsError", "TracerlError", "TrainResult", "TrainableModel", "Trajectory",
    "TrajectoryError", "TrajectoryGroup", "gather_trajectories", "gather_trajectory_groups", "iterate_dataset", "keep_recent_and_top", "retry",
    "rollout", "trajectory", "trajectory_group",
    # typed faults (DESIGN §5.8)
    "InfrastructureError", "InferenceTimeoutError", "McpServerError", "McpTimeoutError", "RolloutTimeoutError",
    "JudgeTimeoutError", "RemoteTimeoutError",
    # the trainer disagrees with the sampler (tracerl.train.mismatch)
    "MismatchError",
    # SFT (ART's names)
    "SFTConfig", "TrainSFTConfig", "create_lr_schedule", "filter_by_reward", "load_sft_file",
    # on-policy distillation (tracerl.train.distill)
    "CompletionsTeacher", "TeacherError", "TeacherTimeoutError", "add_teacher_advantages", "served_teacher",
    "with_worked_examples",
    # serverless: a Backend over any Tinker-API service (tracerl.tinker.backend)
    "TinkerBackend",
    # ART's type names, for code written against ART
    "Messages", "MessageOrChoice", "MessagesAndChoices", "Tools",
    # the sampling parameters a sampled turn records (Choice.sampling)
    "SamplingParams",
}


def test_public_api_is_pinned():
    assert set(tracerl.__all__) == EXPECTED_ALL
    for name in tracerl.__all__:
        assert getattr(tracerl, name) is not None


def test_import_is_light():
    code = "import tracerl, sys; bad = {'torch', 'transformers', 'vllm', 'peft', 'litellm'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_help_explains_every_command():
    out = subprocess.run([sys.executable, "-m", "tracerl.cli", "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("prepare-model", "models", "history", "plot", "install-vllm"):
        assert command in out


def test_errors_inherit_the_stdlib_error_they_replace():
    assert issubclass(tracerl.ConfigError, ValueError) and issubclass(tracerl.ConfigError, tracerl.TracerlError)
    assert issubclass(tracerl.RemoteBackendError, RuntimeError) and issubclass(tracerl.RemoteBackendError, tracerl.TracerlError)
    assert issubclass(tracerl.RemoteConnectionError, ConnectionError) and issubclass(tracerl.RemoteConnectionError, tracerl.RemoteBackendError)


@pytest.mark.parametrize("bad", ["../escape", "a/b", "", ".hidden", "x" * 200, "a\\b", "..", "/abs"])
def test_names_that_escape_the_data_directory_are_rejected(bad, tmp_path):
    with pytest.raises(tracerl.ConfigError, match="invalid"):
        tracerl.TrainableModel(bad, "p", "smollm2-135m", base_path=tmp_path)
    with pytest.raises(tracerl.ConfigError):
        tracerl.Model("ok", bad, base_path=tmp_path)


def test_unknown_train_keyword_is_a_type_error(tmp_path):
    backend = tracerl.LocalBackend(inference=None)
    model = tracerl.TrainableModel("m", "p", "smollm2-135m", base_path=tmp_path)
    with pytest.raises(TypeError, match="beta"):
        asyncio.run(backend.train(model, [], beta=0.1))


def test_unknown_hub_model_fails_with_guidance(monkeypatch):
    from tracerl.base_models import resolve_base_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(tracerl.ConfigError, match="smollm2-135m"):
        resolve_base_model("someone/not-a-real-model-xyz")


def test_atomic_dir_leaves_nothing_on_failure(tmp_path):
    run = RunDir(tmp_path, "p", "m")
    with pytest.raises(RuntimeError):
        with atomic_dir(run.checkpoint_path(1)) as tmp:
            (tmp / "adapter_model.safetensors").write_text("half")
            raise RuntimeError("killed")
    assert run.checkpoint_steps() == [] and not any(run.checkpoints.iterdir())


def test_history_skips_a_torn_last_line(tmp_path):
    run = RunDir(tmp_path, "p", "m")
    run.append_history({"step": 1, "train/reward": 0.5})
    with open(run.history_path, "a") as f:
        f.write('{"step": 2, "train/rew')
    assert run.read_history() == [{"step": 1, "train/reward": 0.5}]


def _t(reward, **metrics):
    return tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}], reward=reward, metrics=metrics)


def test_log_aggregates_and_writes_history(tmp_path):
    model = tracerl.Model("judge", "p", base_path=tmp_path)
    groups = [tracerl.TrajectoryGroup([_t(1.0, correct=1), _t(0.0, correct=0)]), tracerl.TrajectoryGroup([_t(0.5), ValueError("boom")])]
    row = asyncio.run(model.log(groups, split="val", metrics={"loss": 0.25}, step=7))
    assert row["step"] == 7 and row["val/reward"] == pytest.approx(0.5)
    assert row["val/correct"] == pytest.approx(0.5) and row["val/exception_rate"] == pytest.approx(0.25)
    assert row["val/loss"] == 0.25 and row["val/reward_std_dev"] == pytest.approx(0.5)
    assert model.history()[-1] == row
    assert len(model.run_dir.trajectories_path("val", 7).read_text().splitlines()) == 3


def test_best_checkpoint_is_kept(tmp_path):
    from tracerl.model import best_step

    assert best_step([{"step": 1, "val/reward": 0.2}, {"step": 2, "val/reward": 0.9}, {"step": 3, "val/reward": 0.4}], "val/reward") == 2
    assert best_step([{"step": 1}], "val/reward") is None


def _sampled(content, **extra):
    return tracerl.Choice(
        message={"role": "assistant", "content": content}, token_ids=[5, 6, 2], prompt_token_ids=[1, 2, 3],
        logprobs=[-0.5, -0.25, -0.125], finish_reason="stop", response_id="chatcmpl-1", **extra,
    )  # fmt: skip


def _kinds(history):
    return [type(item).__name__ for item in history.messages_and_choices]


def test_stored_trajectories_read_back_with_sampled_turns_as_choices(tmp_path):
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
    side = tracerl.History(messages_and_choices=[{"role": "user", "content": "sub"}, _sampled("sub answer")], tools=[tool])
    trajectory = tracerl.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "s"}, {"role": "user", "content": "q"},
            _sampled("", stop_reason=None), {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "3"}, _sampled("3"),
        ],
        tools=[tool], additional_histories=[side], reward=0.75, metrics={"turns": 2, "ok": True, "cost": 0.5},
        metadata={"task": {"a": [1, 2]}}, logs=["hello"], trace_id="abc",
    )  # fmt: skip
    back = tracerl.Trajectory.from_json_dict(json.loads(json.dumps(trajectory.to_json_dict())))
    assert back == trajectory and back.to_json_dict() == trajectory.to_json_dict()
    assert _kinds(back) == ["dict", "dict", "Choice", "dict", "dict", "Choice"]
    assert _kinds(back.additional_histories[0]) == ["dict", "Choice"] and back.additional_histories[0].tools == [tool]
    assert back.sampled_turns()[0].model_extra == {"stop_reason": None}

    group = tracerl.TrajectoryGroup([trajectory, ValueError("boom")], metadata={"task": "q"}, metrics={"m": 1})
    model = tracerl.Model("reader", "p", base_path=tmp_path)
    asyncio.run(model.log([group], split="train", step=3))
    rows = [json.loads(line) for line in model.run_dir.trajectories_path("train", 3).read_text().splitlines()]
    assert [tracerl.Trajectory.from_json_dict(row) for row in rows] == [trajectory]  # the "group" key is ignored

    again = tracerl.TrajectoryGroup.from_json_dict(json.loads(json.dumps(group.to_json_dict())))
    assert again == group and again.exceptions[0].type == "ValueError"
    assert _kinds(tracerl.TrajectoryGroup([trajectory.to_json_dict()]).trajectories[0]) == _kinds(trajectory)
    with pytest.raises(tracerl.TrajectoryError, match="malformed trajectory"):
        tracerl.Trajectory.from_json_dict({"messages_and_choices": [], "reward": "lots"})
    with pytest.raises(tracerl.TrajectoryError):
        tracerl.Trajectory.from_json_dict([])
    with pytest.raises(tracerl.TrajectoryError, match="malformed trajectory group"):
        tracerl.TrajectoryGroup.from_json_dict({"trajectories": [], "exceptions": [{"kind": "x"}]})


_text = st.text(max_size=6)
_finite = st.floats(allow_nan=False, allow_infinity=False)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**9), 10**9) | _finite | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=8,
)
_ids = st.none() | st.lists(st.integers(0, 50_000), max_size=4)
_choice = st.builds(
    tracerl.Choice,
    message=st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none() | _text}),
    token_ids=_ids, prompt_token_ids=_ids, logprobs=st.none() | st.lists(st.floats(-30, 0), max_size=4),
    finish_reason=st.none() | st.sampled_from(["stop", "length", "tool_calls"]), index=st.integers(0, 3),
    response_id=st.none() | _text,
)  # fmt: skip
_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": _text})
_items = st.lists(_message | _choice, max_size=5)
_tools = st.none() | st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.dictionaries(_text, _json, max_size=2)}), max_size=2)
_trajectory = st.builds(
    tracerl.Trajectory,
    messages_and_choices=_items, tools=_tools,
    additional_histories=st.lists(st.builds(tracerl.History, messages_and_choices=_items, tools=_tools), max_size=2),
    reward=_finite, metrics=st.dictionaries(_text, st.booleans() | st.integers(-1000, 1000) | _finite, max_size=3),
    metadata=st.dictionaries(_text, _json, max_size=3), logs=st.lists(_text, max_size=2), trace_id=st.none() | _text,
)  # fmt: skip


def test_an_sdk_choice_appended_as_it_came_is_a_sampled_turn_everywhere(tmp_path):
    """ART's idiom: ``trajectory.messages_and_choices.append(completion.choices[0])`` skips validation."""
    from openai.types.chat import ChatCompletion

    completion = ChatCompletion.model_validate({
        "id": "r1", "object": "chat.completion", "created": 0, "model": "m@2", "prompt_token_ids": [1, 2],
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "5"}, "token_ids": [33, 2],
                     "logprobs": {"content": [{"token": t, "logprob": -0.5, "bytes": None, "top_logprobs": []} for t in "5."]}}],
    })  # fmt: skip
    trajectory = tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}], reward=1)
    trajectory.messages_and_choices.append(completion.choices[0])
    assert trajectory.messages() == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "5"}]
    [turn] = trajectory.sampled_turns()
    assert turn.token_ids == [33, 2] and turn.logprobs == [-0.5, -0.5]
    model = tracerl.Model("art", "p", base_path=tmp_path)
    asyncio.run(model.log([tracerl.TrajectoryGroup([trajectory])], split="train", step=1))
    [row] = [json.loads(line) for line in model.run_dir.trajectories_path("train", 1).read_text().splitlines()]
    assert tracerl.Trajectory.from_json_dict(row).sampled_turns() == [turn]


@settings(max_examples=60, deadline=None)
@given(_trajectory)
def test_from_json_dict_inverts_to_json_dict(trajectory):
    back = tracerl.Trajectory.from_json_dict(json.loads(json.dumps(trajectory.to_json_dict())))
    assert back == trajectory
    for original, restored in zip(trajectory.histories(), back.histories(), strict=True):
        assert _kinds(restored) == _kinds(original)


def test_odd_metadata_values_are_logged_as_text_not_lost(tmp_path):
    class Task:
        def __str__(self) -> str:
            return "task #7"

    t = tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}], metadata={"task": Task(), "tags": {"a"}})
    stored = json.loads(json.dumps(t.to_json_dict()))
    assert stored["metadata"] == {"task": "task #7", "tags": ["a"]}


async def _rollout(reward, fail=False):
    await asyncio.sleep(0.001)
    if fail:
        raise RuntimeError("tool server died")
    return _t(reward, turns=2)


async def test_gather_keeps_exceptions_as_values_and_runs_after_each():
    seen = []

    async def after_each(group):
        seen.append(len(group))
        return None if len(group) == 1 else group

    groups = await tracerl.gather_trajectory_groups(
        [
            tracerl.TrajectoryGroup(_rollout(r) for r in (0.0, 1.0)),
            tracerl.TrajectoryGroup([_rollout(1.0), _rollout(0.0, fail=True)]),
        ],
        max_exceptions=1,
        after_each=after_each,
        pbar_desc=None,
    )
    assert len(groups) == 1 and groups.metrics["groups_dropped"] == 1 and groups.metrics["exceptions"] == 1
    assert sorted(seen) == [1, 2]


async def test_gather_raises_past_max_exceptions():
    with pytest.raises(tracerl.TooManyExceptionsError, match="tool server died"):
        await tracerl.gather_trajectory_groups([tracerl.TrajectoryGroup([_rollout(0, fail=True)])], pbar_desc=None)


async def test_gather_trajectories_flat():
    out = await tracerl.gather_trajectories([_rollout(1.0), _rollout(0, fail=True)], max_exceptions=0.5, pbar_desc=None)
    assert isinstance(out[0], tracerl.Trajectory) and isinstance(out[1], tracerl.ExceptionRecord)


def test_iterate_dataset_resumes_exactly():
    items = list(range(10))
    full = [b for b in tracerl.iterate_dataset(items, groups_per_step=3, num_epochs=2, use_tqdm=False)]
    assert [b.step for b in full] == list(range(8)) and full[4].epoch == 1
    resumed = list(tracerl.iterate_dataset(items, groups_per_step=3, num_epochs=2, initial_step=5, use_tqdm=False))
    assert [(b.step, b.items) for b in resumed] == [(b.step, b.items) for b in full[5:]]
    assert sorted(i for b in full[:4] for i in b.items) == items


async def test_retry_sync_and_async():
    calls = []

    @tracerl.retry(max_attempts=3, delay=0.0)
    async def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("again")
        return "ok"

    assert await flaky() == "ok" and len(calls) == 3

    @tracerl.retry(max_attempts=2, delay=0.0, exceptions=(KeyError,))
    def never():
        raise KeyError("x")

    with pytest.raises(KeyError):
        never()


def test_litellm_params_and_inference_name(tmp_path):
    model = tracerl.TrainableModel("agent", "p", "smollm2-135m", base_path=tmp_path)
    assert model.get_inference_name(4) == "agent@4" and model.get_inference_name() == "agent@0"
    model.inference_base_url = "http://127.0.0.1:9/v1"
    params = model.litellm_completion_params(step=2)
    assert params["model"] == "hosted_vllm/agent@2" and params["base_url"].endswith("/v1")
    assert model.openai_client() is model.openai_client()
