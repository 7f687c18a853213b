"""Rows of different LoRA adapters in one forward, each layer's deltas from one batched product.

peft's per-row ``adapter_names`` loops over the adapters of a batch: for each, it gathers that
adapter's rows, runs its A and B, and scatters the result back.  At decode's one token a row those
small operations cost more than the base layer they ride on, and they multiply with the adapters
in the batch, so several tenants sampling together gained little over one alone.

:class:`BatchedLoRA` applies every row's own adapter with the same few operations whatever the
number of adapters: per LoRA layer, the A matrices of the forward's adapters are stacked into one
(their ranks' rows one after another) and the B matrices side by side, and

    delta = ((x @ A_stack.T) * row_mask) @ B_stack.T

where ``row_mask[row, column]`` is the row's adapter's ``scaling`` on that adapter's columns and 0
elsewhere (a base-model row keeps none).  It is the dense form of S-LoRA/Punica's per-row gather:
the unused columns cost ``adapters × rank`` extra multiply-adds per input feature, small beside the
base layer's.  The weights stay peft's own (each layer's ``lora_A``/``lora_B``/``scaling``); peft
computes the base layers (its adapter layers switched off, :meth:`BatchedLoRA.peft_layers`) and a
forward hook adds the delta.  Adapters this does not express (DoRA and other variants, LoRA biases, embedding or
convolution LoRA, ``modules_to_save``, trainable tokens) keep peft's ``adapter_names`` path:
:meth:`BatchedLoRA.supports` says which.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Iterator

STACKS_KEPT = 2
"""Stacked weights kept for this many adapter sets: a batch's set changes when jobs join or finish,
often back and forth; each set holds a copy of its adapters' LoRA weights."""


