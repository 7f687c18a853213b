"""Training on this machine: tokenization, packing, GRPO, the LoRA trainer, SFT, distillation, ``LocalBackend``.

Nothing here is imported by ``import tracerl``: torch and transformers load only when a
``LocalBackend`` (or a trainer) is created.  See ``docs/architecture.md``.
"""
