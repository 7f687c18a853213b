"""One GRPO optimisation step: tracerl's ``LoRATrainer.step`` vs TRL ``GRPOTrainer``'s, on the CPU.

Same model (SmolLM2-135M-Instruct, fp32), same LoRA (r=8, alpha=16, q/k/v/o/gate/up/down,
dropout 0), same batch: ``--sequences`` rows of ``--prompt-tokens`` prompt tokens followed by
``--completion-tokens`` sampled tokens (random ids, fixed seed, no padding), one group with
advantages +1/-1, no sampler logprobs (ratio 1), CISPO-style loss, grad-norm clip 0.1, AdamW.

What each side's timing covers (generation is excluded on both sides):

* tracerl: ``pack_sequences`` + ``LoRATrainer.step`` (forward over the whole sequences,
  chunked lm_head logprobs of the completion tokens, loss, backward, clip, AdamW step) —
  exactly what ``LocalBackend.train`` runs after tokenization.
* TRL: the part of a ``GRPOTrainer`` training step that follows generation and scoring:
  ``trainer.compute_loss`` on the prepared inputs dict ``_generate_and_score_completions``
  would return (prompt/completion ids and masks, advantages, ``num_items_in_batch``),
  ``accelerator.backward``, ``accelerator.clip_grad_norm_``, ``optimizer.step``, ``zero_grad``.
  The optimizer is the one the trainer creates itself (``create_optimizer``).

Each side runs in its own subprocess; peak RSS is that process's ``ru_maxrss`` (model load
included), so the two peaks never mix.  Seconds/step is the median of ``--steps`` timed steps
after ``--warmup`` untimed ones.

    flock /tmp/tracerl-heavy.lock .venv/bin/python bench/grpo_step.py [--sequences 8 --prompt-tokens 64 --completion-tokens 32 --steps 5]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time

from _sides import run_worker  # bench/ is on sys.path when a script runs

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR = 1e-5
MAX_GRAD_NORM = 0.1


def make_batch(args: argparse.Namespace, vocab: int):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, vocab - 1, (args.sequences, args.prompt_tokens + args.completion_tokens), generator=g)
    if not args.distinct_prompts:  # GRPO: every completion of a group answers the same prompt
        ids[:, : args.prompt_tokens] = ids[0, : args.prompt_tokens]
    advantages = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(args.sequences)])
    return ids, advantages


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_ours(args: argparse.Namespace, model_path: str) -> dict:
    import torch

    from tracerl.grpo import LossFn, equal_trajectory_weights
    from tracerl.packing import pack_sequences
    from tracerl.tokenization import TrainingSequence
    from tracerl.trainer import LoRASettings, LoRATrainer, StepConfig

    trainer = LoRATrainer(model_path, lora=LoRASettings(r=args.r, alpha=args.alpha, dropout=0.0), device="cpu")
    vocab = trainer.model.get_base_model().config.vocab_size
    ids, advantages = make_batch(args, vocab)
    P, C = args.prompt_tokens, args.completion_tokens
    sequences = [
        TrainingSequence(
            token_ids=ids[i].tolist(),
            weights=[0.0] * P + [1.0] * C,
            old_logprobs=[float("nan")] * (P + C),
            trajectory_index=i,
            group_index=0,
            advantage=float(advantages[i]),
        )
        for i in range(args.sequences)
    ]
    weights = equal_trajectory_weights([s.num_trainable for s in sequences])
    config = StepConfig(learning_rate=LR, loss_fn=LossFn.CISPO, max_grad_norm=MAX_GRAD_NORM)
    rss_loaded = peak_rss_mb()
    times, metrics = [], {}
    for i in range(args.warmup + args.steps):
        started = time.perf_counter()
        batches = pack_sequences(sequences, weights, max_tokens=args.micro_batch_tokens, pad_token_id=0)
        metrics = trainer.step(batches, config)
        elapsed = time.perf_counter() - started
        if i >= args.warmup:
            times.append(elapsed)
    return {
        "times": times,
        "peak_rss_mb": peak_rss_mb(),
        "rss_after_load_mb": rss_loaded,
        "loss": metrics.get("loss"),
        "grad_norm": metrics.get("grad_norm"),
        "micro_batches": len(batches),
        "torch_threads": torch.get_num_threads(),
    }


def run_trl(args: argparse.Namespace, model_path: str) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    peft_config = LoraConfig(r=args.r, lora_alpha=args.alpha, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=args.sequences,
            num_generations=args.sequences,
            max_completion_length=args.completion_tokens,
            learning_rate=LR,
            lr_scheduler_type="constant",
            adam_beta2=0.99,
            weight_decay=0.0,
            max_grad_norm=MAX_GRAD_NORM,
            loss_type="cispo",
            epsilon_high=5.0,  # TRL's CISPO clamps the ratio at epsilon_high; tracerl's at 1 + 4.0
            beta=0.0,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,
            use_cpu=True,
            report_to=[],
            logging_steps=1000,
            save_strategy="no",
            max_steps=args.warmup + args.steps,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=config,
            train_dataset=Dataset.from_dict({"prompt": ["hello"] * args.sequences}),
            processing_class=tokenizer,
            peft_config=peft_config,
        )
        trainer.create_optimizer()
        optimizer = trainer.optimizer
        model = trainer.model
        model.train()
        trainer.current_gradient_accumulation_steps = 1
        vocab = model.get_base_model().config.vocab_size if hasattr(model, "get_base_model") else model.config.vocab_size
        ids, advantages = make_batch(args, vocab)
        P, C = args.prompt_tokens, args.completion_tokens
        inputs = {
            "prompt_ids": ids[:, :P],
            "prompt_mask": torch.ones(args.sequences, P, dtype=torch.long),
            "completion_ids": ids[:, P:],
            "completion_mask": torch.ones(args.sequences, C, dtype=torch.long),
            "advantages": advantages,
            "num_items_in_batch": torch.tensor(float(args.sequences * C)),
        }
        params = [p for p in model.parameters() if p.requires_grad]
        rss_loaded = peak_rss_mb()
        times, loss = [], None
        for i in range(args.warmup + args.steps):
            started = time.perf_counter()
            loss = trainer.compute_loss(model, inputs)
            trainer.accelerator.backward(loss)
            grad_norm = trainer.accelerator.clip_grad_norm_(params, MAX_GRAD_NORM)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - started
            if i >= args.warmup:
                times.append(elapsed)
        return {
            "times": times,
            "peak_rss_mb": peak_rss_mb(),
            "rss_after_load_mb": rss_loaded,
            "loss": float(loss.detach()),
            "grad_norm": float(grad_norm),
            "trainable_params": sum(p.numel() for p in params),
            "optimizer": type(optimizer).__name__,
            "torch_threads": torch.get_num_threads(),
        }


def worker(args: argparse.Namespace) -> None:
    from tracerl.base_models import resolve_base_model

    model_path = str(resolve_base_model(args.model))
    result = run_ours(args, model_path) if args.worker == "tracerl" else run_trl(args, model_path)
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--completion-tokens", type=int, default=32)
    p.add_argument("--r", type=int, default=8)
    p.add_argument("--alpha", type=int, default=16)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--micro-batch-tokens", type=int, default=4096, help="tracerl packing budget (LocalBackend's default)")
    p.add_argument("--sides", default="tracerl,trl")
    p.add_argument("--distinct-prompts", action="store_true", help="give every row its own random prompt (not a GRPO group)")
    p.add_argument("--json", default=None, help="also write the raw results here")
    p.add_argument("--worker", choices=["tracerl", "trl"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return

    results = {}
    for side in args.sides.split(","):
        results[side] = run_worker(__file__, side)
        r = results[side]
        print(f"  {side}: steps {', '.join(f'{t:.2f}' for t in r['times'])} s; peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)

    tokens = args.sequences * (args.prompt_tokens + args.completion_tokens)
    print()
    print(
        f"batch: {args.sequences} sequences x ({args.prompt_tokens} prompt + {args.completion_tokens} completion) tokens "
        f"= {tokens} tokens, {args.sequences * args.completion_tokens} trained; LoRA r={args.r} alpha={args.alpha}, fp32, CPU; "
        f"median of {args.steps} steps after {args.warmup} warm-up"
    )
    base = results.get("tracerl")
    print()
    print("| side | s/step (median) | min–max | tokens/s | peak RSS (MB) | RSS after load (MB) | s/step ratio vs tracerl | RSS ratio vs tracerl |")
    print("|---|---|---|---|---|---|---|---|")
    for side, r in results.items():
        med = statistics.median(r["times"])
        ratio_t = f"{med / statistics.median(base['times']):.2f}x" if base else "–"
        ratio_m = f"{r['peak_rss_mb'] / base['peak_rss_mb']:.2f}x" if base else "–"
        name = "tracerl `LoRATrainer.step`" if side == "tracerl" else "TRL 1.16 `GRPOTrainer` (compute_loss+backward+step)"
        print(
            f"| {name} | {med:.2f} | {min(r['times']):.2f}–{max(r['times']):.2f} | {tokens / med:.0f} | "
            f"{r['peak_rss_mb']:.0f} | {r['rss_after_load_mb']:.0f} | {ratio_t} | {ratio_m} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
