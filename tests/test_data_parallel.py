"""Data-parallel GRPO: two rank processes (gloo) take the step one process takes.

Both start from the same adapter (its ``B`` made non-zero, so every LoRA weight gets a gradient)
and train on the same packed micro-batches; the adapters they write agree to float tolerance.
The tiny random Llama runs in the light suite; SmolLM2-135M (``real_model``) is the acceptance run.

The ranks are started once and kept (issue 44.6): measured per step, no process is started or
ends during a step (the parent's children stay the same, and no child was reaped: the CPU time of
reaped children, ``RUSAGE_CHILDREN``, does not move) and each rank has loaded the model once.
"""

from __future__ import annotations

import gc
import os
import resource
import shutil
import signal
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

import tracerl
from tracerl.cluster.data_parallel import PersistentLoRATrainer, shard, train_step_data_parallel
from tracerl.errors import InfrastructureError, TrajectoryError
from tracerl.train.packing import pack_sequences
from tracerl.train.tokenization import TrainingSequence
from tracerl.train.trainer import LoRASettings, LoRATrainer, StepConfig

LORA = LoRASettings(r=4, alpha=8, target_modules=("q_proj", "v_proj"))
CONFIG = StepConfig(learning_rate=1e-3, max_grad_norm=1.0, max_mismatch_kl=None)  # made-up sampler logprobs


