"""The merge (``serve_merged``) and ``tracerl export`` stream a sharded base checkpoint: bounded memory,
the base's own layout and dtype, and module names resolved on the model as transformers loads it
(fused MoE experts included)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tracerl.train.merged_weights import write_merged_model

HERE = Path(__file__).resolve().parent
MiB = 1024 * 1024
INDEX_FILE = "model.safetensors.index.json"


def base_layout(folder: Path) -> dict[str, list[str]]:
    """A safetensors model folder's files → the tensor names each holds (written here, not tracerl's, to check tracerl's)."""
    from safetensors import safe_open

    if (folder / INDEX_FILE).exists():
        layout: dict[str, list[str]] = {}
        for name, file in json.loads((folder / INDEX_FILE).read_text())["weight_map"].items():
            layout.setdefault(file, []).append(name)
        return {file: sorted(names) for file, names in sorted(layout.items())}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {"model.safetensors": sorted(f.keys())}


def _randomize_b(peft_model, std: float) -> None:
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, std)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for file, names in base_layout(folder).items():
        with safe_open(str(folder / file), "pt") as f:
            out.update({name: f.get_tensor(name) for name in names})
    return out


# -- MoE: transformers 5 fuses the experts on load; the merge must land on the per-expert checkpoint keys ---
@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A random Qwen3-MoE written in 3 shards (per-expert keys) and a LoRA on all 7 projections with random B:
    peft adapts the fused ``experts.gate_up_proj`` / ``experts.down_proj`` parameters (``target_parameters``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=97, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                            tie_word_embeddings=False)  # fmt: skip
    folder = tmp_path_factory.mktemp("moe")
    base_path = folder / "base"
    AutoModelForCausalLM.from_config(config).save_pretrained(base_path, max_shard_size="40KB")
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=modules, task_type="CAUSAL_LM"))
    _randomize_b(peft_model, 0.5)
    adapter = folder / "adapter"
    peft_model.save_pretrained(adapter)
    return base_path, peft_model.eval(), adapter


def test_moe_merge_finds_the_fused_experts_and_keeps_the_base_layout(moe, tmp_path):
    from transformers import AutoModelForCausalLM

    from tracerl.train.export import write_hf_folder

    base_path, peft_model, adapter = moe
    layout = base_layout(base_path)
    assert len(layout) >= 3 and any(".experts.0.gate_proj.weight" in n for names in layout.values() for n in names)
    assert peft_model.peft_config["default"].target_parameters, "peft must adapt the fused experts for this test to mean anything"

    live = write_merged_model(peft_model, base_path, tmp_path / "live")  # the serve_merged path: the trainer's model
    exported = write_hf_folder(adapter, base_path, tmp_path / "exported")  # tracerl export: meta model + the adapter's file
    for folder in (live, exported):
        assert base_layout(folder) == layout and (folder / INDEX_FILE).exists()
    merged, was = _tensors(live), _tensors(base_path)
    assert all(torch.equal(merged[k], v) for k, v in _tensors(exported).items()), "export and serve_merged write the same merge"
    moved = {k for k in was if not torch.equal(merged[k], was[k])}
    assert any(".experts.3.up_proj." in k for k in moved) and any(".experts.0.down_proj." in k for k in moved)
    assert moved == {k for k in was if k.split(".")[-2] in {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}}

    model = AutoModelForCausalLM.from_pretrained(live, dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
        with peft_model.disable_adapter():
            base_logits = peft_model(input_ids=ids).logits
        got = model(input_ids=ids).logits
    assert (expected - base_logits).abs().max() > 1e-2, "the adapter must matter for this test to mean anything"
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# -- a sharded bf16 base: peak memory and the export round trip ------------------------------------
PROMPTS = [
    [{"role": "user", "content": "What is the capital of Peru?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three colors."}],
]
TOKENS = 12


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, smol_path):
    """A random bf16 Llama (SmolLM2's tokenizer, 126M parameters) written in >= 4 shards of ~75 MB, a run
    directory whose checkpoint 1 is a LoRA with random B, and the greedy tokens of base + LoRA (peft, fp32)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    folder = tmp_path_factory.mktemp("sharded")
    base_path = folder / "base"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
                         num_key_value_heads=4, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         max_position_embeddings=2048)  # fmt: skip
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(base_path, max_shard_size="80MB")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smol_path / name).exists():
            shutil.copy2(smol_path / name, base_path / name)

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=modules, task_type="CAUSAL_LM"))
    _randomize_b(peft_model, 0.02)
    runs = folder / "runs"
    run = runs / "tests" / "models" / "streamed"
    peft_model.save_pretrained(run / "checkpoints" / "0001")
    (run / "model.json").write_text(json.dumps({"name": "streamed", "project": "tests", "base_model": str(base_path)}))

    tokenizer = AutoTokenizer.from_pretrained(base_path)
    served = []
    peft_model.eval()
    with torch.no_grad():
        for messages in PROMPTS:
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
            ids = torch.tensor([prompt])
            out = peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS, min_new_tokens=TOKENS,
                                      do_sample=False, pad_token_id=tokenizer.eos_token_id)  # fmt: skip
            tokens = out[0, len(prompt) :].tolist()
            with peft_model.disable_adapter():
                base_predicted = _greedy_under_teacher_forcing(peft_model, prompt, tokens)
            assert base_predicted != tokens, "the adapter must change the greedy tokens for this test to mean anything"
            served.append((prompt, tokens))
    del peft_model, base
    return base_path, runs, served


def _greedy_under_teacher_forcing(model, prompt: list[int], tokens: list[int]) -> list[int]:
    """What greedy decoding picks after ``prompt`` + each prefix of ``tokens`` (one forward): equal to ``tokens`` iff
    greedy decoding reproduces them."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].argmax(-1).tolist()


