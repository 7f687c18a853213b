"""What a run takes in memory before it starts: the trainer, vLLM beside it, and whether they fit.

``tracerl plan`` prints it; ``LocalBackend.register`` runs the same check before anything loads, so a
run that cannot fit is a clear error instead of an out-of-memory in the middle of a step.  Everything
is computed from the model's configuration (a folder's ``config.json`` or one of :data:`BUILTIN_SHAPES`,
public configs written down here): parameters and LoRA parameters are counted on the meta device
(no weights allocated), the rest from shapes.

The trainer's terms follow what :class:`~tracerl.train.trainer.LoRATrainer` runs (read off
``torch.autograd.graph.saved_tensors_hooks`` on a real step, then checked against measured peaks by
``bench/plan_check.py``, ``docs/benchmarks.md``):

- base weights in the trainer's dtype; the LoRA, its gradients and AdamW's two moments in fp32
  (16 bytes a LoRA parameter);
- per token and decoder layer, what backward keeps: q, k and v (k and v once per key-value head:
  packed attention groups query heads itself) and the attention output, both norms' inputs and
  outputs (fp32), gate, up and their product
  (3 · intermediate; MoE: per routed expert), the LoRA inputs (in bf16 each adapted module casts
  its input to fp32: a copy each) and rank-sized LoRA intermediates; with gradient checkpointing only
  each layer's input, plus one layer recomputed during backward;
- packed attention (:mod:`tracerl.train.attention`): the block mask's tables per layer type
  (``(T/128)²`` integers a row, a few tables) and one query chunk's scores while it runs or is
  recomputed in backward (fp32, at most ``SCORE_BUDGET`` a tensor): nothing grows with ``T²``;
- the logprob chunks: ``logprob_chunk_size`` rows of ``[rows, vocabulary]`` fp32 logits, a few
  such tensors alive at once (log-softmax, its gradient, the entropy's temporaries);
- the process: CUDA context and workspaces on a GPU, the interpreter with torch loaded on a CPU.

vLLM's part: its weights (split over tensor parallelism), its LoRA slots (``max_loras`` adapters of
``max_lora_rank``), its runtime, and the KV cache it makes of the rest of ``gpu_memory_utilization``;
sleep level 1 frees the weights (offloaded to CPU memory) and the KV cache while the trainer steps.
On a CPU vLLM's KV cache is ``kv_cache_memory_bytes`` and nothing sleeps.  The vLLM and GPU figures
are from vLLM's documented behaviour and these formulas; no GPU has run them yet.
"""

from __future__ import annotations

import functools
import json
import math
import os
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

from ..errors import ConfigError, InsufficientMemoryError
from ..inference.devices import FIXED_OVERHEAD_BYTES, GIB
from ..inference.vllm_server import CPU_KV_CACHE_BYTES, vllm_lora_rank

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CPU_PROCESS_BYTES = int(0.38 * GIB)
"""A CPU trainer process before its model: Python with torch, transformers and peft imported (measured ~0.39 GiB RSS, bench/plan_check.py)."""
VLLM_CPU_RUNTIME_BYTES = int(1.5 * GIB)
"""vLLM's processes on a CPU without weights and KV cache (API server + engine core with torch)."""
VLLM_GPU_RUNTIME_BYTES = int(1.5 * GIB)
"""vLLM's CUDA context, CUDA graphs and non-torch memory on each GPU (estimate; not measured here)."""
VLLM_SLEEP_RESIDUAL_BYTES = 1 * GIB
"""What a sleeping (level 1) vLLM still holds on each GPU: its context and graphs (estimate)."""
VLLM_PROFILE_TOKENS = 8192
"""Tokens in vLLM's start-up profiling batch (its ``max_num_batched_tokens`` on a GPU)."""
LOGPROB_TENSORS = 4
"""``[rows, vocabulary]`` fp32 tensors alive at once in a logprob chunk (logits, log-softmax, its gradient, a temporary)."""
BLOCK_MASK_TABLES = 4
"""int32 ``[rows, 1, T/128, T/128]`` tables a FlexAttention ``BlockMask`` holds (kv and q indices, full and partial)."""
ATTENTION_WORKSPACE_TENSORS = 3
"""fp32 score-sized tensors alive while one query chunk of packed attention runs or is recomputed (scores, probabilities, a gradient)."""
GPU_ALLOCATOR_SLACK = 0.05
"""PyTorch's caching allocator's fragmentation on a GPU, as a share of the trainer's peak (estimate)."""

