"""The trainer's policy as one full model: base weights with the LoRA delta folded in, streamed to disk.

Why: on CPU, vLLM runs every LoRA request eagerly (its CPU platform turns torch.compile off
whenever ``--enable-lora`` is set) and its punica ops gather a per-token copy of each LoRA
weight, so a served adapter decodes far slower than the base model (``bench/serving_speed.py``).
Serving the *merged* policy instead (a plain model, compiled) and reloading its weights in
place after each step keeps rollouts at base-model speed and on-policy.  ``tracerl export``
writes the same merge (:mod:`tracerl.train.export`).

How, so that an 8B–32B model merges in little memory:

- the output has the base checkpoint's own layout: the same safetensors files (shards and
  ``model.safetensors.index.json`` when the base has them), tensor names, shapes and dtypes;
- base tensors are read one at a time from the base's files (``safetensors.safe_open``, lazily),
  never from the model in memory; each file is written tensor by tensor (the safetensors header
  is known from the base's before any data), so the merge holds about one tensor, never a shard
  or the model;
- each adapted tensor is ``W + scaling · B @ A``: the delta computed in fp32 from the adapter's
  own A and B, added to ``W`` in fp32, then cast to ``W``'s dtype; the trainer's weights are
  never touched (peft's in-place ``merge_adapter`` then ``unmerge_adapter`` would leave rounding
  error in them);
- a LoRA module is found on the model *as loaded* and its parameter's checkpoint name(s) are
  computed by transformers' own reverse of its load-time conversion
  (``transformers.core_model_loading.revert_weight_conversion``, what ``save_pretrained`` uses),
  so renamed keys and fused MoE experts (transformers 5 loads a Qwen3-MoE's per-expert
  ``experts.{e}.gate_proj`` / ``up_proj`` as one ``experts.gate_up_proj`` that peft adapts with
  ``target_parameters``) land on the checkpoint's tensors.

The peft model may hold real weights (the trainer) or sit on the meta device with the adapter's
factors passed as ``adapter_weights`` (``tracerl export``: only the adapter is loaded).
"""

from __future__ import annotations

import json
import shutil
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ..errors import ConfigError

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_COPIED = ("config.json", "generation_config.json")
_PEFT_PREFIX = "base_model.model."
"""What peft puts before the base model's module names in a saved adapter's keys."""


def base_weight_names(model_path: Path) -> list[str]:
    """The tensor names of the base model's safetensors checkpoint (what vLLM's loader expects)."""
    return sorted(name for names in base_layout(model_path).values() for name in names)


def base_layout(model_path: Path) -> dict[str, list[str]]:
    """The base checkpoint's safetensors files (relative names) → the tensor names each holds."""
    index = model_path / INDEX_FILE
    if index.exists():
        layout: dict[str, list[str]] = {}
        for name, file in json.loads(index.read_text())["weight_map"].items():
            layout.setdefault(file, []).append(name)
        return {file: sorted(names) for file, names in sorted(layout.items())}
    from safetensors import safe_open

    if not (model_path / WEIGHTS_FILE).exists():
        raise ConfigError(f"{model_path} has neither {WEIGHTS_FILE} nor {INDEX_FILE}: the merge reads safetensors checkpoints only")
    with safe_open(str(model_path / WEIGHTS_FILE), framework="pt") as f:
        return {WEIGHTS_FILE: sorted(f.keys())}


# -- the LoRA deltas, on the model as loaded -----------------------------------------------------
@dataclass(frozen=True)
class LoraDelta:
    """One adapted parameter of the loaded model and how to compute its delta ``scaling · B @ A``."""

    parameter: str
    """Its name on the loaded model (``model.layers.0.self_attn.q_proj.weight``, ``model.layers.0.mlp.experts.gate_up_proj``)."""
    shape: tuple[int, ...]
    kind: str
    """``linear``, ``embedding`` or ``experts`` (peft's ``ParamWrapper`` on a 2-D or 3-D parameter)."""
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float
    fan_in_fan_out: bool = False
    num_experts: int = 1
    out_first: bool = True
    """For 3-D experts: the parameter is ``(experts, out, in)`` (else ``(experts, in, out)``)."""

    @torch.no_grad()
    def delta(self) -> torch.Tensor:
        """The delta in fp32 (on the factors' device), in the parameter's shape."""
        a, b = self.lora_a.detach().float(), self.lora_b.detach().float()
        if self.kind == "embedding":  # peft: lora_embedding_A is (r, num_embeddings), B is (dim, r)
            delta = (b @ a).T
        elif self.kind == "experts" and self.num_experts > 1:
            a = a.reshape(self.num_experts, -1, a.shape[-1])  # (experts, r, in)
            b = b.reshape(b.shape[0], -1, self.num_experts)  # (out, r, experts)
            delta = torch.einsum("ore,eri->eoi" if self.out_first else "ore,eri->eio", b, a)
        else:
            delta = b @ a
            if self.fan_in_fan_out:
                delta = delta.T
        delta = delta * self.scaling
        if tuple(delta.shape) != self.shape:
            raise ConfigError(f"the LoRA delta of {self.parameter} has shape {tuple(delta.shape)}, its weight {self.shape}")
        return delta.contiguous()


