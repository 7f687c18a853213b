"""The merged policy (base + LoRA delta as one model) computes what the peft model computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tracerl.train.merged_weights import base_weight_names, write_merged_model


@pytest.fixture
def tiny(tmp_path: Path):
    """A 2-layer Llama with tied embeddings saved as safetensors, and a LoRA on all 7 projections with random B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    base_path = tmp_path / "base"
    AutoModelForCausalLM.from_config(config).save_pretrained(base_path)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=modules, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    return base_path, peft_model.eval()


def test_merged_model_matches_the_adapter_and_leaves_the_trainer_untouched(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    base_path, peft_model = tiny
    before = {k: v.clone() for k, v in peft_model.state_dict().items()}
    target = write_merged_model(peft_model, base_path, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        with peft_model.disable_adapter():
            base_logits = peft_model(input_ids=ids).logits
    assert (expected - base_logits).abs().max() > 1e-2, "the adapter must matter for this test to mean anything"
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    after = peft_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "the trainer's weights changed"
    assert sorted(base_weight_names(target)) == sorted(base_weight_names(base_path))
