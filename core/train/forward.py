"""The one route from a packed micro-batch to the logprob of each trained token.

The GRPO trainer, SFT, distillation and the Tinker service's adapter pool all call
:class:`PolicyForward`, so they compute the same distribution, and it is the sampler's:

- attention per layer type (:mod:`tracerl.train.attention`: sliding windows measured on positions);
- logits from the model's own output module (a LoRA on ``lm_head`` included), in the model's
  dtype as its own ``forward`` computes them, then the family's own processing
  (:class:`LogitProcessing`), then the sampled turn's temperature, top-k and top-p
  (:func:`processed_logits`, the definition tracerl's servers sample and report with);
- chunk by chunk over the picked positions, each chunk's ``[rows, vocabulary]`` logits recomputed
  in backward instead of stored.

:meth:`PolicyForward.check_against_model` runs once at load: the route must give the model's own
``forward`` logprobs on a packed probe longer than the model's window (shrunk for the probe), or the trainer refuses the
model rather than train another distribution than the one served.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigError
from .attention import PACKED, AttentionLayout, register_packed_attention
from .packing import MicroBatch

PROBE_WINDOW = 8
"""The load-time probe's window: a model's larger window is shrunk to it for the probe, which then
spans three windows at little cost (a 4096-token window would need a 12k-token probe)."""


@dataclass(frozen=True)
class LogitProcessing:
    """What a family's ``forward`` does to the output module's logits (transformers' config names)."""

    softcap: float | None = None
    """``final_logit_softcapping`` (Gemma 2 style): ``cap · tanh(logits / cap)``."""
    scale: float | None = None
    """``logit_scale`` (Cohere): ``logits · scale``."""
    divide: float | None = None
    """``logits_scaling`` (Granite): ``logits / divide``."""

    @classmethod
    def of(cls, config: Any) -> "LogitProcessing":
        def number(name: str) -> float | None:
            value = getattr(config, name, None)
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

        return cls(number("final_logit_softcapping"), number("logit_scale"), number("logits_scaling"))

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            logits = logits * self.scale
        if self.divide is not None:
            logits = logits / self.divide
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


@dataclass(frozen=True)
class Sampling:
    """Per picked position: the turn's temperature, top-k (0: off) and top-p (1: off); None: T = 1, no filter."""

    temperature_C: torch.Tensor | None = None
    top_k_C: torch.Tensor | None = None
    top_p_C: torch.Tensor | None = None


def processed_logits(logits_CV: torch.Tensor, temperature_C: torch.Tensor | None, top_k_C: torch.Tensor | None = None,
                     top_p_C: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The logits of the distribution a turn was sampled from: divided by its temperature, then
    top-k, then top-p (the smallest set of most likely tokens whose probability reaches top-p)
    kept and everything else set to −inf.  Which tokens are kept is decided without gradients;
    the kept logits keep theirs.  A temperature of 0 (greedy) is not divided (those turns are
    not trained; :mod:`tracerl.train.tokenization`)."""
    if temperature_C is not None:
        t = temperature_C.to(logits_CV.device, logits_CV.dtype)
        logits_CV = logits_CV / torch.where(t > 0, t, torch.ones_like(t))[:, None]
    if top_k_C is None and top_p_C is None:
        return logits_CV
    with torch.no_grad():
        values = logits_CV.detach()
        drop = torch.zeros_like(values, dtype=torch.bool)
        sorted_values, order = torch.sort(values, dim=-1, descending=True)
        if top_k_C is not None:
            k = top_k_C.to(values.device).long()
            active = (k > 0) & (k < values.shape[-1])
            kth = sorted_values.gather(-1, (k.clamp(min=1) - 1)[:, None])
            drop |= active[:, None] & (values < kth)
            sorted_values = sorted_values.masked_fill(active[:, None] & (sorted_values < kth), float("-inf"))
        if top_p_C is not None:
            p = top_p_C.to(values.device, values.dtype)
            probs = torch.softmax(sorted_values, dim=-1)
            before = probs.cumsum(-1) - probs
            drop_sorted = (before >= p[:, None]) & (p[:, None] < 1.0)
            drop |= torch.zeros_like(drop).scatter(-1, order, drop_sorted)
    return logits_CV.masked_fill(drop, float("-inf"))


class PolicyForward:
    """Logprob and entropy of each picked token of a packed micro-batch, through ``causal_lm``'s own semantics."""

    def __init__(self, causal_lm: Any, *, implementation: str, device: str, dtype: torch.dtype, chunk_size: int = 256) -> None:
        """``causal_lm``: the transformers model (its base, when peft wraps it: the LoRA layers are inside);
        ``implementation``: the attention it was loaded with (``"sdpa"`` or ``"eager"``).  The model is
        switched to tracerl's packed attention (:func:`tracerl.train.attention.register_packed_attention`),
        which attends as ``implementation`` does for every call that passes no block mask."""
        self.causal_lm = causal_lm
        self.layout = AttentionLayout.of(causal_lm.config, implementation)
        if hasattr(causal_lm, "set_attn_implementation"):
            register_packed_attention()
            causal_lm.set_attn_implementation(PACKED[implementation])
        self.processing = LogitProcessing.of(causal_lm.config)
        self.device, self.dtype, self.chunk_size = device, dtype, chunk_size

    def hidden(self, batch: MicroBatch) -> torch.Tensor:
        """The decoder's last hidden state at each picked position (``[N, H]``)."""
        masks = self.layout.masks(batch.segment_ids_BT.to(self.device), batch.position_ids_BT.to(self.device))
        hidden_BTH = self.causal_lm.model(
            input_ids=batch.input_ids_BT.to(self.device), position_ids=batch.position_ids_BT.to(self.device), attention_mask=masks
        ).last_hidden_state
        return hidden_BTH[batch.rows_N.to(self.device), batch.positions_N.to(self.device)]

    def token_logprobs(self, batch: MicroBatch, targets_N: torch.Tensor | None = None, sampling: Sampling | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Logprob of each target (default: the batch's trained tokens) and the entropy at its position, ``[N]`` each."""
        targets = (batch.targets_N if targets_N is None else targets_N).to(self.device)
        if sampling is None:
            sampling = Sampling(batch.temperatures_N, batch.top_k_N, batch.top_p_N)
        return self.logprobs_of(self.hidden(batch), targets, sampling)

    def logprobs_of(self, hidden_NH: torch.Tensor, targets_N: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
        output = self.causal_lm.get_output_embeddings()
        logprob_chunks, entropy_chunks = [], []
        for start in range(0, hidden_NH.shape[0], self.chunk_size):
            part = slice(start, start + self.chunk_size)
            args = (hidden_NH[part], targets_N[part], *(_part(t, part) for t in (sampling.temperature_C, sampling.top_k_C, sampling.top_p_C)))
            if torch.is_grad_enabled():
                lp, ent = checkpoint(self._chunk, output, *args, use_reentrant=False)
            else:
                lp, ent = self._chunk(output, *args)
            logprob_chunks.append(lp)
            entropy_chunks.append(ent)
        if not logprob_chunks:
            empty = torch.zeros(0, device=hidden_NH.device)
            return empty, empty
        return torch.cat(logprob_chunks), torch.cat(entropy_chunks)

    def _chunk(self, output: Any, hidden_CH: torch.Tensor, targets_C: torch.Tensor, temperature_C: torch.Tensor | None,
               top_k_C: torch.Tensor | None, top_p_C: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        logits_CV = processed_logits(self.processing(output(hidden_CH).float()), temperature_C, top_k_C, top_p_C)
        logprobs_CV = torch.log_softmax(logits_CV, dim=-1)
        with torch.no_grad():
            finite = torch.isfinite(logprobs_CV)
            entropy_C = -(logprobs_CV.exp() * torch.where(finite, logprobs_CV, torch.zeros_like(logprobs_CV))).sum(-1)
        return logprobs_CV.gather(-1, targets_C[:, None])[:, 0], entropy_C

    # -- the load-time check ------------------------------------------------------------
    @torch.no_grad()
    def check_against_model(self, vocab_size: int, *, seed: int = 0) -> float:
        """Compare the route with the model's own ``forward`` on a packed probe; return the mean KL.

        The probe is one row holding a shared prefix and two suffixes, longer together than the
        model's smallest window (shrunk to :data:`PROBE_WINDOW` for the probe, in the model's
        configuration, which its ``forward`` reads, and in the route's layout alike), so a window measured on the wrong positions, a mask the decoder
        ignores or logits processed another way all show.  Compared: KL(own forward ‖ route) of the
        whole next-token distribution at each suffix position, which a wrong attention or logit
        processing moves far more than rounding does (fp32: ~1e-12).  Below fp32 the packed row and the
        plain sequence round differently (SmolLM2 in bf16: a mean KL of ~2e-3 on this random probe,
        exactly 0 without the shared prefix), so the limit there is 1e-2 and catches gross differences
        only; the fp32 tests are what prove the semantics.  Raises :class:`ConfigError` past the limit."""
        from .packing import pack_sequences
        from .tokenization import TrainingSequence

        windows = [w for w in self.layout.windows.values() if w is not None]
        if windows and min(windows) > PROBE_WINDOW:
            with _window_shrunk(self, PROBE_WINDOW):
                return self.check_against_model(vocab_size, seed=seed)
        span = (min(windows) if windows else PROBE_WINDOW) + 4
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab_size, (3 * span,), generator=generator).tolist()
        prefix, suffixes = ids[:span], (ids[span : 2 * span], ids[2 * span :])
        sequences = [
            TrainingSequence([*prefix, *suffix], [0.0] * span + [1.0] * span, [0.0] * (2 * span), trajectory_index=i, group_index=0)
            for i, suffix in enumerate(suffixes)
        ]
        (batch,) = pack_sequences(sequences, [1.0, 1.0], max_tokens=8 * span)
        hidden_NH = self.hidden(batch)
        output = self.causal_lm.get_output_embeddings()
        kl_sum = 0.0
        for i, seq in enumerate(sequences):
            ids_T = torch.tensor([seq.token_ids], device=self.device)
            with _own_attention(self):
                own = torch.log_softmax(self.causal_lm(input_ids=ids_T, logits_to_keep=span + 1).logits[0, :-1].float(), dim=-1)
            ours = torch.log_softmax(self.processing(output(hidden_NH[i * span : (i + 1) * span]).float()), dim=-1)
            kl_sum += float((own.exp() * (own - ours)).sum())
        kl = kl_sum / (2 * span)
        limit = 1e-6 if self.dtype == torch.float32 else 1e-2
        if not kl <= limit:
            raise ConfigError(
                f"the trainer's next-token distributions differ from {type(self.causal_lm).__name__}'s own forward by a "
                f"mean KL of {kl:.3g} (> {limit:g}) on a packed probe: this model family attends or processes its logits "
                f"in a way tracerl's trainer does not reproduce (layer types {self.layout.windows}, logit processing "
                f"{self.processing}); training it would not train what is served"
            )
        return kl


@contextmanager
def _window_shrunk(route: PolicyForward, window: int) -> Iterator[None]:
    """The model's ``sliding_window`` (which its ``forward`` reads to build its masks) and the route's
    layout set to ``window`` for the probe, then restored."""
    config, layout = route.causal_lm.config, route.layout
    original = config.sliding_window
    config.sliding_window = window
    route.layout = AttentionLayout.of(config, layout.implementation)
    try:
        yield
    finally:
        config.sliding_window, route.layout = original, layout


@contextmanager
def _own_attention(route: PolicyForward) -> Iterator[None]:
    """The model's own attention implementation (the one it was loaded with) for the probe's reference forward."""
    model, own = route.causal_lm, route.layout.implementation
    model.set_attn_implementation(own)
    try:
        yield
    finally:
        model.set_attn_implementation(PACKED[own])


def _part(tensor: torch.Tensor | None, part: slice) -> torch.Tensor | None:
    return None if tensor is None else tensor[part]


def load_causal_lm(model_path: Any, dtype: torch.dtype, device: str | None = None) -> tuple[Any, str]:
    """The base model with SDPA attention where its class has it, else eager (gpt-oss: sinks); and which.

    Loaded in ``dtype``, straight onto ``device`` when one is given (transformers' ``device_map``:
    no full copy on the CPU first)."""
    from transformers import AutoModelForCausalLM

    placement = {"device_map": device} if device is not None else {}
    try:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa", **placement), "sdpa"
    except ValueError as error:
        if "sdpa" not in str(error).lower() and "scaled_dot_product" not in str(error).lower():
            raise
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="eager", **placement), "eager"
