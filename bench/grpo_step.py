"""One GRPO optimisation step: tracerl's ``LoRATrainer.step`` vs TRL ``GRPOTrainer``'s, on the CPU, side by side.

Every side is one long-lived worker process; the parent drives them in turn, step ``i`` of
every side before step ``i + 1`` of any (the order rotates each round), so the shared
machine's drift spreads over all sides instead of landing on whichever ran last.

Sides (same model: SmolLM2-135M-Instruct fp32; same LoRA: r=8, alpha=16 on
q/k/v/o/gate/up/down, dropout 0; CISPO-style loss, grad-norm clip 0.1, AdamW, lr 1e-5):

* ``tracerl-shared``: the GRPO batch, ``--sequences`` completions of ONE prompt (a group).
  tracerl packs the prompt once followed by every completion (a 4-D mask keeps siblings
  apart), so it computes ``prompt + sequences x completion`` positions.
* ``tracerl-distinct``: the equal-work batch, every row its own random prompt: tracerl
  computes every position, like TRL.
* ``trl-gc``: TRL 1.16 ``GRPOTrainer`` with its own defaults: gradient checkpointing ON and
  ``--trl-gc-batch`` (TRL's default ``per_device_train_batch_size``, 8) rows per micro-batch.
* ``trl-nogc``: the same with gradient checkpointing OFF (TRL's fastest setting) and
  ``--trl-nogc-batch`` (4) rows per micro-batch, gradient accumulation over the group: 16
  rows in one batch without checkpointing peaked at ~20 GB on this 23 GiB machine, and
  accumulation gives the same gradient (TRL's loss is normalised over the whole group).

TRL computes every row's prompt whatever it contains, so both TRL sides are fed the GRPO
batch; their figures hold for the distinct batch too (same shapes, same work).

What each side's timing covers (generation excluded on both sides):

* tracerl: ``pack_sequences`` + ``LoRATrainer.step`` (forward over the packed rows, chunked
  lm_head logprobs of the completion tokens, loss, backward, clip, AdamW step): what
  ``LocalBackend.train`` runs after tokenization.
* TRL: what a ``GRPOTrainer`` training step does after ``_generate_and_score_completions``:
  for each micro-batch ``trainer.compute_loss`` on the prepared inputs (prompt/completion
  ids and masks, advantages, ``num_items_in_batch`` over the whole group) and
  ``accelerator.backward``; then ``accelerator.clip_grad_norm_``, ``optimizer.step`` (the
  trainer's own ``create_optimizer``), ``zero_grad``.  Gradient checkpointing is switched on
  the way ``Trainer.train`` does it (``activation_checkpointing_enable``).

Memory: the peak summed RSS of each worker's process tree, sampled every 0.2 s by the parent
(``serving_speed.TreeRSS``), and the worker's own ``ru_maxrss`` (exact, model load included);
the table shows the larger.  Between its steps a worker returns freed heap to the OS
(``malloc_trim``) so that idle sides do not crowd the one running.

Ceiling (``bench/ceiling.py``) is measured in this invocation before and after the rounds.
% of ceiling = 4 x P x computed tokens / (s/step) over the ceiling's best fp32 matmul
GFLOP/s, P = the base model's parameters (134.5M): a LoRA step costs forward 2P + backward 2P
FLOPs per computed position (the activation gradients through the frozen weights; the frozen
weights get no gradients of their own, full fine-tuning's other 2P); attention's quadratic
term, the checkpoint recompute and LoRA's own matmuls are not counted.  "Computed tokens" are
the positions the model runs (padding included); "logical tokens" are the batch's
``sequences x (prompt + completion)``.

    flock /tmp/tracerl-heavy.lock .venv/bin/python bench/grpo_step.py --sequences 16 --prompt-tokens 300 --completion-tokens 40 --steps 5 --warmup 1 --json bench/results/grpo_step.json
    .venv/bin/python bench/grpo_step.py --table-only bench/results/grpo_step.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR = 1e-5
MAX_GRAD_NORM = 0.1
LORA_STEP_FLOPS_PER_PARAMETER = 4
"""FLOPs per base parameter per computed token of a LoRA step: forward 2 + activation gradients 2."""
SIDES = ("tracerl-shared", "tracerl-distinct", "trl-gc", "trl-nogc")
LABELS = {
    "tracerl-shared": "tracerl `LoRATrainer.step`, GRPO batch (prompt shared)",
    "tracerl-distinct": "tracerl `LoRATrainer.step`, equal work (distinct prompts)",
    "trl-gc": "TRL 1.16 `GRPOTrainer`, its default: gradient checkpointing on",
    "trl-nogc": "TRL 1.16 `GRPOTrainer`, gradient checkpointing off",
}


# --- the batch ---------------------------------------------------------------------------
def make_batch(args: argparse.Namespace, vocab: int, distinct: bool):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, vocab - 1, (args.sequences, args.prompt_tokens + args.completion_tokens), generator=g)
    if not distinct:  # GRPO: every completion of a group answers the same prompt
        ids[:, : args.prompt_tokens] = ids[0, : args.prompt_tokens]
    advantages = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(args.sequences)])
    return ids, advantages


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def trim_heap() -> None:
    """Give freed heap back to the OS, so an idle side holds only what it still uses."""
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


# --- the sides (each builds a ``step() -> metrics`` closure) -------------------------------
def build_tracerl(args: argparse.Namespace, model_path: str, distinct: bool) -> tuple[Any, dict[str, Any]]:
    from tracerl.train.grpo import LossFn, equal_trajectory_weights
    from tracerl.train.packing import pack_sequences
    from tracerl.train.tokenization import TrainingSequence
    from tracerl.train.trainer import LoRASettings, LoRATrainer, StepConfig

    trainer = LoRATrainer(model_path, lora=LoRASettings(r=args.r, alpha=args.alpha, dropout=0.0), device="cpu")
    base = trainer.model.get_base_model()
    ids, advantages = make_batch(args, base.config.vocab_size, distinct)
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
    probe = pack_sequences(sequences, weights, max_tokens=args.micro_batch_tokens, pad_token_id=0)
    info = {
        "computed_tokens": sum(int(b.input_ids_BT.numel()) for b in probe),
        "real_tokens_in_rows": sum(b.num_tokens for b in probe),
        "micro_batches": len(probe),
        "base_parameters": sum(p.numel() for n, p in trainer.model.named_parameters() if "lora_" not in n),
    }

    def step() -> dict[str, Any]:
        batches = pack_sequences(sequences, weights, max_tokens=args.micro_batch_tokens, pad_token_id=0)
        metrics = trainer.step(batches, config)
        return {"loss": metrics.get("loss"), "grad_norm": metrics.get("grad_norm")}

    return step, info


def build_trl(args: argparse.Namespace, model_path: str, checkpointing: bool, out: str) -> tuple[Any, dict[str, Any]]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    rows = args.trl_gc_batch if checkpointing else args.trl_nogc_batch
    if args.sequences % rows:
        raise SystemExit(f"--sequences {args.sequences} is not a multiple of the TRL micro-batch {rows}")
    accumulation = args.sequences // rows
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    peft_config = LoraConfig(r=args.r, lora_alpha=args.alpha, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    options: dict[str, Any] = {} if checkpointing else {"gradient_checkpointing": False}  # on: TRL's own default
    config = GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=rows,
        gradient_accumulation_steps=accumulation,
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
        use_cpu=True,
        report_to=[],
        logging_steps=1000,
        save_strategy="no",
        max_steps=args.warmup + args.steps,
        **options,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=config,
        train_dataset=Dataset.from_dict({"prompt": ["hello"] * args.sequences}),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    model = trainer.model
    if trainer.args.activation_checkpointing:  # what `Trainer.train` does before its loop
        kwargs = dict(trainer.args.activation_checkpointing_kwargs or {})
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None)
    trainer.create_optimizer()
    optimizer = trainer.optimizer
    model.train()
    trainer.current_gradient_accumulation_steps = accumulation
    base = model.get_base_model()
    ids, advantages = make_batch(args, base.config.vocab_size, distinct=False)
    P, C = args.prompt_tokens, args.completion_tokens
    total_items = torch.tensor(float(args.sequences * C))
    chunks = [
        {
            "prompt_ids": ids[s : s + rows, :P],
            "prompt_mask": torch.ones(rows, P, dtype=torch.long),
            "completion_ids": ids[s : s + rows, P:],
            "completion_mask": torch.ones(rows, C, dtype=torch.long),
            "advantages": advantages[s : s + rows],
            "num_items_in_batch": total_items,  # TRL: it spans the generation batch (the group)
        }
        for s in range(0, args.sequences, rows)
    ]
    params = [p for p in model.parameters() if p.requires_grad]
    info = {
        "computed_tokens": args.sequences * (P + C),
        "micro_batches": accumulation,
        "rows_per_micro_batch": rows,
        "gradient_checkpointing": bool(trainer.args.activation_checkpointing),
        "checkpointing_active": bool(base.is_activation_checkpointing),
        "base_parameters": sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n),
        "trainable_params": sum(p.numel() for p in params),
        "optimizer": type(optimizer).__name__,
    }

    def step() -> dict[str, Any]:
        total = 0.0
        for inputs in chunks:
            loss = trainer.compute_loss(model, inputs)
            trainer.accelerator.backward(loss)  # TRL's CISPO loss is already scaled for accumulation
            total += float(loss.detach())
        grad_norm = trainer.accelerator.clip_grad_norm_(params, MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {"loss": total, "grad_norm": float(grad_norm)}

    return step, info


def worker(args: argparse.Namespace) -> None:
    """Load one side, say READY, then run one step per ``step`` line on stdin; ``end`` prints RESULT."""
    import torch

    from tracerl.base_models import resolve_base_model

    model_path = str(resolve_base_model(args.model))
    with tempfile.TemporaryDirectory() as out:
        if args.worker.startswith("tracerl"):
            step, info = build_tracerl(args, model_path, distinct=args.worker == "tracerl-distinct")
        else:
            step, info = build_trl(args, model_path, checkpointing=args.worker == "trl-gc", out=out)
        info.update(rss_after_load_mb=peak_rss_mb(), torch_threads=torch.get_num_threads())
        trim_heap()
        print("READY " + json.dumps(info), flush=True)
        steps = []
        for line in sys.stdin:
            if line.strip() != "step":
                break
            cpu, started = time.process_time(), time.perf_counter()
            metrics = step()
            metrics.update(seconds=time.perf_counter() - started, cpu_seconds=time.process_time() - cpu)
            steps.append(metrics)
            trim_heap()
            metrics["rss_idle_mb"] = current_rss_mb()
            print("STEP " + json.dumps(metrics), flush=True)
        print("RESULT " + json.dumps({**info, "steps": steps, "ru_maxrss_mb": peak_rss_mb()}), flush=True)


# --- the parent: start the workers, drive them in turn ------------------------------------
class Worker:
    def __init__(self, side: str, argv: list[str], log_dir: Path) -> None:
        self.side = side
        self.log = open(log_dir / f"{side}.stderr", "w+")
        command = [sys.executable, os.path.abspath(__file__), "--worker", side, *argv]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)

    def read(self, prefix: str) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(prefix + " "):
                return json.loads(line[len(prefix) + 1 :])
        self.log.seek(0)
        raise SystemExit(f"{self.side} worker died (rc {self.process.wait()}):\n{self.log.read()[-6000:]}")

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Load the sides one by one, then drive them in rotated rounds; with ``--json``, save after every round."""
    from ceiling import describe, measure_ceiling
    from serving_speed import TreeRSS

    sides = [s for s in args.sides.split(",") if s]
    unknown = set(sides) - set(SIDES)
    if unknown:
        raise SystemExit(f"unknown side(s) {sorted(unknown)}; known: {SIDES}")
    log_dir = Path(tempfile.mkdtemp(prefix="tracerl-grpo-step-"))
    workers: dict[str, Worker] = {}
    monitors: dict[str, Any] = {}
    results: dict[str, dict[str, Any]] = {}
    result: dict[str, Any] = {
        "script": "bench/grpo_step.py",
        "argv": argv,
        "args": {k: v for k, v in vars(args).items() if k not in ("worker", "table_only")},
        "logical_tokens": args.sequences * (args.prompt_tokens + args.completion_tokens),
        "trained_tokens": args.sequences * args.completion_tokens,
        "order": "round r runs the sides rotated left by r",
        "complete": False,
        "load_average_per_round": [],
        "results": results,
    }

    def save() -> None:
        for side, r in results.items():
            monitors[side].sample()
            r["tree_peak_rss_mb"] = monitors[side].peak / 2**20
            r["times"] = [x["seconds"] for x in r["timed_steps"]]
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")

    try:
        for side in sides:  # one at a time, so loads do not compete
            print(f"loading {side} ...", flush=True)
            workers[side] = Worker(side, argv, log_dir)
            monitors[side] = TreeRSS(workers[side].process.pid).__enter__()
            results[side] = {**workers[side].read("READY"), "warmup_steps": [], "timed_steps": []}
        result["ceiling_before"] = measure_ceiling()
        print(describe(result["ceiling_before"]), flush=True)
        for round_index in range(args.warmup + args.steps):
            result["load_average_per_round"].append(list(os.getloadavg()))
            shift = round_index % len(sides)
            for side in sides[shift:] + sides[:shift]:
                workers[side].send("step")
                m = workers[side].read("STEP")
                warm = round_index < args.warmup
                results[side]["warmup_steps" if warm else "timed_steps"].append(m)
                tag = "warm-up" if warm else f"step {round_index - args.warmup + 1}"
                print(
                    f"  {tag:<8} {side:<17} {m['seconds']:7.2f} s  cpu {m['cpu_seconds']:6.1f} s  idle RSS {m['rss_idle_mb']:5.0f} MB"
                    f"  (load {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
            if round_index >= args.warmup:
                save()
        result["ceiling_after"] = measure_ceiling()
        print(describe(result["ceiling_after"]), flush=True)
        for side in sides:
            workers[side].send("end")
            results[side]["ru_maxrss_mb"] = workers[side].read("RESULT")["ru_maxrss_mb"]
            workers[side].process.wait(120)
            monitors[side].__exit__(None, None, None)
        result["complete"] = True
        save()
    finally:
        for w in workers.values():
            if w.process.poll() is None:
                w.process.kill()
                w.process.wait()
    return result


def table(result: dict[str, Any]) -> str:
    a = result["args"]
    ceiling = result["ceiling_before"]["matmul_gflops"]
    logical = result["logical_tokens"]
    results = result["results"]
    medians = {side: statistics.median(r["times"]) for side, r in results.items()}
    lines = [
        f"batch: {a['sequences']} sequences x ({a['prompt_tokens']} prompt + {a['completion_tokens']} completion) tokens "
        f"= {logical} logical tokens, {result['trained_tokens']} trained; LoRA r={a['r']} alpha={a['alpha']}, fp32, CPU; "
        f"median and min–max of {a['steps']} steps per side after {a['warmup']} warm-up, sides alternated; "
        f"ceiling {ceiling:.1f} GFLOP/s before the rounds, "
        + (f"{result['ceiling_after']['matmul_gflops']:.1f} after" if "ceiling_after" in result else "(run incomplete)"),
        "",
        "| side | micro-batches × rows | computed / logical tokens | s/step (median) | min–max | logical tokens/s | computed tokens/s "
        "| GFLOP/s (4·P·computed) | % of matmul ceiling | peak RSS of process tree (MB) | TRL ÷ tracerl: s/step | TRL ÷ tracerl: peak RSS |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for side, r in results.items():
        med = medians[side]
        computed = r["computed_tokens"]
        gflops = LORA_STEP_FLOPS_PER_PARAMETER * r["base_parameters"] * computed / med / 1e9
        peak = max(r["tree_peak_rss_mb"], r.get("ru_maxrss_mb", 0.0))
        shape = f"{r['micro_batches']} × {r.get('rows_per_micro_batch', '–')}" if "rows_per_micro_batch" in r else f"{r['micro_batches']} packed"
        ratios = []
        for ref in ("tracerl-distinct", "tracerl-shared"):
            if side.startswith("trl") and ref in results:
                rp = max(results[ref]["tree_peak_rss_mb"], results[ref].get("ru_maxrss_mb", 0.0))
                ratios.append(("equal work" if ref == "tracerl-distinct" else "GRPO batch", med / medians[ref], peak / rp))
        rt = ", ".join(f"{x:.2f}× ({n})" for n, x, _ in ratios) or "–"
        rm = ", ".join(f"{y:.2f}× ({n})" for n, _, y in ratios) or "–"
        lines.append(
            f"| {LABELS[side]} | {shape} | {computed:,} / {logical:,} | {med:.2f} | {min(r['times']):.2f}–{max(r['times']):.2f} "
            f"| {logical / med:.0f} | {computed / med:.0f} | {gflops:.1f} | {100 * gflops / ceiling:.1f}% | {peak:.0f} | {rt} | {rm} |"
        )
    return "\n".join(lines)


def local_backend_budget() -> int:
    """``LocalBackend``'s own ``micro_batch_tokens`` default: the budget the trainer really packs with."""
    import inspect

    from tracerl.train.local_backend import LocalBackend

    return int(inspect.signature(LocalBackend.__init__).parameters["micro_batch_tokens"].default)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--sequences", type=int, default=16, help="rows (the demo's step: 16 rollouts)")
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--completion-tokens", type=int, default=40)
    p.add_argument("--r", type=int, default=8)
    p.add_argument("--alpha", type=int, default=16)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--micro-batch-tokens", type=int, default=local_backend_budget(), help="tracerl packing budget (default: LocalBackend's)")
    p.add_argument("--trl-gc-batch", type=int, default=8, help="TRL rows per micro-batch with gradient checkpointing (TRL's default 8)")
    p.add_argument("--trl-nogc-batch", type=int, default=4, help="TRL rows per micro-batch without it (accumulated)")
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--json", default=None, help="also write the raw results here")
    p.add_argument("--table-only", default=None, metavar="JSON", help="print the table of a stored result and exit")
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.table_only:
        print(table(json.loads(Path(args.table_only).read_text())))
        return
    result = run(args, argv)
    print()
    print(table(result))


if __name__ == "__main__":
    main()
