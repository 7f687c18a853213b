"""SFT on the same data and LoRA: tracerl's ``run_sft`` vs TRL's ``SFTTrainer``, on the CPU.

Same model (SmolLM2-135M-Instruct, fp32), same LoRA (r=8, alpha=16, q/k/v/o/gate/up/down,
dropout 0), same examples (``--examples`` single-turn chat records: a system prompt, a
question, a one-sentence answer; only the answer and its end-of-turn token are trained), same
order (no shuffling), same batch size, constant learning rate, AdamW (betas 0.9/0.99, no
weight decay), grad-norm clip 1.0, per-token loss normalisation on both sides.

* tracerl: ``tracerl.train.sft.prepare`` (chat template, tokenization) + ``tracerl.train.sft.run_sft``
  (GRPO's packer: several examples per row, block-diagonal mask, the shared system prompt
  computed once; ``LoRATrainer.apply_update``) — what ``LocalBackend.train_sft`` runs before
  committing the checkpoint.
* TRL: ``SFTTrainer.train()`` on a prompt/completion conversational dataset
  (``completion_only_loss``), padded batches (TRL's default, ``packing=False``).

Timed: the training loop only (model loading excluded on both sides; TRL's dataset
tokenization happens in its constructor, outside the timing, ours inside it).  Tokens/s is
``epochs × Σ example lengths / seconds``: the same numerator for both sides.  Each side runs
in its own subprocess; its peak memory is the ``ru_maxrss`` of that process and of any it
started (the largest process of its tree, model load included), so the two never mix.  The per-step losses are printed side by side.

    flock /tmp/tracerl-heavy.lock .venv/bin/python bench/sft_step.py [--examples 48 --batch-size 8 --epochs 1]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time

from _sides import run_worker  # bench/ is on sys.path when a script runs

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SYSTEM = "You are a concise assistant. Answer the question in one short sentence, stating the number."


def records(n: int) -> list[dict]:
    """Arithmetic facts: deterministic, varied lengths, one trained assistant turn each."""
    out = []
    for i in range(n):
        a, b = 17 + 31 * i % 400, 5 + 13 * i % 300
        out.append(
            {
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"What is {a} plus {b}?" + (" Please be brief." if i % 3 else "")},
                    {"role": "assistant", "content": f"{a} plus {b} is {a + b}." + (" That is the sum." if i % 2 else "")},
                ]
            }
        )
    return out


def run_ours(args: argparse.Namespace, model_path: str) -> dict:
    import torch
    from transformers import AutoTokenizer

    from tracerl.train.sft import prepare, run_sft
    from tracerl.train.sft_config import SFTConfig
    from tracerl.train.sft_data import as_sft_examples
    from tracerl.train.trainer import LoRASettings, LoRATrainer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    trainer = LoRATrainer(model_path, lora=LoRASettings(r=args.r, alpha=args.alpha, target_modules=tuple(TARGETS)))
    config = SFTConfig(
        learning_rate=args.lr, batch_size=args.batch_size, epochs=args.epochs, shuffle=False, max_grad_norm=1.0, show_progress=False
    )
    examples = as_sft_examples(records(args.examples))
    started = time.perf_counter()
    run = prepare(tokenizer, examples, [], config, None)
    losses: list[float] = []
    original = trainer.apply_update

    def recording(*a, **kw):
        result = original(*a, **kw)
        losses.append(float(result[0]))
        return result

    trainer.apply_update = recording  # type: ignore[method-assign]
    metrics = run_sft(trainer, run, config, max_tokens=args.micro_batch_tokens, pad_token_id=tokenizer.pad_token_id or 0)
    seconds = time.perf_counter() - started
    lengths = [len(s.token_ids) for ex in run.train for s in ex]
    first = run.train[0][0]
    trained_text = tokenizer.decode([t for t, w in zip(first.token_ids, first.weights) if w])
    return {
        "seconds": seconds,
        "losses": losses,
        "example_tokens": sum(lengths) * args.epochs,
        "trained_tokens": metrics["trained_tokens"],
        "first_example_trained_text": trained_text,
        "forward_tokens": metrics["forward_tokens"],
        "optimizer_steps": metrics["optimizer_steps"],
        "torch_threads": torch.get_num_threads(),
    }


def run_trl(args: argparse.Namespace, model_path: str) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    peft_config = LoraConfig(r=args.r, lora_alpha=args.alpha, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    rows = records(args.examples)
    dataset = Dataset.from_list([{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in rows])
    losses: list[float] = []

    class Losses(TrainerCallback):
        def on_log(self, _args, _state, _control, logs=None, **kwargs):  # noqa: ANN001
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    with tempfile.TemporaryDirectory() as out:
        config = SFTConfig(
            output_dir=out,
            per_device_train_batch_size=args.batch_size,
            num_train_epochs=args.epochs,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            adam_beta2=0.99,
            weight_decay=0.0,
            max_grad_norm=1.0,
            completion_only_loss=True,
            packing=False,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,
            use_cpu=True,
            report_to=[],
            logging_steps=1,
            save_strategy="no",
            dataloader_num_workers=0,
            seed=0,
        )
        trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config, callbacks=[Losses()])
        trainer.train_dataset = trainer.train_dataset  # tokenized in the constructor (not timed)
        lengths = [len(ids) for ids in trainer.train_dataset["input_ids"]]
        # labels are -100 on what is not trained; the label at position i is the token at i (shifted inside the loss)
        trained = sum(sum(1 for label in labels if label != -100) for labels in trainer.train_dataset["labels"]) * args.epochs
        first = trainer.train_dataset[0]
        trained_text = tokenizer.decode([t for t, label in zip(first["input_ids"], first["labels"]) if label != -100])
        from torch.utils.data import SequentialSampler

        trainer._get_train_sampler = lambda *a, **kw: SequentialSampler(trainer.train_dataset)  # same order as ours
        started = time.perf_counter()
        output = trainer.train()
        seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "losses": losses,
        "example_tokens": sum(lengths) * args.epochs,
        "trained_tokens": float(trained),
        "first_example_trained_text": trained_text,
        "optimizer_steps": float(output.global_step),
        "torch_threads": torch.get_num_threads(),
    }


def worker(args: argparse.Namespace) -> None:
    from tracerl.base_models import resolve_base_model

    model_path = str(resolve_base_model(args.model))
    result = run_ours(args, model_path) if args.worker == "tracerl" else run_trl(args, model_path)
    # this process and any it started (none expected): the peak of its process tree, model load included
    tree = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    result["peak_rss_mb"] = tree / 1024  # Linux: KiB
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--examples", type=int, default=48)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--r", type=int, default=8)
    p.add_argument("--alpha", type=int, default=16)
    p.add_argument("--micro-batch-tokens", type=int, default=2048, help="tracerl packing budget (LocalBackend's default)")
    p.add_argument("--sides", default="tracerl,trl")
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
        print(f"  {side}: {r['seconds']:.1f} s, {r['optimizer_steps']:.0f} steps, peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)

    print()
    print(
        f"data: {args.examples} single-turn chat examples, batch {args.batch_size}, {args.epochs} epoch(s), lr {args.lr} constant; "
        f"LoRA r={args.r} alpha={args.alpha}, fp32, CPU"
    )
    print()
    print("| side | seconds | optimizer steps | example tokens | trained tokens | example tokens/s | peak RSS of its process tree (MB) | first loss | last loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for side, r in results.items():
        name = "tracerl `train_sft` loop (packed)" if side == "tracerl" else "TRL 1.16 `SFTTrainer.train()` (padded)"
        print(
            f"| {name} | {r['seconds']:.1f} | {r['optimizer_steps']:.0f} | {r['example_tokens']} | {r['trained_tokens']:.0f} | "
            f"{r['example_tokens'] / r['seconds']:.0f} | "
            f"{r['peak_rss_mb']:.0f} | {r['losses'][0]:.4f} | {r['losses'][-1]:.4f} |"
        )
    for side, r in results.items():
        print(f"{side} trains, in the first example: {r['first_example_trained_text']!r}")
    print()
    sides = list(results)
    print("| optimizer step | " + " | ".join(f"{s} loss" for s in sides) + " |")
    print("|---" * (len(sides) + 1) + "|")
    for i in range(max(len(results[s]["losses"]) for s in sides)):
        cells = [f"{results[s]['losses'][i]:.4f}" if i < len(results[s]["losses"]) else "" for s in sides]
        print(f"| {i + 1} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