def lora_deltas(peft_model: Any, adapter_weights: Mapping[str, torch.Tensor] | None = None) -> list[LoraDelta]:
    """Every parameter the active adapter of ``peft_model`` adapts, named as on the loaded model.

    ``adapter_weights`` (a saved adapter's state dict, peft's key names) supplies the factors when
    the model's own are not real (a model built on the meta device)."""
    from peft.tuners import lora

    adapter = peft_model.active_adapter
    config = peft_model.peft_config[adapter]
    for field in ("modules_to_save", "trainable_token_indices"):
        if getattr(config, field, None):
            raise ConfigError(f"the adapter sets {field}: merging covers LoRA factors only")
    found: list[LoraDelta] = []
    for module_name, module in peft_model.get_base_model().named_modules():
        if not isinstance(module, lora.LoraLayer) or adapter not in getattr(module, "scaling", {}):
            continue
        if adapter in getattr(module, "lora_variant", {}) or getattr(module, "lora_bias", {}).get(adapter, False):
            raise ConfigError(f"{module_name} uses a LoRA variant (DoRA, ...) or a LoRA bias: merging covers plain B @ A only")
        owner = ".".join(part for part in module_name.split(".") if part != "base_layer")
        if isinstance(module, lora.ParamWrapper):
            parameter, kind = f"{owner}.{module.parameter_name}", "experts"
            shape = tuple(module.get_param().shape)
            factors = ("lora_A", "lora_B")
        elif isinstance(module, lora.Embedding):
            parameter, kind, shape = f"{owner}.weight", "embedding", tuple(module.get_base_layer().weight.shape)
            factors = ("lora_embedding_A", "lora_embedding_B")
        elif isinstance(module, lora.Linear):
            parameter, kind, shape = f"{owner}.weight", "linear", tuple(module.get_base_layer().weight.shape)
            factors = ("lora_A", "lora_B")
        else:
            raise ConfigError(f"{module_name} is a {type(module).__name__} LoRA layer: merging covers Linear, Embedding and parameter (MoE) layers")
        a, b = (_factor(module, module_name, adapter, name, adapter_weights) for name in factors)
        found.append(LoraDelta(
            parameter=parameter, shape=shape, kind=kind, lora_a=a, lora_b=b, scaling=float(module.scaling[adapter]),
            fan_in_fan_out=bool(getattr(module, "fan_in_fan_out", False)), num_experts=int(getattr(module, "num_experts", 1)),
            out_first=len(shape) == 3 and not getattr(module.get_base_layer(), "is_transposed", False),
        ))  # fmt: skip
    return found


def _factor(module: Any, module_name: str, adapter: str, name: str, adapter_weights: Mapping[str, torch.Tensor] | None) -> torch.Tensor:
    if adapter_weights is None:
        holder = getattr(module, name)[adapter]
        return holder.weight if isinstance(holder, torch.nn.Module) else holder
    suffix = "" if name.startswith("lora_embedding") else ".weight"
    key = f"{_PEFT_PREFIX}{module_name}.{name}{suffix}"
    if key not in adapter_weights:
        raise ConfigError(f"the adapter's weights have no {key}: saved for another model or transformers version?")
    return adapter_weights[key]


# -- checkpoint names ----------------------------------------------------------------------------
def checkpoint_targets(causal_lm: Any, deltas: list[LoraDelta], names: set[str]) -> dict[str, tuple[int, str]]:
    """Checkpoint tensor name → (index into ``deltas``, the name transformers' reverse conversion gives it).

    Each delta's parameter is reverted on the meta device (no memory): one checkpoint tensor for a
    renamed or unchanged key, several for a fused one (MoE experts)."""
    from transformers.core_model_loading import revert_weight_conversion

    prefix = getattr(causal_lm, "base_model_prefix", "") or ""
    targets: dict[str, tuple[int, str]] = {}
    for index, delta in enumerate(deltas):
        reverted = revert_weight_conversion(causal_lm, {delta.parameter: torch.empty(delta.shape, device="meta")})
        for key, piece in reverted.items():
            name = _in_checkpoint(key, prefix, names)
            if name is None:
                raise ConfigError(
                    f"the LoRA on {delta.parameter} maps to checkpoint tensor {key}, which the base checkpoint does not hold"
                    + (" (a tied output embedding?)" if "lm_head" in key else "")
                )
            if name in targets:
                raise ConfigError(f"checkpoint tensor {name} is adapted twice ({deltas[targets[name][0]].parameter}, {delta.parameter})")
            targets[name] = (index, key)
    return targets


