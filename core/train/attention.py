"""Which tokens each layer attends to in a packed row: one mask function, one mask per layer type.

A packed row (:mod:`tracerl.train.packing`) is described by ``segment_ids_BT`` (0: the shared
prompt, 1, 2, …: each sequence's own suffix, :data:`PAD_SEGMENT`: padding) and ``position_ids_BT``
(positions restart after the shared prompt).  :func:`allowed` is the one rule: a token sees the
earlier tokens of its own segment and of the shared prompt; padding sees itself only; a layer
with a sliding window also needs ``pos[q] − pos[kv] < window``.  The window is measured on
positions, not on indices in the row: a suffix placed after its siblings is still next to the
shared prompt in its own context, exactly as the sampler saw it (transformers' own windows,
``kv_idx > q_idx − window``, are index-based and right only for an unpacked sequence).

:class:`AttentionLayout` reads a model's layer types and windows from its configuration and turns
the rule into what its attention implementation takes, once per layer type and micro-batch: a
boolean ``[B, 1, T, T]`` mask for SDPA (True: attend), the additive form for eager attention.
A model with sliding-window layers gets a dict keyed by layer type (what transformers' decoders
with ``layer_types`` accept); others get one tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError

PAD_SEGMENT = -1
FULL, SLIDING = "full_attention", "sliding_attention"


def allowed(segment_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """The boolean ``[B, 1, T, T]`` mask of the rule (True: query ``q`` attends to key ``kv``)."""
    T = segment_ids_BT.shape[-1]
    index = torch.arange(T, device=segment_ids_BT.device)
    q_seg, kv_seg = segment_ids_BT[:, :, None], segment_ids_BT[:, None, :]
    causal = index[None, :, None] >= index[None, None, :]
    same_context = (kv_seg == q_seg) | ((kv_seg == 0) & (q_seg > 0))
    mask = causal & same_context & (q_seg != PAD_SEGMENT)
    mask = mask | ((q_seg == PAD_SEGMENT) & (index[None, :, None] == index[None, None, :]))  # padding sees itself
    if window is not None:
        distance = position_ids_BT[:, :, None] - position_ids_BT[:, None, :]
        mask = mask & ((distance < window) | (q_seg == PAD_SEGMENT))
    return mask[:, None]


@dataclass(frozen=True)
class AttentionLayout:
    """A model's attention layout: its layer types, each one's window (None: full), and the mask form."""

    windows: dict[str, int | None]
    keyed: bool
    """Whether the decoder takes a dict of masks keyed by layer type (it has sliding-window layers)."""
    implementation: str
    """``"sdpa"`` (boolean masks) or ``"eager"`` (additive masks)."""

    @classmethod
    def of(cls, config: Any, implementation: str) -> "AttentionLayout":
        if implementation not in ("sdpa", "eager"):
            raise ConfigError(f"the trainer builds masks for 'sdpa' and 'eager' attention, not {implementation!r}")
        layer_types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None)
        if layer_types:
            unknown = sorted(set(layer_types) - {FULL, SLIDING})
            if unknown:
                raise ConfigError(
                    f"layer types {unknown} of {type(config).__name__} are not supported by tracerl's trainer "
                    f"(it trains {FULL!r} and {SLIDING!r} layers): training them would not compute what the sampler sampled"
                )
            windows = {kind: (int(window) if kind == SLIDING else None) for kind in sorted(set(layer_types))}
            if SLIDING in windows and not window:
                raise ConfigError(f"{type(config).__name__} has {SLIDING!r} layers but no sliding_window")
            return cls(windows, keyed=any(w is not None for w in windows.values()), implementation=implementation)
        use_window = window and getattr(config, "use_sliding_window", True)
        return cls({FULL: int(window) if use_window else None}, keyed=False, implementation=implementation)

    def masks(self, segment_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
        """What the decoder's ``attention_mask`` gets for one micro-batch (tensors already on its device)."""
        built: dict[int | None, torch.Tensor] = {}
        for window in self.windows.values():
            if window not in built:
                mask = allowed(segment_ids_BT, position_ids_BT, window)
                built[window] = mask if self.implementation == "sdpa" else additive(mask, dtype)
        if self.keyed:
            return {kind: built[window] for kind, window in self.windows.items()}
        return built[next(iter(self.windows.values()))]


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where attention is allowed, the dtype's most negative number elsewhere (eager attention adds it)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
