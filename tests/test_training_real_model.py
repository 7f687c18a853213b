"""GRPO on the real SmolLM2-135M: the policy moves in the rewarded direction, checkpoints resume."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import tracerl
from tracerl.train.packing import pack_sequences
from tracerl.train.tokenization import render_ids, tokenize_trajectory
from tracerl.train.trainer import LoRATrainer

pytestmark = pytest.mark.real_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GOOD, BAD = "Paris.", "London is the capital of France."


def make_group(tok, good_reward=1.0, bad_reward=0.0):
    prompt = render_ids(tok, QUESTION, None, add_generation_prompt=True)

    def trajectory(text, reward):
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        choice = tracerl.Choice(message={"role": "assistant", "content": text}, token_ids=ids, prompt_token_ids=prompt)
        return tracerl.Trajectory(messages_and_choices=[*QUESTION, choice], reward=reward)

    return tracerl.TrajectoryGroup([trajectory(GOOD, good_reward), trajectory(BAD, bad_reward)])


def mean_logprobs(trainer, tok, group):
    """Mean per-token logprob of each completion under the trainer's current policy."""
    sequences = [s for i, t in enumerate(group.trajectories) for s in tokenize_trajectory(t, tok, trajectory_index=i)]
    out = []
    for seq in sequences:
        [mb] = pack_sequences([seq], [1.0])
        lp = trainer.token_logprobs(mb)
        out.append(float(lp.mean()))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory, smol_path, smol_tokenizer):
    import asyncio

    base = tmp_path_factory.mktemp("runs")

    async def run():
        model = tracerl.TrainableModel("capitals", "tests", "smollm2-135m", base_path=base)
        backend = tracerl.LocalBackend(inference=None)
        await model.register(backend)
        group = make_group(smol_tokenizer)
        fresh = LoRATrainer(smol_path, adapter_path=model.run_dir.checkpoint_path(0))
        before = mean_logprobs(fresh, smol_tokenizer, group)
        del fresh
        results = [await backend.train(model, [group], learning_rate=2e-3) for _ in range(2)]
        after = mean_logprobs(backend._trainer(backend._state(model)), smol_tokenizer, group)
        flat = await backend.train(model, [make_group(smol_tokenizer, 0.5, 0.5)], learning_rate=2e-3)
        await model.log([group], split="train", metrics=results[-1].metrics, step=results[-1].step)
        await backend.close()
        return model, results, flat, before, after

    return asyncio.run(run())


def test_two_steps_move_the_policy_toward_the_rewarded_completion(trained):
    model, results, _, before, after = trained
    assert [r.step for r in results] == [1, 2]
    assert after[0] > before[0], "the rewarded completion should become more likely"
    assert after[1] < before[1], "the penalised completion should become less likely"
    for step in (0, 1, 2):
        assert (model.run_dir.checkpoint_path(step) / "adapter_model.safetensors").exists()
    m = results[0].metrics
    assert m["num_groups_trainable"] == 1 and m["trained_tokens"] > 0 and m["grad_norm"] > 0
    assert results[1].checkpoint_path.endswith("0002")


def test_equal_rewards_advance_the_step_without_changing_the_adapter(trained):
    model, results, flat, _, _ = trained
    assert flat.step == 3 and flat.metrics["num_groups_trainable"] == 0
    from safetensors.torch import load_file

    a = load_file(model.run_dir.checkpoint_path(2) / "adapter_model.safetensors")
    b = load_file(model.run_dir.checkpoint_path(3) / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_history_and_trajectories_are_written(trained):
    model = trained[0]
    rows = model.history()
    assert rows[-1]["step"] == 2 and rows[-1]["train/reward"] == pytest.approx(0.5)
    assert "train/loss" in rows[-1]
    lines = model.run_dir.trajectories_path("train", 2).read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["reward"] == 1.0


def test_a_new_process_resumes_at_the_latest_step(trained):
    model = trained[0]
    code = (
        "import asyncio, tracerl\n"
        "async def main():\n"
        f"    m = tracerl.TrainableModel('capitals', 'tests', 'smollm2-135m', base_path={str(model.base_path)!r})\n"
        "    await m.register(tracerl.LocalBackend(inference=None))\n"
        "    print(await m.get_step(), m.get_inference_name())\n"
        "asyncio.run(main())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["3", "capitals@3"]


def test_interrupted_checkpoint_write_is_ignored_on_resume(trained, tmp_path):
    model = trained[0]
    partial = model.run_dir.checkpoints / ".tmp-killed"
    partial.mkdir()
    (partial / "adapter_config.json").write_text("{}")
    assert model.run_dir.latest_step() == 3
    model.run_dir.repair()
    assert not partial.exists()


def test_delete_checkpoints_keeps_latest_and_best(tmp_path, smol_path):
    import asyncio

    async def run():
        model = tracerl.TrainableModel("pruned", "tests", "smollm2-135m", base_path=tmp_path)
        backend = tracerl.LocalBackend(inference=None)
        await model.register(backend)
        for step in (1, 2, 3):  # copy-forward steps (no trainable group): cheap, still real checkpoints
            group = tracerl.TrajectoryGroup([tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}], reward=1.0)])
            await backend.train(model, [group])
            await model.log([group], split="val", step=step, metrics={"reward": {1: 0.2, 2: 0.9, 3: 0.4}[step]})
        deleted = await model.delete_checkpoints("val/reward")
        await backend.close()
        return model, deleted

    model, deleted = asyncio.run(run())
    assert deleted == [0, 1] and model.run_dir.checkpoint_steps() == [2, 3]
