"""Which tokens each layer attends to in a packed row: one mask rule, a block mask per layer type.

A packed row (:mod:`tracerl.train.packing`) is described by ``segment_ids_BT`` (0: the shared
prompt, 1, 2, …: each sequence's own suffix, :data:`PAD_SEGMENT`: padding) and ``position_ids_BT``
(positions restart after the shared prompt).  :func:`rule` is the one rule: a token sees the
earlier tokens of its own segment and of the shared prompt; padding sees itself only; a layer
with a sliding window also needs ``pos[q] − pos[kv] < window``.  The window is measured on
positions, not on indices in the row: a suffix placed after its siblings is still next to the
shared prompt in its own context, exactly as the sampler saw it (transformers' own windows,
``kv_idx > q_idx − window``, are index-based and right only for an unpacked sequence).

No dense ``T × T`` mask is built for training.  :class:`AttentionLayout` turns the rule into a
PyTorch FlexAttention :class:`~torch.nn.attention.flex_attention.BlockMask` per layer type and
micro-batch: the rule as its ``mask_mod`` plus, per 128-query block, the list of 128-key blocks
where it allows anything (``O(T²/128²)`` integers).  The decoder takes it as its
``attention_mask`` (a dict keyed by layer type for decoders with ``layer_types``), and
:func:`packed_attention`, registered through transformers' ``AttentionInterface``, computes
attention query block by query block over the listed key blocks only, evaluating the rule for
that block; each block is recomputed in backward instead of stored, so memory grows with ``T``.
FlexAttention's own kernel does not run backward on a CPU (torch 2.13 refuses it), which is why
the blocks are computed here; on a GPU the same block mask is what transformers'
``flex_attention`` takes (not yet run: no GPU has been lent).  gpt-oss's sinks are one more
logit column per head in the block's softmax, as its eager attention does.

Calls that do not pass a block mask (the model's own ``forward``, generation) attend as the
implementation the model was loaded with: SDPA's own function, or eager attention computed by the
same blocks from transformers' dense additive mask.  :func:`allowed` materialises the rule as a
dense boolean ``[B, 1, T, T]`` mask, for tests and inspection only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigError

PAD_SEGMENT = -1
FULL, SLIDING = "full_attention", "sliding_attention"
BLOCK = 128
"""Rows and columns of one block of the block mask (FlexAttention's default)."""
SCORE_BUDGET = 1 << 24
"""Scores (``heads × query rows × keys``) one query chunk may hold at once: queries go in chunks of
whole blocks, as many as keep a chunk's scores under this (at least one block)."""
FUSED = True
"""Blocks without sinks or soft-capping go through SDPA's fused kernel (False: the plain-torch form, for comparison)."""
PACKED = {"sdpa": "tracerl_packed_sdpa", "eager": "tracerl_packed_eager"}
"""The attention implementation a model loaded with SDPA or eager attention is switched to."""


def rule(q_seg: torch.Tensor, kv_seg: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor,
         q_idx: torch.Tensor, kv_idx: torch.Tensor, window: int | None) -> torch.Tensor:  # fmt: skip
    """Whether query ``q`` attends to key ``kv`` (elementwise, broadcasting): the one mask rule."""
    ok = (q_idx >= kv_idx) & ((kv_seg == q_seg) | ((kv_seg == 0) & (q_seg > 0))) & (q_seg != PAD_SEGMENT)
    if window is not None:
        ok = ok & (q_pos - kv_pos < window)
    return ok | ((q_seg == PAD_SEGMENT) & (q_idx == kv_idx))  # padding sees itself


def mask_mod_of(segment_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor, window: int | None) -> Callable[..., torch.Tensor]:
    """The rule as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` (also evaluated on broadcast index tensors)."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return rule(segment_ids_BT[b, q_idx], segment_ids_BT[b, kv_idx], position_ids_BT[b, q_idx], position_ids_BT[b, kv_idx],
                    q_idx, kv_idx, window)  # fmt: skip

    return mask_mod


def allowed(segment_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """The dense boolean ``[B, 1, T, T]`` mask of the rule (True: query ``q`` attends to key ``kv``); tests and inspection only."""
    B, T = segment_ids_BT.shape
    index = torch.arange(T, device=segment_ids_BT.device)
    b = torch.arange(B, device=segment_ids_BT.device)[:, None, None]
    return mask_mod_of(segment_ids_BT, position_ids_BT, window)(b, None, index[None, :, None], index[None, None, :])[:, None]


def block_mask(segment_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor, window: int | None = None) -> Any:
    """The rule as a FlexAttention ``BlockMask``: its ``mask_mod`` and, per query block, the key blocks it allows anything in.

    The rule is evaluated one query block at a time (``B × 128 × T`` booleans alive at once)."""
    from torch.nn.attention.flex_attention import BlockMask

    B, T = segment_ids_BT.shape
    device = segment_ids_BT.device
    mask_mod = mask_mod_of(segment_ids_BT, position_ids_BT, window)
    n_blocks = -(-T // BLOCK)
    b = torch.arange(B, device=device)[:, None, None]
    kv_idx = torch.arange(T, device=device)
    pad = n_blocks * BLOCK - T
    nonempty = torch.zeros(B, n_blocks, n_blocks, dtype=torch.bool, device=device)
    for i in range(n_blocks):
        q_idx = torch.arange(i * BLOCK, min((i + 1) * BLOCK, T), device=device)
        block = mask_mod(b, None, q_idx[None, :, None], kv_idx[None, None, :]).any(1)  # [B, T]
        nonempty[:, i] = torch.nn.functional.pad(block, (0, pad)).view(B, n_blocks, BLOCK).any(-1)
    counts = nonempty.sum(-1, dtype=torch.int32)
    indices = torch.sort(nonempty.to(torch.int8), dim=-1, descending=True, stable=True).indices.to(torch.int32)
    return BlockMask.from_kv_blocks(counts[:, None], indices[:, None], BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(T, T))


@dataclass(frozen=True)
class AttentionLayout:
    """A model's attention layout: its layer types, each one's window (None: full), and its own implementation."""

    windows: dict[str, int | None]
    keyed: bool
    """Whether the decoder takes a dict of masks keyed by layer type (it has sliding-window layers)."""
    implementation: str
    """What the model was loaded with, and what its own ``forward`` uses: ``"sdpa"`` or ``"eager"``."""

    @classmethod
    def of(cls, config: Any, implementation: str) -> "AttentionLayout":
        if implementation not in PACKED:
            raise ConfigError(f"the trainer attends as 'sdpa' and 'eager' attention do, not {implementation!r}")
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

    def masks(self, segment_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor) -> Any:
        """What the decoder's ``attention_mask`` gets for one micro-batch (tensors already on its device):
        a block mask per distinct window, keyed by layer type where the decoder takes a dict."""
        built: dict[int | None, Any] = {}
        for window in self.windows.values():
            if window not in built:
                built[window] = block_mask(segment_ids_BT, position_ids_BT, window)
        if self.keyed:
            return {kind: built[window] for kind, window in self.windows.items()}
        return built[next(iter(self.windows.values()))]


# -- the attention function --------------------------------------------------------------
def packed_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                     scaling: float | None = None, dropout: float = 0.0, softcap: float | None = None,
                     s_aux: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """Attention over a :func:`block_mask`, query block by query block (transformers' attention-function signature:
    ``query`` ``[B, H, Tq, D]``, ``key``/``value`` ``[B, H_kv, Tk, D]``; returns ``[B, Tq, H, D]``)."""
    from torch.nn.attention.flex_attention import BlockMask

    if dropout:
        raise ConfigError("tracerl's packed attention has no dropout (it would make trainer logprobs differ from the sampler's)")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    B, H, Tq, _ = query.shape
    Hkv, Tk = key.shape[1], key.shape[2]
    if isinstance(attention_mask, BlockMask):
        mask_mod, q_offset = attention_mask.mask_mod, 0
        tables = (attention_mask.kv_num_blocks, attention_mask.kv_indices)
    else:  # a dense mask from transformers (the model's own forward under eager attention), or None: causal
        dense = attention_mask
        q_offset = Tk - Tq
        mask_mod = _dense_mask_mod(dense, q_offset)
        tables = None
    chunk_blocks = max(1, SCORE_BUDGET // (B * H * BLOCK * max(Tk, 1)))
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    outputs = []
    for start in range(0, Tq, chunk_blocks * BLOCK):
        end = min(start + chunk_blocks * BLOCK, Tq)
        kv_index = _keys_of(tables, start // BLOCK, -(-end // BLOCK), Tk, start + q_offset, end + q_offset, query.device)
        args = (query, key, value, s_aux, kv_index, start, end, q_offset, mask_mod, scaling, softcap)
        outputs.append(checkpoint(_chunk, *args, use_reentrant=False) if grad else _chunk(*args))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def _keys_of(tables: Any, first: int, last: int, Tk: int, q_start: int, q_end: int, device: torch.device) -> torch.Tensor:
    """The key indices a chunk of query blocks ``[first, last)`` needs: its listed key blocks (any row), else all keys up to its last query."""
    if tables is None:
        return torch.arange(min(q_end, Tk), device=device)
    counts, indices = tables
    listed = torch.arange(indices.shape[-1], device=device) < counts[:, :, first:last, None]
    blocks = torch.zeros(indices.shape[-1] + 1, dtype=torch.bool, device=device)
    blocks[torch.where(listed, indices[:, :, first:last].long(), indices.shape[-1]).flatten()] = True
    keys = (blocks[:-1].nonzero()[:, 0, None] * BLOCK + torch.arange(BLOCK, device=device)).flatten()
    return keys[keys < Tk]


def _dense_mask_mod(dense: torch.Tensor | None, q_offset: int) -> Callable[..., torch.Tensor]:
    def mask_mod(b: torch.Tensor, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        if dense is None:
            return q_idx >= kv_idx
        m = dense[b, 0, q_idx - q_offset, kv_idx]
        return m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2

    return mask_mod


def _chunk(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sinks: torch.Tensor | None, kv_index: torch.Tensor,
           start: int, end: int, q_offset: int, mask_mod: Callable[..., torch.Tensor], scaling: float, softcap: float | None
           ) -> torch.Tensor:  # fmt: skip
    """Attention output of queries ``[start, end)`` over keys ``kv_index``, as eager attention computes it."""
    B, H, _, D = query.shape
    Hkv = key.shape[1]
    G = H // Hkv
    b = torch.arange(B, device=query.device)[:, None, None]
    q_idx = torch.arange(start + q_offset, end + q_offset, device=query.device)
    keep = mask_mod(b, None, q_idx[None, :, None], kv_index[None, None, :])  # [B, rows, keys]
    k, v = key.index_select(2, kv_index), value.index_select(2, kv_index)
    if sinks is None and softcap is None and FUSED:  # SDPA's fused kernel on the block (forward and backward)
        return torch.nn.functional.scaled_dot_product_attention(query[:, :, start:end], k, v, attn_mask=keep[:, None],
                                                                scale=scaling, enable_gqa=G > 1)  # fmt: skip
    q = query[:, :, start:end].reshape(B, Hkv, G, end - start, D)
    k, v = k[:, :, None], v[:, :, None]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling  # [B, Hkv, G, rows, keys]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~keep[:, None, None], torch.finfo(scores.dtype).min)
    if sinks is not None:  # one more logit per head, dropped after the softmax, in the logits' dtype (gpt-oss's eager form)
        sink = sinks.to(scores.dtype).view(1, Hkv, G, 1, 1).expand(B, Hkv, G, end - start, 1)
        logits = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1, dtype=logits.dtype)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return torch.matmul(probs.to(value.dtype), v).reshape(B, H, end - start, D)


def register_packed_attention() -> None:
    """Register :func:`packed_attention` with transformers under the names of :data:`PACKED`.

    A call with a block mask attends packed; any other call attends as the model's own
    implementation does (SDPA's function with SDPA's masks; eager attention's masks)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from torch.nn.attention.flex_attention import BlockMask

    def packed_or_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kwargs: Any) -> Any:
        if isinstance(attention_mask, BlockMask):
            return packed_attention(module, query, key, value, attention_mask, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(PACKED["sdpa"], packed_or_sdpa)
    AttentionInterface.register(PACKED["eager"], packed_attention)
    AttentionMaskInterface.register(PACKED["sdpa"], ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    AttentionMaskInterface.register(PACKED["eager"], ALL_MASK_ATTENTION_FUNCTIONS["eager"])