def _in_checkpoint(key: str, prefix: str, names: set[str]) -> str | None:
    """``key`` as the checkpoint spells it (with or without the base model's prefix, as transformers' loader allows)."""
    for candidate in (key, key.removeprefix(f"{prefix}.") if prefix else key, f"{prefix}.{key}" if prefix else key):
        if candidate in names:
            return candidate
    return None


# -- the merged checkpoint -----------------------------------------------------------------------
def write_merged_model(
    peft_model: Any, model_path: Path, target: Path, *, adapter_weights: Mapping[str, torch.Tensor] | None = None
) -> Path:
    """Write the merged policy into ``target`` (the base's safetensors layout + its config); return ``target``.

    Streams: one base tensor (and one parameter's fp32 delta) in memory at a time.
    ``adapter_weights``: the adapter's state dict when ``peft_model``'s own factors are not real
    (see :func:`lora_deltas`)."""
    from safetensors import safe_open

    layout = base_layout(model_path)
    causal_lm = peft_model.get_base_model()
    deltas = lora_deltas(peft_model, adapter_weights)
    targets = checkpoint_targets(causal_lm, deltas, {name for names in layout.values() for name in names})
    target.mkdir(parents=True, exist_ok=True)
    remaining = Counter(index for index, _ in targets.values())
    cached: tuple[int, dict[str, torch.Tensor]] | None = None
    total = 0
    for file, names in layout.items():
        # a parameter's checkpoint tensors are stored one after another (the data order of a safetensors
        # file is free), so its delta is computed once per file, not once per expert
        names = sorted(names, key=lambda name: targets[name][0] if name in targets else -1)
        with safe_open(str(model_path / file), framework="pt") as base, open(target / file, "wb") as out:
            header = {name: (base.get_slice(name).get_dtype(), list(base.get_slice(name).get_shape())) for name in names}
            sizes = _write_header(out, header, base.metadata())
            total += sum(sizes)
            for name, size in zip(names, sizes, strict=True):
                tensor = base.get_tensor(name)
                if name in targets:
                    index, key = targets[name]
                    if cached is None or cached[0] != index:
                        cached = None  # the previous parameter's pieces go before the next are made
                        cached = (index, _reverted_delta(causal_lm, deltas[index]))
                    piece = cached[1][key]
                    remaining[index] -= 1
                    if not remaining[index]:
                        cached = None
                    if tuple(piece.shape) != tuple(tensor.shape):
                        raise ConfigError(f"the LoRA delta for {name} has shape {tuple(piece.shape)}, the checkpoint's {tuple(tensor.shape)}")
                    tensor = (tensor.float() + piece).to(tensor.dtype)
                _write_data(out, tensor, size, name)
                del tensor
    if (model_path / INDEX_FILE).exists():
        weight_map = {name: file for file, names in layout.items() for name in names}
        index_text = json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
        (target / INDEX_FILE).write_text(index_text + "\n")
    for name in _COPIED:
        if (model_path / name).exists():
            shutil.copy2(model_path / name, target / name)
    return target


def _reverted_delta(causal_lm: Any, delta: LoraDelta) -> dict[str, torch.Tensor]:
    """The delta of one loaded parameter as the checkpoint tensor(s) it came from, fp32 on the CPU."""
    from transformers.core_model_loading import revert_weight_conversion

    pieces = revert_weight_conversion(causal_lm, {delta.parameter: delta.delta()})
    return {key: piece.to("cpu", torch.float32) for key, piece in pieces.items()}  # views of one delta on the CPU


# -- safetensors, written tensor by tensor -------------------------------------------------------
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


def _write_header(out: BinaryIO, header: dict[str, tuple[str, list[int]]], metadata: dict[str, str] | None) -> list[int]:
    """The safetensors header for ``header``'s tensors, stored in its order; return each tensor's byte size.

    The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length,
    the JSON header (padded with spaces to 8 bytes), then each tensor's bytes at its offsets."""
    entries: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    sizes, offset = [], 0
    for name, (dtype, shape) in header.items():
        if dtype not in _DTYPE_BYTES:
            raise ConfigError(f"checkpoint tensor {name} has dtype {dtype}, which the merge does not write")
        size = _DTYPE_BYTES[dtype]
        for dim in shape:
            size *= dim
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        sizes.append(size)
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    out.write(len(text).to_bytes(8, "little"))
    out.write(text)
    return sizes


def _write_data(out: BinaryIO, tensor: torch.Tensor, size: int, name: str) -> None:
    if sys.byteorder != "little":  # pragma: no cover - safetensors is little-endian; so is every machine tracerl runs on
        raise ConfigError("the streamed merge writes safetensors on little-endian machines only")
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    if data.numel() != size:
        raise ConfigError(f"merged tensor {name} has {data.numel()} bytes, its header says {size}")
    out.write(memoryview(data.numpy()))
