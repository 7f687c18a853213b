"""The memory plan (``tracerl plan``, :mod:`tracerl.train.memory_plan`): shapes counted without weights, the plan
against a measured step, the one setting to change, the check at ``register``, and vLLM's LoRA limits derived
from the model."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tracerl
from tracerl.cli import app
from tracerl.errors import ConfigError
from tracerl.inference.vllm_server import VLLM_LORA_RANKS, VLLMServer, runtime_dir, vllm_lora_rank
from tracerl.train.local_backend import LocalBackend
from tracerl.train.memory_plan import BUILTIN_SHAPES, PlanDoesNotFitError, PlanSettings, load_shape, plan

ROOT = Path(__file__).resolve().parent.parent
PUBLISHED_BILLIONS = {  # the model cards' parameter counts
    "Qwen3-8B": 8.19, "Qwen3-32B": 32.8, "Qwen3-30B-A3B": 30.5, "Llama-3.1-8B": 8.03, "Llama-3.1-70B": 70.6, "gpt-oss-20b": 20.9,
}  # fmt: skip


def test_every_builtin_shape_is_counted_on_the_meta_device_and_printed():
    """``tracerl plan all`` prints each built-in shape's table and verdict; the parameters are the published ones."""
    assert set(BUILTIN_SHAPES) == set(PUBLISHED_BILLIONS)
    for name, billions in PUBLISHED_BILLIONS.items():
        assert load_shape(name).parameters / 1e9 == pytest.approx(billions, rel=0.01), name
    result = CliRunner().invoke(app, ["plan", "all"])
    assert result.exit_code == 1, result.output  # some shapes do not fit one 80 GiB GPU beside vLLM's default 0.9
    for name in BUILTIN_SHAPES:
        assert f"{name}:" in result.output
    fitting, not_fitting = len(re.findall(r"^fits$", result.output, flags=re.M)), result.output.count("does not fit: ")
    assert fitting + not_fitting == len(BUILTIN_SHAPES) and not_fitting >= 1
    assert " ".join(result.output.split()).count(". Change: ") == not_fitting
    for part in ("base weights", "AdamW state", "activations", "logprob chunks", "vLLM KV cache", "sleep level 1 frees"):
        assert part in result.output
    shared = CliRunner().invoke(app, ["plan", "Qwen3-8B", "--gpu-memory-utilization", "0.5", "--gradient-checkpointing"])
    assert shared.exit_code == 0 and shared.output.rstrip().endswith("fits"), shared.output


def test_a_plan_that_cannot_fit_names_the_one_setting_that_makes_it_fit():
    """Qwen3-8B on one 80 GiB GPU with vLLM's default share: the trainer beside an awake vLLM does not fit; the
    suggested change is one setting, and the plan with it fits.  A 70B model on a 24 GiB GPU has no such setting."""
    shape = load_shape("Qwen3-8B")
    result = plan(shape, PlanSettings(gpu_memory_bytes=80 * 2**30))
    assert not result.fits and result.suggestion.startswith("set ")
    setting = re.fullmatch(r"set (\w+)=(\S+)", result.suggestion)
    assert setting, result.suggestion
    name, value = setting.groups()
    changed = PlanSettings(gpu_memory_bytes=80 * 2**30, **{name: type(getattr(PlanSettings(), name))(value)})
    assert plan(shape, changed).fits
    hopeless = plan("Llama-3.1-70B", PlanSettings(gpu_memory_bytes=24 * 2**30))
    assert not hopeless.fits and "no single setting" in hopeless.suggestion


def test_activations_grow_with_tokens_and_checkpointing_keeps_only_layer_inputs():
    shape = load_shape("Llama-3.1-8B")
    parts = {
        (tokens, ckpt): {p.name: p.bytes for p in plan(shape, PlanSettings(seq_len=tokens, micro_batch_tokens=tokens, gradient_checkpointing=ckpt)).parts}
        for tokens in (2048, 8192) for ckpt in (False, True)
    }  # fmt: skip
    assert parts[8192, False]["activations"] == pytest.approx(4 * parts[2048, False]["activations"], rel=0.01)
    # packed attention keeps block tables and one query chunk's scores: at most linear in T, never T² per layer
    assert parts[8192, False]["packed attention"] <= 4 * parts[2048, False]["packed attention"]
    assert parts[8192, False]["packed attention"] < 0.1 * 32 * 8192**2 * 2  # a dense bf16 mask kept per layer
    assert parts[8192, True]["activations"] < parts[8192, False]["activations"] / 8


