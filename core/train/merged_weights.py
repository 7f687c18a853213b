"""The trainer's policy as one full model: base weights with the LoRA delta folded in.

Why: on CPU, vLLM runs every LoRA request eagerly (its CPU platform turns torch.compile off
whenever ``--enable-lora`` is set) and its punica ops gather a per-token copy of each LoRA
weight, so a served adapter decodes far slower than the base model (``bench/serving_speed.py``).
Serving the *merged* policy instead (a plain model, compiled) and reloading its weights in
place after each step keeps rollouts at base-model speed and on-policy.

The trainer's own base weights are never touched (peft's in-place ``merge_adapter`` then
``unmerge_adapter`` would leave rounding error in them): each merged tensor is a new
``W + scale · B @ A`` computed from the live peft model, written under the checkpoint names
of the base model's own safetensors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

WEIGHTS_FILE = "model.safetensors"
_COPIED = ("config.json", "generation_config.json")


def base_weight_names(model_path: Path) -> list[str]:
    """The tensor names of the base model's safetensors checkpoint (what vLLM's loader expects)."""
    from safetensors import safe_open

    index = model_path / "model.safetensors.index.json"
    if index.exists():
        return sorted(json.loads(index.read_text())["weight_map"])
    with safe_open(str(model_path / WEIGHTS_FILE), framework="pt") as f:
        return list(f.keys())


@torch.no_grad()
def merged_state_dict(peft_model: Any, names: list[str]) -> dict[str, torch.Tensor]:
    """``names`` → fp32 CPU tensors of the policy, with every active LoRA delta added to its base weight."""
    from peft.tuners.lora import LoraLayer

    causal_lm = peft_model.get_base_model()
    adapter = peft_model.active_adapter
    out: dict[str, torch.Tensor] = {}
    for name in names:
        module_name, _, attribute = name.rpartition(".")
        module = causal_lm.get_submodule(module_name)
        if isinstance(module, LoraLayer) and attribute == "weight":
            base = module.get_base_layer().weight
            tensor = base + module.get_delta_weight(adapter).to(base.dtype)
        else:
            tensor = causal_lm.get_parameter(name) if attribute in dict(module.named_parameters(recurse=False)) else causal_lm.get_buffer(name)
        out[name] = tensor.detach().to("cpu", torch.float32).contiguous()
    return out


def write_merged_model(peft_model: Any, model_path: Path, target: Path) -> Path:
    """Write the merged policy into ``target`` (safetensors + the base's config); return ``target``."""
    from safetensors.torch import save_file

    target.mkdir(parents=True, exist_ok=True)
    tensors = merged_state_dict(peft_model, base_weight_names(model_path))
    shared = _tied_names(tensors)
    save_file({k: v for k, v in tensors.items() if k not in shared}, str(target / WEIGHTS_FILE), metadata={"format": "pt"})
    for name in _COPIED:
        if (model_path / name).exists():
            shutil.copy2(model_path / name, target / name)
    return target


def _tied_names(tensors: dict[str, torch.Tensor]) -> set[str]:
    """Names whose tensor shares storage with an earlier one (a tied lm_head): safetensors refuses duplicates."""
    seen: dict[int, str] = {}
    tied = set()
    for name, tensor in tensors.items():
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in seen:
            tied.add(name)
        else:
            seen[pointer] = name
    return tied