def _micro_batches(vocab: int, *, bad_token: int | None = None) -> list:
    """Eight sequences (prompt weight 0, completion weight 1, advantages of both signs) in ~4 micro-batches."""
    generator = torch.Generator().manual_seed(0)
    sequences = []
    for i in range(8):
        prompt, completion = 6 + i % 3, 4 + i % 4
        ids = torch.randint(3, vocab, (prompt + completion,), generator=generator).tolist()
        old = (-torch.rand(prompt + completion, generator=generator) * 4).tolist()
        sequences.append(TrainingSequence(ids, [0.0] * prompt + [1.0] * completion, old, trajectory_index=i,
                                          group_index=i // 4, advantage=1.0 if i % 2 else -1.0))
    if bad_token is not None:
        sequences[-1].token_ids[-1] = bad_token
    return pack_sequences(sequences, [1.0] * len(sequences), max_tokens=32, share_prefix=False)


def _start_adapter(model_path: Path, out: Path) -> Path:
    trainer = LoRATrainer(model_path, lora=LORA, device="cpu")
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    trainer.save(out, step=0)
    return out


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "adapter_model.safetensors")


def _vocab(model_path: Path) -> int:
    import json

    return json.loads((model_path / "config.json").read_text())["vocab_size"]


@pytest.fixture(params=["tiny-llama", pytest.param("smollm2-135m", marks=pytest.mark.real_model)])
def model_path(request) -> Path:
    return request.getfixturevalue("tiny_llama" if request.param == "tiny-llama" else "smol_path")


def test_two_gloo_workers_give_the_adapter_one_process_gives(model_path, tmp_path):
    start = _start_adapter(model_path, tmp_path / "0000")
    micro_batches = _micro_batches(_vocab(model_path))
    assert len(micro_batches) >= 3  # both ranks get a share
    single = LoRATrainer(model_path, lora=LORA, adapter_path=start, device="cpu")
    one_metrics = single.step(micro_batches, CONFIG)
    single.save(tmp_path / "single", step=1)
    del single
    dp_metrics = train_step_data_parallel(model_path, micro_batches, CONFIG, tmp_path / "dp", workers=2,
                                          adapter_path=start, lora=LORA)
    assert dp_metrics["data_parallel_workers"] == 2.0
    before, one, two = _weights(start), _weights(tmp_path / "single"), _weights(tmp_path / "dp")
    assert one.keys() == two.keys() == before.keys()
    moved = max(float((one[k] - before[k]).abs().max()) for k in one)
    apart = max(float((one[k] - two[k]).abs().max()) for k in one)
    assert moved > 1e-4  # the step changed the adapter ...
    assert apart < 1e-5  # ... the same way in both
    for key in ("loss", "grad_norm", "trained_tokens", "entropy", "ratio_mean"):
        assert dp_metrics[key] == pytest.approx(one_metrics[key], rel=1e-5, abs=1e-7), key
    assert (tmp_path / "dp" / "optimizer.pt").exists()


def test_a_failure_on_one_rank_stops_every_rank_with_nothing_written(tiny_llama, tmp_path):
    vocab = _vocab(tiny_llama)
    micro_batches = _micro_batches(vocab, bad_token=vocab + 5)  # outside the embedding: in one rank's share only
    owners = [r for r in (0, 1) for mb in shard(micro_batches, r, 2) if int(mb.input_ids_BT.max()) >= vocab]
    assert len(owners) == 1
    with pytest.raises(TrajectoryError, match="outside the model's embedding") as caught:  # the step's own error type
        train_step_data_parallel(tiny_llama, micro_batches, CONFIG, tmp_path / "dp", workers=2, lora=LORA, timeout=600)
    assert ("data-parallel rank 1" in str(caught.value)) == (owners == [1])  # rank 0 raised rank 1's error too
    assert not (tmp_path / "dp").exists()


def test_shards_cover_every_micro_batch_once_and_balance_tokens():
    micro_batches = _micro_batches(4096)
    shares = [shard(micro_batches, r, 3) for r in range(3)]
    assert sorted(id(mb) for share in shares for mb in share) == sorted(id(mb) for mb in micro_batches)
    loads = [sum(mb.num_tokens for mb in share) for share in shares]
    assert max(loads) - min(loads) <= max(mb.num_tokens for mb in micro_batches)


# -- ranks kept for the run ------------------------------------------------------------------
def _children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def _reaped_cpu_seconds() -> float:
    """CPU time of this process's children that have ended and been waited for (grows when a step runs a process)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _gone(pids) -> bool:
    return not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)


def test_ranks_start_once_load_the_model_once_and_step_as_one_process(tiny_llama, tmp_path):
    start = _start_adapter(tiny_llama, tmp_path / "0000")
    micro_batches = _micro_batches(_vocab(tiny_llama))
    single = LoRATrainer(tiny_llama, lora=LORA, adapter_path=start, device="cpu")
    expected = [single.step(micro_batches, CONFIG) for _ in range(3)]
    single.save(tmp_path / "single", step=3)
    del single
    trainer = PersistentLoRATrainer(tiny_llama, workers=2, lora=LORA, adapter_path=start, device="cpu")
    ranks = _children()
    got = []
    for step in range(3):
        children, reaped = _children(), _reaped_cpu_seconds()
        got.append(trainer.step(micro_batches, CONFIG))
        assert _reaped_cpu_seconds() == reaped, f"step {step + 1} ran a process to its end"
        assert _children() == children == ranks, f"step {step + 1} started or lost a process"
        stats = trainer.rank_stats()
        assert {s["pid"] for s in stats} == ranks and len(ranks) == 2  # the ranks are this process's two children
        assert [s["model_loads"] for s in stats] == [1, 1] and [s["steps"] for s in stats] == [step + 1] * 2
    trainer.save(tmp_path / "dp", step=3)
    for one, two in zip(expected, got):
        assert two["data_parallel_workers"] == 2.0
        for key in ("loss", "grad_norm", "trained_tokens", "entropy", "ratio_mean"):
            assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    before, one, two = _weights(start), _weights(tmp_path / "single"), _weights(tmp_path / "dp")
    assert one.keys() == two.keys() == before.keys()
    assert max(float((one[k] - before[k]).abs().max()) for k in one) > 1e-4  # three steps moved the adapter ...
    assert max(float((one[k] - two[k]).abs().max()) for k in one) < 1e-5  # ... the same way in both
    assert sorted(p.name for p in (tmp_path / "dp").iterdir()) == sorted(p.name for p in (tmp_path / "single").iterdir())
    del trainer  # dropped without close() (LocalBackend drops a trainer after a failed step): its ranks stop
    gc.collect()
    assert _gone(ranks) and not _children()


def test_a_rank_that_dies_is_an_infrastructure_error_and_the_other_rank_is_stopped(tiny_llama, tmp_path):
    trainer = PersistentLoRATrainer(tiny_llama, workers=2, lora=LORA, device="cpu", step_timeout=600)
    pids = [s["pid"] for s in trainer.rank_stats()]
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(InfrastructureError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        trainer.step(_micro_batches(_vocab(tiny_llama)), CONFIG)
    assert _gone(pids) and not _children()  # rank 0 was waiting for rank 1 in a collective: stopped, not left
    with pytest.raises(InfrastructureError, match="stopped after an earlier failure"):
        trainer.save(tmp_path / "x", step=1)
    trainer.close()  # a second close is harmless


def _groups(vocab: int, seed: int) -> list:
    """Two groups of three single-turn trajectories with made-up token ids and sampler logprobs."""
    generator = torch.Generator().manual_seed(seed)

    def trajectory(g: int, i: int) -> tracerl.Trajectory:
        prompt = torch.randint(3, vocab, (5 + g,), generator=generator).tolist()
        completion = torch.randint(3, vocab, (3 + i,), generator=generator).tolist()
        logprobs = (-torch.rand(len(completion), generator=generator) * 3).tolist()
        choice = tracerl.Choice(message={"role": "assistant", "content": f"w{i}"}, token_ids=completion,
                                prompt_token_ids=prompt, logprobs=logprobs)
        return tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": "w1"}, choice], reward=float(i))

    return [tracerl.TrajectoryGroup(trajectory(g, i) for i in range(3)) for g in range(2)]


async def test_local_backend_keeps_its_ranks_resumes_and_trains_as_one_process(tiny_llama, tmp_path):
    """Two ranks recomputing their activations (``gradient_checkpointing=True``) train what one process trains
    without: started once, kept across steps and a resume, no model in the parent."""
    from transformers import PreTrainedModel

    vocab, lora = _vocab(tiny_llama), {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    steps = [_groups(vocab, seed) for seed in range(3)]
    kwargs = dict(learning_rate=1e-3, max_mismatch_kl=None)

    def models_here() -> int:
        return sum(issubclass(type(o), PreTrainedModel) for o in gc.get_objects())

    def model(root: Path) -> tracerl.TrainableModel:
        return tracerl.TrainableModel("dp", "p", base_model=str(tiny_llama), base_path=root, lora_config=lora)

    gc.collect()
    held = models_here()
    dp = tracerl.LocalBackend(inference=None, train_workers=2, micro_batch_tokens=16, gradient_checkpointing=True)
    dp_model = model(tmp_path / "dp")
    await dp_model.register(dp)  # a new run: the ranks start, rank 0 writes checkpoint 0
    ranks = _children()
    assert [s["checkpointing"] for s in dp._models["dp"].trainer.rank_stats()] == [True, True]  # recomputed on every rank
    one_root = tmp_path / "one" / "p" / "models" / "dp"
    shutil.copytree(tmp_path / "dp" / "p" / "models" / "dp", one_root, ignore=shutil.ignore_patterns("run.lock"))
    dp_metrics = []
    try:
        for groups in steps[:2]:
            dp_metrics.append((await dp.train(dp_model, groups, **kwargs)).metrics)
            assert _children() == ranks and len(ranks) == 2  # the same two processes at every step
        gc.collect()
        assert models_here() == held  # the parent loaded no model of its own
    finally:
        await dp.close()
    assert _gone(ranks) and not _children()  # close() stopped them
    resumed = tracerl.LocalBackend(inference=None, train_workers=2, micro_batch_tokens=16)
    again = model(tmp_path / "dp")
    await again.register(resumed)
    try:
        assert await resumed.get_step(again) == 2
        dp_metrics.append((await resumed.train(again, steps[2], **kwargs)).metrics)
    finally:
        await resumed.close()
    single = tracerl.LocalBackend(inference=None, micro_batch_tokens=16)
    alone = model(tmp_path / "one")
    await alone.register(single)
    try:
        one_metrics = [(await single.train(alone, groups, **kwargs)).metrics for groups in steps]
    finally:
        await single.close()
    for one, two in zip(one_metrics, dp_metrics):
        assert one["num_micro_batches"] >= 2 and two["data_parallel_workers"] == 2
        for key in ("loss", "grad_norm", "trained_tokens"):
            assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    one_last, two_last = (_weights(root / "p" / "models" / "dp" / "checkpoints" / "0003") for root in (tmp_path / "one", tmp_path / "dp"))
    assert max(float((one_last[k] - two_last[k]).abs().max()) for k in one_last) < 1e-5


def test_an_update_through_the_parents_copy_reaches_the_ranks_before_their_next_step(tiny_llama, tmp_path):
    """SFT (and merged serving) use a copy the parent loads on the CPU when asked: its update is given
    back to the ranks before their next step, and after the step the copy holds the ranks' adapter."""
    from peft import get_peft_model_state_dict

    start = _start_adapter(tiny_llama, tmp_path / "0000")
    micro_batches = _micro_batches(_vocab(tiny_llama))

    def sft_like(trainer) -> float:  # tracerl.train.sft's path: forwards through the trainer, then apply_update
        def accumulate() -> float:
            for mb in micro_batches:
                trainer._check_vocabulary(mb)
                logprobs, _ = trainer.forward_token_logprobs(mb)
                (-(logprobs * mb.weights_N).sum() / 50).backward()
            return 0.0

        return trainer.apply_update(accumulate, learning_rate=1e-2, max_grad_norm=1.0)[1]

    single = LoRATrainer(tiny_llama, lora=LORA, adapter_path=start, device="cpu")
    one_norm, one = sft_like(single), single.step(micro_batches, CONFIG)
    single.save(tmp_path / "single", step=2)
    del single
    trainer = PersistentLoRATrainer(tiny_llama, workers=2, lora=LORA, adapter_path=start, device="cpu")
    try:
        two_norm, two = sft_like(trainer), trainer.step(micro_batches, CONFIG)
        trainer.save(tmp_path / "dp", step=2)
        copy = {k: v.detach() for k, v in get_peft_model_state_dict(trainer.model).items()}
    finally:
        trainer.close()
    assert two_norm == pytest.approx(one_norm, rel=1e-5)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)  # the ranks stepped from the updated adapter
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    alone, ranks = _weights(tmp_path / "single"), _weights(tmp_path / "dp")
    assert max(float((alone[k] - ranks[k]).abs().max()) for k in alone) < 1e-5
    assert max(float((copy[k] - ranks[k]).abs().max()) for k in ranks) == 0.0  # the copy took the ranks' step