BUILTIN_SHAPES: dict[str, dict[str, Any]] = {
    # public config.json values (Hugging Face model cards), the fields that set memory
    "Qwen3-8B": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False),
    "Qwen3-32B": dict(model_type="qwen3", hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False),
    "Qwen3-30B-A3B": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
                          max_position_embeddings=40960, tie_word_embeddings=False),
    "Llama-3.1-8B": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=False),
    "Llama-3.1-70B": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=False),
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
                        sliding_window=128, max_position_embeddings=131072, tie_word_embeddings=False),
}  # fmt: skip


def vllm_max_loras(max_staleness: int = 1) -> int:
    """Adapters a model's vLLM serves at once: the newest policy, the previous one for stragglers
    (:class:`~tracerl.train.served_policies.ServedPolicies`), and one more per step of staleness the leases of a
    :class:`~tracerl.PipelineTrainer` may hold (its default ``max_staleness=1``)."""
    return 2 + max_staleness


class PlanDoesNotFitError(ConfigError, InsufficientMemoryError):
    """The memory plan of a run exceeds its device; raised before anything is loaded, with the plan's table."""

    def __init__(self, message: str, *, free_bytes: int, total_bytes: int, need_bytes: int) -> None:
        InsufficientMemoryError.__init__(self, message, free_bytes=free_bytes, total_bytes=total_bytes, need_bytes=need_bytes)


# -- the model's shape ----------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model's configuration, and its parameters counted on the meta device."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    parameters: int
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    qk_norm: bool = False
    sliding_layers: int = 0
    sliding_window: int | None = None
    max_positions: int | None = None
    linears: tuple[tuple[str, int, int], ...] = field(default=(), repr=False)
    """Every ``nn.Linear`` of the model: (name, in features, out features)."""
    config: Any = field(default=None, repr=False, compare=False)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def lora_parameters(self, rank: int, targets: Iterable[str]) -> int:
        """LoRA parameters peft makes for ``targets`` at ``rank``: ``rank × (in + out)`` for each linear layer whose
        name ends with a target, as peft matches them; MoE experts (fused 3-D weights, which peft adapts through
        transformers' conversion mapping) are counted by peft itself on the meta device."""
        targets = tuple(sorted(targets))
        if self.experts:
            return rank * _lora_per_rank(self.config, targets)
        matched = [(i, o) for name, i, o in self.linears if any(name == t or name.endswith("." + t) for t in targets)]
        if not matched:
            raise ConfigError(f"LoRA target modules {list(targets)} match no linear layer of {self.name}")
        return rank * sum(i + o for i, o in matched)


def load_shape(model: str | os.PathLike[str]) -> ModelShape:
    """A built-in shape's name (:data:`BUILTIN_SHAPES`, case-insensitive) or a folder with a ``config.json``."""
    from transformers import AutoConfig

    builtin = {name.lower(): name for name in BUILTIN_SHAPES}
    if str(model).lower() in builtin:
        return _builtin_shape(builtin[str(model).lower()])
    else:
        path = Path(model).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(f"{model!r} is neither a built-in shape ({', '.join(BUILTIN_SHAPES)}) nor a folder with a config.json")
        name = path.name
        config = AutoConfig.from_pretrained(path)
    return shape_of(config, name)


@functools.lru_cache(maxsize=None)
def _builtin_shape(name: str) -> ModelShape:
    from transformers import AutoConfig

    values = dict(BUILTIN_SHAPES[name])
    return shape_of(AutoConfig.for_model(values.pop("model_type"), **values), name)