def test_a_small_step_measured_against_its_plan():
    """``bench/plan_check.py``'s smallest real case (the make target runs 3 sizes up to 1.1B x 3 lengths): a
    random 8-layer model's step at 2,048 tokens, whose activations dominate the step, is within
    max(15%, 150 MB) of the plan."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "plan_check.py"), "--sizes", "narrow", "--seqs", "2048"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert " ok " in out.stdout


def tiny_model(folder: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=512, max_position_embeddings=2048, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


async def test_register_refuses_a_run_that_cannot_fit_before_loading_anything(tmp_path, monkeypatch):
    """A row of 4,194,304 tokens keeps ~38 GB of activations even on a 2-layer model: beyond this machine; register
    says so with the plan and the setting to change (a shorter row), and never loads the trainer."""

    def never(self, state):
        raise AssertionError("the trainer was loaded")

    monkeypatch.setattr(LocalBackend, "_trainer", never)
    model_path = tiny_model(tmp_path / "tiny")
    backend = LocalBackend(tmp_path / "runs", inference=None, device="cpu", max_seq_len=2**22, micro_batch_tokens=2048)
    with pytest.raises(PlanDoesNotFitError) as caught:
        await tracerl.TrainableModel("huge", "tests", str(model_path)).register(backend)
    message = str(caught.value)
    assert "cannot train here" in message and "Change: set max_seq_len=" in message and "activations" in message
    assert isinstance(caught.value, ConfigError) and isinstance(caught.value, MemoryError)
    await backend.close()


def test_vllm_lora_ranks_round_up_or_are_refused():
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 12, 16, 32, 33, 300, 512)] == [1, 8, 8, 16, 16, 32, 64, 320, 512]
    with pytest.raises(ConfigError, match=r"up to 512 .*rank 600 cannot be served"):
        vllm_lora_rank(600)


def test_the_accepted_ranks_are_the_installed_vllms():
    """vLLM's ``MaxLoRARanks`` (a pydantic Literal: another value stops its start-up), read from its source."""
    sources = sorted(runtime_dir().glob("lib/python3*/site-packages/vllm/config/lora.py"))
    if not sources:
        pytest.skip("the vLLM runtime is not installed (make install-vllm)")
    literal = re.search(r"MaxLoRARanks = Literal\[([\d,\s]+)\]", sources[0].read_text())
    assert literal and tuple(int(v) for v in literal.group(1).split(",")) == VLLM_LORA_RANKS


def test_local_backend_starts_vllm_with_the_models_rank_and_refuses_one_vllm_cannot_serve(tmp_path):
    from tracerl.train.local_backend import _Registered

    backend = LocalBackend(tmp_path, inference="vllm", device="cpu")
    for rank, expected in ((32, "32"), (12, "16"), (8, "8")):
        model = tracerl.TrainableModel(f"m{rank}", "tests", "smollm2-135m", lora_config={"r": rank})
        state = _Registered(model=model, run_dir=model.run_dir, model_path=tmp_path, lock=None)  # type: ignore[arg-type]
        args = VLLMServer(tmp_path, python="/py", **{k: v for k, v in backend._server_options(state, lora=True).items()
                                                      if k not in ("tool_call_parser", "reasoning_parser")}).lora_args()  # fmt: skip
        assert args[args.index("--max-lora-rank") + 1] == expected and args[args.index("--max-loras") + 1] == "3"
    model = tracerl.TrainableModel("wide", "tests", "smollm2-135m", lora_config={"r": 600})
    state = _Registered(model=model, run_dir=model.run_dir, model_path=tmp_path, lock=None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="rank 600 cannot be served"):
        backend._server_options(state, lora=True)
    explicit = LocalBackend(tmp_path, inference="vllm", device="cpu", server_options={"max_lora_rank": 64, "max_loras": 6})
    model = tracerl.TrainableModel("eight", "tests", "smollm2-135m", lora_config={"r": 8})
    state = _Registered(model=model, run_dir=model.run_dir, model_path=tmp_path, lock=None)  # type: ignore[arg-type]
    assert {k: v for k, v in explicit._server_options(state, lora=True).items() if k.startswith("max_")} == {"max_lora_rank": 64, "max_loras": 6}
    for staleness, slots in ((0, 2), (3, 5)):  # a PipelineTrainer created before register announces its staleness
        piped = LocalBackend(tmp_path, inference="vllm", device="cpu")
        model = tracerl.TrainableModel(f"piped{staleness}", "tests", "smollm2-135m", lora_config={"r": 8})
        tracerl.PipelineTrainer(model, piped, _no_rollout, [], max_steps=1, max_staleness=staleness)
        state = _Registered(model=model, run_dir=model.run_dir, model_path=tmp_path, lock=None)  # type: ignore[arg-type]
        assert piped._server_options(state, lora=True)["max_loras"] == slots
        assert piped._plan_settings(state).max_loras == slots  # the memory plan counts the same slots