class BatchedLoRA:
    """Forward hooks on a peft model's LoRA layers that apply a per-row adapter in one product."""

    def __init__(self, peft_model: Any) -> None:
        self.peft_model = peft_model
        self._hooked: set[int] = set()
        self._supported: dict[str, bool] = {}
        self._stacks: collections.OrderedDict[tuple[str, ...], dict[Any, tuple[Any, Any, Any]]] = collections.OrderedDict()
        self._active: dict[Any, tuple[Any, Any, Any]] | None = None  # layer -> (A stack, B stack, row mask) for this forward
        self._layers_on = True  # peft's LoRA layers compute their adapter (see peft_layers)
        self.refresh()

    def _lora_layers(self) -> Iterator[Any]:
        from peft.tuners.lora import LoraLayer

        for module in self.peft_model.modules():
            if isinstance(module, LoraLayer):
                yield module

    def refresh(self) -> None:
        """Hook LoRA layers that appeared (an adapter with new target modules); forget stacks and verdicts of
        adapters no longer loaded; switch peft's layers back on (new ones start on).  Call after every
        adapter load or delete."""
        self._layers_on = False
        self.peft_layers(on=True)
        for layer in self._lora_layers():
            if id(layer) not in self._hooked:
                layer.register_forward_hook(self._add_delta)
                self._hooked.add(id(layer))
        loaded = set(self.peft_model.peft_config)
        self._supported = {name: verdict for name, verdict in self._supported.items() if name in loaded}
        for key in [key for key in self._stacks if not set(key) <= loaded]:
            del self._stacks[key]

    def supports(self, adapter: str) -> bool:
        """Whether ``adapter`` (peft's name) is plain LoRA on linear layers only, which the stacked product computes."""
        if adapter not in self._supported:
            self._supported[adapter] = self._check(adapter)
        return self._supported[adapter]

    def _check(self, adapter: str) -> bool:
        import torch
        from peft.tuners.lora import Linear

        config = self.peft_model.peft_config.get(adapter)
        if config is None or getattr(config, "use_dora", False) or getattr(config, "modules_to_save", None):
            return False
        if getattr(config, "trainable_token_indices", None) or getattr(config, "lora_bias", False):
            return False
        for layer in self._lora_layers():
            holds = adapter in layer.lora_A or adapter in getattr(layer, "lora_embedding_A", {})
            if not holds:
                continue
            if type(layer) is not Linear or not isinstance(layer.get_base_layer(), torch.nn.Linear):
                return False
            if adapter in layer.lora_variant or layer.lora_B[adapter].bias is not None:
                return False
        return True

    @contextlib.contextmanager
    def rows(self, adapters: list[str | None]) -> Iterator[Any]:
        """The peft model to call for one forward whose row ``i`` uses ``adapters[i]`` (None: the base model)."""
        import torch

        present = tuple(sorted({name for name in adapters if name is not None}))
        stacks = self._stacks_for(present)
        slot = {name: index for index, name in enumerate(present)}
        row_slots = torch.tensor([slot[name] if name is not None else -1 for name in adapters], dtype=torch.long)
        active: dict[Any, tuple[Any, Any, Any]] = {}
        masks: dict[int, Any] = {}
        for layer, (a_stack, b_stack, column_slots, column_scale) in stacks.items():
            key = id(column_slots)
            if key not in masks:
                device = a_stack.device
                masks[key] = (row_slots.to(device)[:, None] == column_slots[None, :]).to(a_stack.dtype) * column_scale[None, :]
            active[layer] = (a_stack, b_stack, masks[key])
        self._active = active
        self.peft_layers(on=False)
        try:
            yield self.peft_model
        finally:
            self._active = None

    def peft_layers(self, *, on: bool) -> None:
        """Switch peft's own LoRA computation on (a forward through peft's plain path) or off (a stacked
        forward: the layers compute the base only, the hooks add the deltas).  The switch is kept between
        forwards and made only when it changes: peft's ``disable_adapter()`` context, entered every forward,
        cost more than a decode step (it reads every layer's status) with a dozen adapters loaded."""
        if self._layers_on != on:
            base = self.peft_model.base_model
            (base.enable_adapter_layers if on else base.disable_adapter_layers)()
            self._layers_on = on

    def _stacks_for(self, present: tuple[str, ...]) -> dict[Any, tuple[Any, Any, Any, Any]]:
        """Per LoRA layer holding any of ``present``: A stacked (rank rows per adapter), B side by side, each column's
        adapter slot and scaling.  Layers holding the same adapters share one column-slot tensor (one mask)."""
        import torch

        if present in self._stacks:
            self._stacks.move_to_end(present)
            return self._stacks[present]
        stacks: dict[Any, tuple[Any, Any, Any, Any]] = {}
        columns: dict[tuple[float, ...], tuple[Any, Any]] = {}
        for layer in self._lora_layers():
            held = [(index, name) for index, name in enumerate(present) if name in layer.lora_A]
            if not held:
                continue
            a_stack = torch.cat([layer.lora_A[name].weight for _, name in held], dim=0)
            b_stack = torch.cat([layer.lora_B[name].weight for _, name in held], dim=1)
            slots = [index for index, name in held for _ in range(layer.lora_A[name].weight.shape[0])]
            scales = [float(layer.scaling[present[index]]) for index in slots]
            signature = (*slots, *scales)  # alpha or rank patterns may scale one adapter differently per layer
            if signature not in columns:
                columns[signature] = (torch.tensor(slots, dtype=torch.long, device=a_stack.device),
                                      torch.tensor(scales, dtype=a_stack.dtype, device=a_stack.device))  # fmt: skip
            stacks[layer] = (a_stack, b_stack, *columns[signature])
        self._stacks[present] = stacks
        while len(self._stacks) > STACKS_KEPT:
            self._stacks.popitem(last=False)
        return stacks

    def _add_delta(self, layer: Any, args: tuple[Any, ...], output: Any) -> Any:
        if self._active is None:
            return None
        entry = self._active.get(layer)
        if entry is None:
            return None
        import torch.nn.functional as F

        a_stack, b_stack, mask = entry
        x = args[0].to(a_stack.dtype)
        hidden = F.linear(x, a_stack)  # (rows, tokens, columns)
        hidden = hidden * (mask[:, None, :] if hidden.dim() == 3 else mask)
        return output + F.linear(hidden, b_stack).to(output.dtype)