def shape_of(config: Any, name: str) -> ModelShape:
    text = getattr(config, "get_text_config", lambda: config)()
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    experts = int(getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0)
    layer_types = list(getattr(text, "layer_types", None) or [])
    import torch

    meta = _meta_model(config)
    linears = tuple((n, m.in_features, m.out_features) for n, m in meta.named_modules() if isinstance(m, torch.nn.Linear))
    return ModelShape(
        name=name, hidden=int(text.hidden_size), intermediate=int(text.intermediate_size), layers=int(text.num_hidden_layers),
        heads=heads, kv_heads=int(getattr(text, "num_key_value_heads", None) or heads), head_dim=head_dim,
        vocab=int(text.vocab_size), parameters=sum(p.numel() for p in meta.parameters()), experts=experts,
        experts_per_token=int(getattr(text, "num_experts_per_tok", 0) or 0) if experts else 0,
        expert_intermediate=int(getattr(text, "moe_intermediate_size", None) or text.intermediate_size) if experts else 0,
        qk_norm=text.model_type.startswith("qwen3"), sliding_layers=layer_types.count("sliding_attention"),
        sliding_window=getattr(text, "sliding_window", None), max_positions=getattr(text, "max_position_embeddings", None),
        linears=linears, config=config,
    )  # fmt: skip


def _meta_model(config: Any) -> Any:
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings(), init_empty_weights():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(config)


_LORA_CACHE: dict[tuple[str, tuple[str, ...]], int] = {}


def _lora_per_rank(config: Any, targets: tuple[str, ...]) -> int:
    """LoRA parameters per unit of rank: peft's own injection on a meta model at rank 8, divided by 8 (linear in
    the rank, MoE experts' ``rank × experts`` rows included)."""
    key = (config.to_json_string(), targets)
    if key not in _LORA_CACHE:
        from accelerate import init_empty_weights
        from peft import LoraConfig, get_peft_model

        model = _meta_model(config)
        with warnings.catch_warnings(), init_empty_weights():
            warnings.simplefilter("ignore")
            try:
                peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=list(targets), task_type="CAUSAL_LM"))
            except ValueError as error:
                raise ConfigError(f"LoRA target modules {list(targets)}: {error}") from error
        _LORA_CACHE[key] = sum(p.numel() for p in peft_model.parameters() if p.requires_grad) // 8
    return _LORA_CACHE[key]


# -- the settings ---------------------------------------------------------------------
@dataclass(frozen=True)
class PlanSettings:
    """One run's settings, as ``LocalBackend`` takes them (``tracerl plan``'s options)."""

    device: str = "cuda"
    """``"cuda"`` or ``"cpu"``."""
    gpus: int = 1
    gpu_memory_bytes: int = 80 * GIB
    """Memory of each GPU (on CPU: the machine's RAM)."""
    lora_rank: int = 8
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    seq_len: int = 4096
    """The longest packed row (``max_seq_len``)."""
    micro_batch_tokens: int = 4096
    dtype: str = "auto"
    gradient_checkpointing: bool = False
    logprob_chunk_size: int = 256
    inference: str | None = "vllm"
    """``"vllm"``, ``"transformers"`` or None (training only)."""
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int | None = None
    """vLLM's GPUs per model (default: all ``gpus``)."""
    max_loras: int = 3
    max_model_len: int = 4096
    kv_cache_memory_bytes: int | None = None
    sleep: bool | None = None
    """vLLM sleeps (level 1) during each step; default: on a GPU."""

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ConfigError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        for name in ("gpus", "gpu_memory_bytes", "lora_rank", "seq_len", "micro_batch_tokens", "logprob_chunk_size", "max_loras", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization is a fraction in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.inference not in (None, "vllm", "transformers"):
            raise ConfigError(f"inference must be 'vllm', 'transformers' or None, got {self.inference!r}")

    @property
    def dtype_bytes(self) -> int:
        if self.dtype == "auto":
            return 2 if self.device == "cuda" else 4
        return 2 if self.dtype == "bfloat16" else 4

    @property
    def tp(self) -> int:
        return self.tensor_parallel_size or self.gpus

    @property
    def sleeps(self) -> bool:
        return self.device == "cuda" and self.inference == "vllm" and (self.sleep if self.sleep is not None else True)

    @property
    def row_tokens(self) -> int:
        """Tokens of the longest row: a row is never split, so a micro-batch holds at least one."""
        return self.seq_len

    @property
    def batch_tokens(self) -> int:
        return max(self.micro_batch_tokens, self.seq_len)


# -- the plan -------------------------------------------------------------------------
@dataclass(frozen=True)
class Part:
    name: str
    owner: str
    """``"trainer"`` or ``"vllm"``."""
    bytes: int
    note: str = ""


@dataclass(frozen=True)
class MemoryPlan:
    shape: ModelShape
    settings: PlanSettings
    parts: tuple[Part, ...]
    trainer_resident: int
    """What the trainer holds between steps (weights, LoRA state, process)."""
    trainer_peak: int
    """The trainer at the top of a step."""
    vllm_awake: int
    vllm_asleep: int
    vllm_kv_bytes: int
    kv_bytes_per_token: int
    capacity: int
    """Bytes of the device the plan is checked against (per GPU; on CPU the RAM)."""
    problems: tuple[str, ...]
    suggestion: str | None = None

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def kv_tokens(self) -> int:
        return self.vllm_kv_bytes // max(self.kv_bytes_per_token, 1)

    @property
    def peak(self) -> int:
        """The device's most-used moment: the step (vLLM asleep when it sleeps) or between steps (vLLM awake)."""
        return max(self.trainer_peak + (self.vllm_asleep if self.settings.sleeps else self.vllm_awake), self.trainer_resident + self.vllm_awake)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.shape.name, "parameters": self.shape.parameters,
            "lora_parameters": self.shape.lora_parameters(self.settings.lora_rank, self.settings.target_modules),
            "settings": {k: v for k, v in self.settings.__dict__.items()},
            "parts": [part.__dict__ for part in self.parts], "trainer_resident": self.trainer_resident,
            "trainer_peak": self.trainer_peak, "vllm_awake": self.vllm_awake, "vllm_asleep": self.vllm_asleep,
            "vllm_kv_tokens": self.kv_tokens, "capacity": self.capacity, "peak": self.peak, "fits": self.fits,
            "problems": list(self.problems), "suggestion": self.suggestion,
        }  # fmt: skip