async def _no_rollout(model, scenario, config):
    raise AssertionError("no rollout runs here")


@pytest.mark.real_model
async def test_a_rank_32_lora_hot_loads_into_vllm_through_tracerl_serve(tmp_path, caplog):
    """A client's rank-32 LoRA, registered through ``tracerl serve`` (its app, a real ``LocalBackend``) by a
    ``RemoteBackend`` whose ``PipelineTrainer`` was created first: the server's vLLM starts with the rank and a slot
    per policy served at once, checkpoint 0 hot-loads and answers (started with vLLM's old fixed
    ``max_lora_rank=16``, vLLM refuses the adapter's load).  A staler pipeline after vLLM started is logged."""
    from tracerl.inference.vllm_server import vllm_python
    from tracerl.net.http_server import BackgroundUvicorn
    from tracerl.serve.server import create_app

    if vllm_python() is None:
        pytest.skip("the vLLM runtime is not installed (make install-vllm)")
    local = LocalBackend(tmp_path / "serve", inference="vllm", device="cpu", server_options={"kv_cache_memory_bytes": 256 << 20})
    http = BackgroundUvicorn(create_app(local, token="t0k"), name="tracerl-serve-rank")
    url = f"http://127.0.0.1:{http.start()}"
    remote = tracerl.RemoteBackend(url, token="t0k")
    model = tracerl.TrainableModel("wide", "tests", "smollm2-135m", lora_config={"r": 32, "alpha": 64})
    tracerl.PipelineTrainer(model, remote, _no_rollout, [], max_steps=1, max_staleness=2)  # created before register
    try:
        await model.register(remote)
        server = local._models["wide"].server
        assert server.max_lora_rank == 32 and server.max_loras == 4  # the newest, the previous, one per step of staleness
        reply = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(0), messages=[{"role": "user", "content": "Say hi"}], max_tokens=4, temperature=0
        )
        assert reply.choices[0].message.content is not None
        with caplog.at_level(logging.WARNING, logger="tracerl"):  # a staler pipeline after vLLM started: told how to fit
            tracerl.PipelineTrainer(local._models["wide"].model, local, _no_rollout, [], max_steps=1, max_staleness=3)
        assert "max_loras=4" in caplog.text and "{'max_loras': 5}" in caplog.text
    finally:
        await remote.close()
        http.stop()
        await local.close()


async def test_register_turns_on_gradient_checkpointing_when_only_that_fits(tmp_path, monkeypatch):
    """``gradient_checkpointing="auto"`` (the default): with 6 GiB of memory, an 8-layer model's 262,144-token row keeps
    ~9 GB of activations without checkpointing and ~2 GB with it: register turns it on (and the trainer gets it);
    set to False explicitly, the same run is refused."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import tracerl.train.memory_plan as memory_plan

    monkeypatch.setattr(memory_plan, "memory_available", lambda: (6 * 2**30, 6 * 2**30))
    chosen = []

    def loaded(self, state):
        chosen.append(state.gradient_checkpointing)
        raise RuntimeError("stop before loading")

    monkeypatch.setattr(LocalBackend, "_trainer", loaded)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=512, max_position_embeddings=2048, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "deep")
    for setting in ("auto", False):
        backend = LocalBackend(tmp_path / f"runs-{setting}", inference=None, device="cpu", max_seq_len=2**18, micro_batch_tokens=2048,
                               gradient_checkpointing=setting)  # fmt: skip
        model = tracerl.TrainableModel("deep", "tests", str(tmp_path / "deep"))
        if setting == "auto":
            with pytest.raises(RuntimeError, match="stop before loading"):
                await model.register(backend)
            assert chosen == [True]
        else:
            with pytest.raises(PlanDoesNotFitError, match="gradient_checkpointing=True"):
                await model.register(backend)
        await backend.close()