@pytest.mark.skipif(
    not __import__("tracerl.train.export", fromlist=["converter_script"]).converter_script(),
    reason="llama.cpp's GGUF converter is not installed (`make install-gguf-converter`)",
)
def test_export_of_a_sharded_model_streams_in_bounded_memory_and_decodes_what_was_served(sharded, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    base_path, runs, served = sharded
    shard_sizes = [(base_path / file).stat().st_size for file in base_layout(base_path)]
    assert len(shard_sizes) >= 4 and max(shard_sizes) > 64 * MiB, shard_sizes
    out = tmp_path / "out"
    child = subprocess.run(
        [sys.executable, str(HERE / "merge_memory_child.py"), str(runs), "tests", "streamed", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    measured = json.loads(child.stdout.strip().splitlines()[-1])
    bound = 2 * max(shard_sizes) + 256 * MiB
    print(f"peak RssAnon above baseline {measured['peak_above_baseline'] / MiB:.0f} MiB (baseline {measured['baseline'] / MiB:.0f} MiB,"
          f" bound {bound / MiB:.0f} MiB, shards {[round(s / MiB) for s in shard_sizes]} MiB), export {measured['seconds']:.1f} s")
    assert measured["peak_above_baseline"] <= bound, measured

    hf, gguf = Path(measured["hf"]), Path(measured["gguf"])
    assert base_layout(hf) == base_layout(base_path) and (hf / INDEX_FILE).exists()
    # the base's dtype, and each adapted weight is (W + scaling * B @ A in fp32) cast back, from the adapter's own factors
    adapter = runs / "tests" / "models" / "streamed" / "checkpoints" / "0001"
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        lora_a = f.get_tensor("base_model.model.model.layers.3.mlp.down_proj.lora_A.weight").float()
        lora_b = f.get_tensor("base_model.model.model.layers.3.mlp.down_proj.lora_B.weight").float()
    key = "model.layers.3.mlp.down_proj.weight"
    file = json.loads((base_path / INDEX_FILE).read_text())["weight_map"][key]
    with safe_open(str(base_path / file), "pt") as was, safe_open(str(hf / file), "pt") as got:
        assert {got.get_tensor(k).dtype for k in got.keys()} == {torch.bfloat16}
        expected = (was.get_tensor(key).float() + 2.0 * lora_b @ lora_a).to(torch.bfloat16)
        assert torch.equal(got.get_tensor(key), expected)

    folder = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    for prompt, tokens in served:
        assert _greedy_under_teacher_forcing(folder, prompt, tokens) == tokens
    del folder
    from_gguf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    for prompt, tokens in served:
        assert _greedy_under_teacher_forcing(from_gguf, prompt, tokens) == tokens
