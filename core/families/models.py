"""Randomly initialised models of each family's real architecture, with the family's real tokenizer.

No weights can be downloaded here, yet tracerl must be checked on the families users train.  The
architecture is what serving, token accounting and training touch (the attention layout, tied or
separate embeddings, mixture-of-experts layers, sliding windows), and ``transformers`` ships each
family's model class; the tokenizer and chat template are the real ones (:mod:`.files`).  So
:func:`write_random_model` saves a model of the family's class whose configuration keeps the real
model's structural settings (:data:`ARCHITECTURES`) and shrinks its width and depth (:data:`SHAPES`),
next to the family's tokenizer, as a folder ``TrainableModel(base_model=folder)`` loads.  Random
weights check plumbing, never quality: their sampled text is noise, so a test drives a family's
turns by scoring the conversation's own tokens through the serving path (forced decoding).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .files import family_dir, is_installed, last_failure

__all__ = ["ARCHITECTURES", "SHAPES", "Architecture", "stop_token_ids", "write_random_model"]


@dataclass(frozen=True)
class Architecture:
    """A family's ``transformers`` classes, the settings of its real configuration kept when shrunk,
    and the tokens that end an assistant turn."""

    config: str
    model: str
    real: dict[str, Any] = field(default_factory=dict)
    """Structural settings of the real model's ``config.json`` (named after it in ``source``)."""
    stops: tuple[str, ...] = ()
    """Tokens that end a sampled turn (the server stops on them; the trained completion ends with one)."""
    source: str = ""


ARCHITECTURES: dict[str, Architecture] = {
    "qwen3": Architecture("Qwen3Config", "Qwen3ForCausalLM", {"rope_theta": 1_000_000.0, "tie_word_embeddings": True},
                          ("<|im_end|>",), "Qwen/Qwen3-0.6B"),
    "qwen2.5": Architecture("Qwen2Config", "Qwen2ForCausalLM", {"rope_theta": 1_000_000.0, "tie_word_embeddings": True},
                            ("<|im_end|>",), "Qwen/Qwen2.5-0.5B-Instruct"),
    "gemma3": Architecture("Gemma3TextConfig", "Gemma3ForCausalLM",
                           {"rope_theta": 1_000_000.0, "tie_word_embeddings": True, "sliding_window": 512,
                            "layer_types": ["sliding_attention", "full_attention"]},
                           ("<end_of_turn>",), "google/gemma-3-1b-it"),
    "gptoss": Architecture("GptOssConfig", "GptOssForCausalLM",
                           {"rope_theta": 150_000.0, "tie_word_embeddings": False, "sliding_window": 128,
                            "num_local_experts": 4, "num_experts_per_tok": 2,
                            "layer_types": ["sliding_attention", "full_attention"]},
                           ("<|return|>", "<|call|>"), "openai/gpt-oss-20b (32 experts, 4 per token: here 4 and 2)"),
    "llama3": Architecture("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 500_000.0, "tie_word_embeddings": True},
                           ("<|eot_id|>", "<|eom_id|>"), "meta-llama/Llama-3.2-1B-Instruct"),
    "mistral": Architecture("MistralConfig", "MistralForCausalLM", {"rope_theta": 1_000_000.0, "tie_word_embeddings": False},
                            ("</s>",), "mistralai/Mistral-Nemo-Instruct-2407"),
}  # fmt: skip
"""Each family of :data:`tracerl.families.files.FAMILIES`: its classes and its real structural settings."""

SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16},
    "tiny32": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 32},  # tiny with head_dim 32: the least vLLM's CPU attention takes
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "head_dim": 64},  # Qwen2.5-0.5B's
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "head_dim": 128},  # Qwen2.5-1.5B's
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128},  # Llama-3.1-8B's
}  # fmt: skip
"""Widths and depths a random model is given (the vocabulary stays the tokenizer's): ``tiny`` for
tests, the others for ``bench/gpu_check.py --families`` (gpt-oss's experts multiply its MLP
parameters by 4, and Gemma 3's 262k vocabulary adds embedding rows); ``tiny32`` for vLLM on CPU, whose
attention takes no head_dim under 32 (``bench/agreement_vllm.py``)."""


def stop_token_ids(tokenizer: Any, family: str) -> list[int]:
    """The ids of ``family``'s end-of-turn tokens in ``tokenizer``."""
    return [int(tokenizer.convert_tokens_to_ids(token)) for token in ARCHITECTURES[family].stops]


def write_random_model(
    family: str, folder: str | Path, *, shape: str = "tiny", seed: int = 0, dtype: str = "float32", device: str = "cpu",
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Save a randomly initialised ``family`` model (``shape``) and the family's tokenizer to ``folder``.

    The weights are fp32, or ``dtype`` (``"bfloat16"`` on a GPU); ``device`` is where they are
    initialised (a GPU initialises billions of parameters in seconds).  ``overrides``: configuration
    settings over the family's (a shrunk ``sliding_window``, a larger ``initializer_range`` for
    sharper random logits).  Raises
    ``FileNotFoundError`` naming the set-up step when the family's files are not installed."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    if family not in ARCHITECTURES:
        raise KeyError(f"unknown family {family!r}; known: {', '.join(ARCHITECTURES)}")
    if shape not in SHAPES:
        raise KeyError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    if not is_installed(family):
        reason = last_failure(family) or "not fetched yet"
        raise FileNotFoundError(f"the {family} tokenizer is not installed ({reason}): run make install-model-files")
    architecture = ARCHITECTURES[family]
    folder = Path(folder)
    tokenizer = AutoTokenizer.from_pretrained(family_dir(family))
    stops = stop_token_ids(tokenizer, family)
    vocab = -(-len(tokenizer) // 64) * 64  # real checkpoints pad their embedding rows too
    settings = {**SHAPES[shape], **architecture.real, **(overrides or {})}
    config = getattr(transformers, architecture.config)(
        vocab_size=vocab, eos_token_id=stops, pad_token_id=tokenizer.pad_token_id or stops[0],
        bos_token_id=tokenizer.bos_token_id, **settings,
    )  # fmt: skip
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, architecture.model)(config).to(getattr(torch, dtype))
    model.generation_config.eos_token_id = stops
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