def activation_bytes_per_token(shape: ModelShape, settings: PlanSettings) -> tuple[int, int]:
    """Bytes backward keeps per token: (one decoder layer without checkpointing, the rest of the model)."""
    b, f32 = settings.dtype_bytes, 4
    targets = set(settings.target_modules)
    H, q, I, r = shape.hidden, shape.q_dim, shape.intermediate, settings.lora_rank
    attention = (2 * q + 2 * shape.kv_dim) * b  # q and the output; k and v per key-value head
    norms = 2 * 2 * H * f32  # each norm's fp32 input and normalised output
    if shape.qk_norm:
        norms += (q + shape.kv_dim) * f32 * 2
    if shape.experts:
        k, Ie = shape.experts_per_token, shape.expert_intermediate
        mlp = k * (3 * Ie * b + 2 * H * b + Ie * f32) + shape.experts * f32 * 2  # per routed expert; router logits
    else:
        mlp = 3 * I * b + I * f32  # gate, up, their product; the down projection's input
    adapted = [m for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj") if m in targets]
    lora = len(adapted) * r * f32
    if b != f32:  # every adapted module casts its input to the LoRA's fp32: a copy each
        inputs = {"q_proj": H, "k_proj": H, "v_proj": H, "o_proj": q, "gate_proj": H, "up_proj": H, "down_proj": I}
        lora += sum(inputs[m] for m in adapted) * f32
    per_layer = attention + norms + mlp + lora
    rest = 3 * H * f32  # the final norm and the picked hidden states
    return per_layer, rest


def trainer_parts(shape: ModelShape, settings: PlanSettings) -> tuple[list[Part], int, int]:
    """The trainer's parts, what it holds between steps, and its peak within a step."""
    from .attention import BLOCK, SCORE_BUDGET  # imports torch: not at tracerl's import

    b, T, M = settings.dtype_bytes, settings.row_tokens, settings.batch_tokens
    rows = max(M // T, 1)
    lora = shape.lora_parameters(settings.lora_rank, settings.target_modules)
    per_layer, rest = activation_bytes_per_token(shape, settings)
    if settings.gradient_checkpointing:
        activations = M * (shape.layers * shape.hidden * b + rest) + M * per_layer
        act_note = f"checkpointing: each layer's input kept, one layer recomputed ({M} tokens)"
    else:
        activations = M * (shape.layers * per_layer + rest)
        act_note = f"{M} tokens x {shape.layers} layers, kept for backward (no checkpointing)"
    blocks = -(-T // BLOCK)
    layer_types = 2 if shape.sliding_layers else 1
    tables = BLOCK_MASK_TABLES * layer_types * rows * blocks * blocks * 4
    scores = min(max(SCORE_BUDGET, rows * shape.heads * BLOCK * T), rows * shape.heads * T * T)
    attention = tables + ATTENTION_WORKSPACE_TENSORS * scores * 4
    chunk = min(settings.logprob_chunk_size, M)
    logprobs = LOGPROB_TENSORS * chunk * shape.vocab * 4 + M * shape.hidden * b
    runtime = FIXED_OVERHEAD_BYTES if settings.device == "cuda" else CPU_PROCESS_BYTES
    weights = shape.parameters * b
    parts = [
        Part("base weights", "trainer", weights, f"{shape.parameters / 1e9:.2f}B params x {b} bytes"),
        Part("LoRA weights", "trainer", lora * 4, f"{lora / 1e6:.1f}M params, rank {settings.lora_rank}, fp32"),
        Part("LoRA gradients", "trainer", lora * 4, "fp32"),
        Part("AdamW state", "trainer", lora * 8, "two fp32 moments"),
        Part("activations", "trainer", activations, act_note),
        Part("packed attention", "trainer", attention, f"block tables ({blocks}^2 per row) and one query chunk's fp32 scores"),
        Part("logprob chunks", "trainer", logprobs, f"{chunk} rows x {shape.vocab} vocabulary, fp32"),
        Part("process", "trainer", runtime, "CUDA context, workspaces" if settings.device == "cuda" else "Python, torch, transformers"),
    ]
    resident = weights + lora * 16 + runtime
    peak = resident + activations + attention + logprobs
    if settings.device == "cuda":
        slack = int(GPU_ALLOCATOR_SLACK * peak)
        parts.append(Part("allocator slack", "trainer", slack, f"{GPU_ALLOCATOR_SLACK:.0%} of the peak (estimate)"))
        peak += slack
    return parts, resident, peak


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int, tp: int = 1) -> int:
    """vLLM's KV cache per token on each GPU: 2 (K, V) x layers x kv heads x head dim x bytes (sliding layers left out)."""
    full_layers = shape.layers - shape.sliding_layers
    return math.ceil(2 * full_layers * shape.kv_heads * shape.head_dim * dtype_bytes / tp)


def vllm_parts(shape: ModelShape, settings: PlanSettings) -> tuple[list[Part], int, int, int]:
    """vLLM's parts on one GPU (or the CPU), awake and asleep bytes, and its KV cache bytes."""
    if settings.inference is None:
        return [], 0, 0, 0
    b = settings.dtype_bytes
    tp = settings.tp if settings.device == "cuda" else 1
    weights = shape.parameters * b // tp
    if settings.inference == "transformers":
        kv = int(0.25 * shape.parameters * b)
        return [Part("transformers server", "vllm", weights + kv, "weights x 1.25 (its KV cache) in the trainer's process")], weights + kv, weights + kv, 0
    rank = vllm_lora_rank(settings.lora_rank)
    slots = settings.max_loras * shape.lora_parameters(rank, settings.target_modules) * b // tp
    if settings.device == "cpu":
        kv = settings.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES
        runtime = VLLM_CPU_RUNTIME_BYTES
        total = weights + slots + kv + runtime
        parts = [
            Part("vLLM weights", "vllm", weights, f"{b} bytes a parameter"),
            Part("vLLM LoRA slots", "vllm", slots, f"{settings.max_loras} adapters of max_lora_rank {rank}"),
            Part("vLLM KV cache", "vllm", kv, "kv_cache_memory_bytes"),
            Part("vLLM processes", "vllm", runtime, "no sleep mode on CPU"),
        ]
        return parts, total, total, kv
    share = int(settings.gpu_memory_utilization * settings.gpu_memory_bytes)
    profile = VLLM_PROFILE_TOKENS * (2 * shape.hidden + 2 * (shape.expert_intermediate * shape.experts_per_token or shape.intermediate)) * b // tp
    kv = max(share - weights - slots - VLLM_GPU_RUNTIME_BYTES - profile, 0)
    asleep = VLLM_SLEEP_RESIDUAL_BYTES if settings.sleeps else share
    parts = [
        Part("vLLM weights", "vllm", weights, f"{b} bytes a parameter, over {tp} GPU(s)"),
        Part("vLLM LoRA slots", "vllm", slots, f"{settings.max_loras} adapters of max_lora_rank {rank}"),
        Part("vLLM runtime", "vllm", VLLM_GPU_RUNTIME_BYTES + profile, f"context, graphs, a {VLLM_PROFILE_TOKENS}-token profile"),
        Part("vLLM KV cache", "vllm", kv, f"the rest of gpu_memory_utilization={settings.gpu_memory_utilization:g}"),
    ]
    if settings.sleeps:
        parts.append(Part("sleep level 1 frees", "vllm", -(share - asleep), "weights offloaded to CPU RAM, KV cache dropped, during each step"))
    return parts, share, asleep, kv


def plan(shape: ModelShape | str | os.PathLike[str], settings: PlanSettings = PlanSettings(), *, suggest: bool = True) -> MemoryPlan:
    """The memory plan of ``shape`` (or a model folder / built-in name) run with ``settings``."""
    if not isinstance(shape, ModelShape):
        shape = load_shape(shape)
    t_parts, resident, peak = trainer_parts(shape, settings)
    v_parts, awake, asleep, kv = vllm_parts(shape, settings)
    per_token = kv_bytes_per_token(shape, settings.dtype_bytes, settings.tp if settings.device == "cuda" else 1)
    capacity = settings.gpu_memory_bytes
    problems = []
    during_step = peak + (asleep if settings.sleeps else awake)
    if during_step > capacity:
        problems.append(f"a training step needs {_gib(during_step)} ({'vLLM asleep' if settings.sleeps else 'inference beside it' if settings.inference else 'training only'}) of {_gib(capacity)}")
    if settings.inference == "vllm":
        if resident + awake > capacity:
            problems.append(f"the trainer between steps ({_gib(resident)}) and vLLM awake ({_gib(awake)}) exceed {_gib(capacity)}")
        if kv < settings.max_model_len * per_token:
            problems.append(
                f"vLLM's KV cache ({_gib(kv)}) holds {kv // max(per_token, 1)} tokens, less than one max_model_len={settings.max_model_len} sequence"
            )
    result = MemoryPlan(shape, settings, tuple(t_parts + v_parts), resident, peak, awake, asleep, kv, per_token, capacity, tuple(problems))
    if problems and suggest:
        result = replace(result, suggestion=one_change(shape, settings))
    return result


def one_change(shape: ModelShape, settings: PlanSettings) -> str:
    """The one setting that makes ``settings`` fit, tried in order of what costs least; or what is missing."""
    candidates: list[tuple[str, PlanSettings]] = []
    if not settings.gradient_checkpointing:
        candidates.append(("gradient_checkpointing=True", replace(settings, gradient_checkpointing=True)))
    tokens = settings.micro_batch_tokens // 2
    while tokens >= max(settings.seq_len, 256):
        candidates.append((f"micro_batch_tokens={tokens}", replace(settings, micro_batch_tokens=tokens)))
        tokens //= 2
    if settings.inference == "vllm" and settings.device == "cuda":
        for share in (0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45, 0.4, 0.35, 0.3, 0.25, 0.2, 0.15, 0.1, 0.95):
            if share != settings.gpu_memory_utilization:
                candidates.append((f"gpu_memory_utilization={share}", replace(settings, gpu_memory_utilization=share)))
    seq = settings.seq_len // 2
    while seq >= 512:
        candidates.append((f"max_seq_len={seq}", replace(settings, seq_len=seq, max_model_len=min(settings.max_model_len, seq))))
        seq //= 2
    if settings.dtype_bytes == 4:
        candidates.append(("dtype='bfloat16'", replace(settings, dtype="bfloat16")))
    if settings.device == "cuda" and settings.inference == "vllm":
        for gpus in (2, 4, 8):
            if gpus > settings.gpus:
                candidates.append((f"{gpus} GPUs (vLLM tensor_parallel_size={gpus})", replace(settings, gpus=gpus, tensor_parallel_size=gpus)))
    for text, changed in candidates:
        if plan(shape, changed, suggest=False).fits:
            return f"set {text}"
    return "no single setting makes it fit: use a GPU with more memory or a smaller model"


def _gib(value: int) -> str:
    return f"{value / GIB:.1f} GiB"


# -- printing -------------------------------------------------------------------------
def render(result: MemoryPlan) -> Any:
    """A rich renderable: the parts, then the verdict."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    s = result.settings
    where = f"{s.gpus} x {_gib(s.gpu_memory_bytes)} GPU" if s.device == "cuda" else f"CPU, {_gib(s.gpu_memory_bytes)} RAM"
    table = Table(title=f"{result.shape.name}: {result.shape.parameters / 1e9:.2f}B parameters on {where}", title_justify="left")
    for column in ("part", "of", "GiB", "from"):
        table.add_column(column, justify="right" if column == "GiB" else "left")
    for part in result.parts:
        table.add_row(part.name, part.owner, f"{part.bytes / GIB:.2f}", part.note)
    table.add_section()
    table.add_row("trainer between steps", "trainer", f"{result.trainer_resident / GIB:.2f}", "")
    table.add_row("trainer peak (a step)", "trainer", f"{result.trainer_peak / GIB:.2f}", "")
    if s.inference is not None:
        table.add_row("inference awake", "vllm", f"{result.vllm_awake / GIB:.2f}", f"KV cache: {result.kv_tokens} tokens" if s.inference == "vllm" else "")
        if s.sleeps:
            table.add_row("vLLM asleep", "vllm", f"{result.vllm_asleep / GIB:.2f}", "level 1, during each step")
    table.add_row("device peak", "", f"{result.peak / GIB:.2f}", f"of {result.capacity / GIB:.2f}")
    if result.fits:
        verdict = Text("fits", style="bold green")
    else:
        verdict = Text("does not fit: " + "; ".join(result.problems) + f". Change: {result.suggestion}", style="bold red")
    return Group(table, verdict)


def describe(result: MemoryPlan) -> str:
    """The plan as plain text (error messages, logs)."""
    from rich.console import Console

    console = Console(width=160, record=True, file=open(os.devnull, "w"), color_system=None)  # noqa: SIM115
    console.print(render(result))
    return console.export_text()


# -- at register ----------------------------------------------------------------------
def memory_available() -> tuple[int, int]:
    """(available, total) bytes of this machine's RAM (``/proc/meminfo``; psutil where there is none)."""
    try:
        values = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            values[key] = int(rest.split()[0]) * 1024
        return values["MemAvailable"], values["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        import psutil

        memory = psutil.virtual_memory()
        return int(memory.available), int(memory.total)


def check_at_register(model_path: str | os.PathLike[str], settings: PlanSettings, gpu_memory: list[tuple[int, int]] | None = None) -> MemoryPlan:
    """Before ``LocalBackend`` loads anything: raise :class:`PlanDoesNotFitError` when the run cannot fit.

    On a GPU the plan is checked against the GPU's total memory (``gpu_memory``: (free, total) per
    GPU, ``nvidia-smi``'s).  On a CPU a step must fit the machine's RAM; what stays loaded (the trainer
    between steps, vLLM) beyond what is available now is a warning, not a refusal: other processes'
    memory comes and goes."""
    if settings.device == "cuda":
        if not gpu_memory:
            from ..inference.devices import nvidia_smi_memory

            gpu_memory = nvidia_smi_memory()
        if not gpu_memory:
            return plan(model_path, settings, suggest=False)
        free, total = min(gpu_memory, key=lambda ft: ft[1])
        settings = replace(settings, gpus=min(settings.gpus, len(gpu_memory)), gpu_memory_bytes=total)
        result = plan(model_path, settings)
        need = result.peak
    else:
        free, total = memory_available()
        result = plan(model_path, replace(settings, gpu_memory_bytes=total))
        loaded = result.trainer_resident + result.vllm_awake
        if result.fits and loaded > free:  # other processes' memory comes and goes: said, not refused
            import logging

            logging.getLogger("tracerl").warning(
                "memory plan of %s: the trainer and its server hold ~%s between steps, and %s of RAM is available now",
                result.shape.name, _gib(loaded), _gib(free),
            )
        need = result.peak
    if not result.fits:
        raise PlanDoesNotFitError(
            f"{result.shape.name} cannot train here: {'; '.join(result.problems)}. Change: {result.suggestion} "
            f"(`tracerl plan` prints the same plan).\n{describe(result)}",
            free_bytes=int(free), total_bytes=int(total), need_bytes=int(need),
        )
    return result


def plan_json(result: MemoryPlan) -> str:
    return json.dumps(result.to_json(), indent=2)
