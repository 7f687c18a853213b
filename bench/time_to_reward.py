"""Time to reward: the calculator demo task trained by tracerl vs by TRL ``GRPOTrainer``.

Same base model (SmolLM2-135M-Instruct, fp32, CPU), LoRA (r=16, alpha=32, all 7 projections,
dropout 0), group size (``--rollouts``), groups per step, learning rate (1e-4, constant),
grad-norm clip 0.1, AdamW (beta2 0.99, no weight decay), CISPO-style loss, no KL, same train
and held-out tasks (``examples/demo.make_tasks``), same prompt tokens (the demo's system and
user messages and ``add`` tool rendered by the model's tool chat template).

* **tracerl** runs the demo's real multi-turn loop (``examples/demo.rollout``: tool call, tool
  result, final answer; reward up to 1.0) through ``LocalBackend`` (vLLM when its runtime is
  installed, else the transformers server: ``--inference``).
* **TRL** cannot run our multi-turn tool loop, so it trains the single-turn version: the same
  first-turn prompt, ``max_completion_length`` 40 (the demo's first-turn ``max_tokens``), and
  the first-turn part of the demo's reward (``demo.score_call`` on the text parsed with
  tracerl's Hermes tool-call parser: the first-turn part, 0.8 max, whatever the demo's
  current shaping is; its source hash is stored with the results).  Generation is TRL's own (transformers ``generate``; vLLM is not used on this CPU).

Both sides are compared on the same held-out metric: the **first-turn reward (0.8 max)** of a
greedy reply to each of ``--val-tasks`` fixed held-out tasks, measured before training and
every ``--eval-every`` steps.  The clock counts training only (rollouts/generation + update +
checkpoint/adapter swap); model loading / server start-up ("setup") and held-out evaluation
are measured but paused out.  A side stops at ``--target``, at ``--max-minutes`` of training
clock, or at ``--max-steps``.

Each side runs in its own subprocess.  Results are merged into ``--results`` (a JSON file), so
the sides can also be run one at a time (``--sides trl``) and the table printed from both.

    flock /tmp/tracerl-heavy.lock .venv/bin/python bench/time_to_reward.py --max-minutes 12 --target 0.5
    # or one side per locked command (each < 15 min), then the combined table:
    flock /tmp/tracerl-heavy.lock .venv/bin/python bench/time_to_reward.py --sides tracerl --max-minutes 8
    flock /tmp/tracerl-heavy.lock .venv/bin/python bench/time_to_reward.py --sides trl --max-minutes 8
    .venv/bin/python bench/time_to_reward.py --table-only --target 0.3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

LORA = {"r": 16, "alpha": 32}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def first_turn_score_text(text: str, task: dict) -> float:
    """The demo's first-turn reward for raw generated text (parsed like our servers parse it)."""
    import demo
    from tracerl.inference.tool_calls import parse_tool_calls

    parsed = parse_tool_calls(text)
    message = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls or None}
    return demo.score_call(SimpleNamespace(message=message), task)[0]


def score_call_sha1() -> str:
    """Which version of the demo's reward was used (the demo is still evolving)."""
    import hashlib
    import inspect

    import demo

    return hashlib.sha1((inspect.getsource(demo.score_call) + inspect.getsource(demo.format_pieces)).encode()).hexdigest()[:12]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Tracker:
    """Training clock (eval and setup paused out), evaluations, stop decision."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.train_seconds = 0.0
        self.evals: list[dict] = []
        self.train_rewards: list[float] = []
        self.reached_at: dict | None = None
        self.step = 0

    def record_eval(self, step: int, first_turn: float, full: float | None, eval_seconds: float) -> None:
        row = {"step": step, "train_seconds": round(self.train_seconds, 1), "heldout_first_turn": first_turn, "eval_seconds": round(eval_seconds, 1)}
        if full is not None:
            row["heldout_full"] = full
        self.evals.append(row)
        if self.reached_at is None and first_turn >= self.args.target - 1e-9:
            self.reached_at = row
        extra = f"  (full multi-turn {full:.3f})" if full is not None else ""
        print(
            f"[{self.args.worker}] step {step}: held-out first-turn reward {first_turn:.3f}{extra}  "
            f"train clock {self.train_seconds / 60:.1f} min  (eval {eval_seconds:.0f}s)",
            flush=True,
        )

    def should_stop(self) -> bool:
        return (
            self.reached_at is not None
            or self.train_seconds >= self.args.max_minutes * 60
            or self.step >= self.args.max_steps
        )

    def result(self, setup_seconds: float) -> dict:
        last = self.evals[-1] if self.evals else {}
        return {
            "setup_seconds": round(setup_seconds, 1),
            "train_seconds": round(self.train_seconds, 1),
            "steps": self.step,
            "reached": self.reached_at,
            "start_heldout_first_turn": self.evals[0]["heldout_first_turn"] if self.evals else None,
            "final_heldout_first_turn": last.get("heldout_first_turn"),
            "final_heldout_full": last.get("heldout_full"),
            "best_heldout_first_turn": max((e["heldout_first_turn"] for e in self.evals), default=None),
            "evals": self.evals,
            "train_rewards": self.train_rewards,
            "peak_rss_mb": round(peak_rss_mb()),
            "score_call_sha1": score_call_sha1(),
        }


# -- tracerl ----------------------------------------------------------------------------
async def run_tracerl(args: argparse.Namespace) -> dict:
    import demo
    import tracerl

    train_tasks = demo.make_tasks(args.seed, 400)
    val_tasks = demo.make_tasks(10_000 + args.seed, args.val_tasks)
    tracker = Tracker(args)
    data = tempfile.mkdtemp(prefix="ttr-tracerl-")
    model = tracerl.TrainableModel(f"ttr-s{args.seed}", "bench", args.base_model, base_path=data, lora_config=dict(LORA))
    backend = tracerl.LocalBackend(inference=args.inference)
    started = time.monotonic()
    await model.register(backend)
    setup = time.monotonic() - started
    print(f"[tracerl] serving {model.get_inference_name()} ({setup:.0f}s setup, inference={args.inference})", flush=True)

    async def evaluate(step: int) -> None:
        t = time.monotonic()
        groups = await demo.evaluate(model, val_tasks)
        trajectories = [g.trajectories[0] for g in groups]
        first = []
        for traj in trajectories:
            choice = next(item for item in traj.messages_and_choices if isinstance(item, tracerl.Choice))
            task = {"a": traj.metadata["a"], "b": traj.metadata["b"]}
            first.append(demo.score_call(choice, task)[0])
        n = len(val_tasks)  # failed rollouts count as 0
        tracker.record_eval(step, sum(first) / n, sum(t.reward for t in trajectories) / n, time.monotonic() - t)

    try:
        await evaluate(0)
        for batch in tracerl.iterate_dataset(train_tasks, groups_per_step=args.groups_per_step, num_epochs=100, use_tqdm=False):
            if tracker.should_stop():
                break
            t = time.monotonic()
            groups = await tracerl.gather_trajectory_groups(
                (
                    tracerl.TrajectoryGroup(
                        demo.rollout(model, task, temperature=1.0, seed=args.seed * 1_000_003 + batch.step * 997 + g * 31 + i)
                        for i in range(args.rollouts)
                    )
                    for g, task in enumerate(batch.items)
                ),
                pbar_desc=f"step {batch.step + 1}",
                max_exceptions=0.25,
            )
            result = await backend.train(model, groups, learning_rate=args.lr)
            tracker.train_seconds += time.monotonic() - t
            tracker.step = result.step
            rewards = [traj.reward for g in groups for traj in g]
            tracker.train_rewards.append(round(sum(rewards) / max(len(rewards), 1), 4))
            print(
                f"[tracerl] step {result.step}: train reward {tracker.train_rewards[-1]:.3f} (multi-turn, 1.0 max)  "
                f"trainable groups {result.metrics['num_groups_trainable']:.0f}/{len(groups)}  "
                f"{time.monotonic() - t:.0f}s/step  clock {tracker.train_seconds / 60:.1f} min",
                flush=True,
            )
            if result.step % args.eval_every == 0:
                await evaluate(result.step)
        if not tracker.evals or tracker.evals[-1]["step"] != tracker.step:
            await evaluate(tracker.step)
    finally:
        await backend.close()
    out = tracker.result(setup)
    out["inference"] = args.inference
    return out


# -- TRL --------------------------------------------------------------------------------
def run_trl(args: argparse.Namespace) -> dict:
    import demo
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tracerl.base_models import resolve_base_model

    started = time.monotonic()
    model_path = str(resolve_base_model(args.base_model))
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")

    def prompt_text(task: dict) -> str:
        messages = demo.first_turn_messages(task)
        return tokenizer.apply_chat_template(messages, tools=[demo.ADD_TOOL], tokenize=False, add_generation_prompt=True)

    train_tasks = demo.make_tasks(args.seed, 400)
    val_tasks = demo.make_tasks(10_000 + args.seed, args.val_tasks)
    dataset = Dataset.from_list([{"prompt": prompt_text(t), "a": t["a"], "b": t["b"]} for t in train_tasks])
    val_prompts = [prompt_text(t) for t in val_tasks]
    tracker = Tracker(args)

    def reward(prompts, completions, a, b, **kwargs):
        return [first_turn_score_text(text, {"a": x, "b": y}) for text, x, y in zip(completions, a, b)]

    @torch.no_grad()
    def evaluate(model, step: int) -> None:
        t = time.monotonic()
        was_training = model.training
        model.eval()
        enc = tokenizer(val_prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(
            **enc, max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
        )
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        scores = [first_turn_score_text(text, task) for text, task in zip(texts, val_tasks)]
        if was_training:
            model.train()
        tracker.record_eval(step, sum(scores) / len(scores), None, time.monotonic() - t)

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.mark = None

        def on_train_begin(self, targs, state, control, model=None, **kw):
            evaluate(model, 0)
            self.mark = time.monotonic()

        def on_step_end(self, targs, state, control, model=None, **kw):
            tracker.train_seconds += time.monotonic() - self.mark
            tracker.step = state.global_step
            print(f"[trl] step {state.global_step}: clock {tracker.train_seconds / 60:.1f} min", flush=True)
            if state.global_step % args.eval_every == 0:
                evaluate(model, state.global_step)
            if tracker.should_stop():
                control.should_training_stop = True
            self.mark = time.monotonic()

        def on_log(self, targs, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                tracker.train_rewards.append(round(float(logs["reward"]), 4))
                print(f"[trl] step {state.global_step}: train reward {logs['reward']:.3f} (first turn, 0.8 max)  "
                      f"step_time {logs.get('step_time', float('nan')):.0f}s", flush=True)

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    peft_config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    batch = args.groups_per_step * args.rollouts
    with tempfile.TemporaryDirectory(prefix="ttr-trl-") as out:
        config = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=1,
            num_generations=args.rollouts,
            max_completion_length=40,
            temperature=1.0,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            adam_beta2=0.99,
            weight_decay=0.0,
            max_grad_norm=0.1,
            loss_type="cispo",
            epsilon_high=5.0,  # TRL's CISPO clamps the ratio at epsilon_high; tracerl's at 1 + 4.0
            beta=0.0,
            scale_rewards="group",
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,
            use_cpu=True,
            report_to=[],
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            max_steps=args.max_steps,
            seed=args.seed,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=peft_config,
            callbacks=[Clock()],
        )
        setup = time.monotonic() - started
        print(f"[trl] trainer ready ({setup:.0f}s setup)", flush=True)
        trainer.train()
        if not tracker.evals or tracker.evals[-1]["step"] != tracker.step:
            evaluate(trainer.model, tracker.step)
    return tracker.result(setup)


# -- driver -----------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    result = asyncio.run(run_tracerl(args)) if args.worker == "tracerl" else run_trl(args)
    print("RESULT " + json.dumps(result), flush=True)


def fmt_time(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds / 60:.1f} min"


def print_table(results: dict, target: float) -> None:
    print()
    print(f"target: held-out greedy first-turn reward >= {target} (0.8 max)")
    print()
    print(
        "| side | time to target (train clock) | steps to target | held-out first-turn: start → final (best) | "
        "final held-out full multi-turn | steps run | train clock | s/step | setup | peak RSS (MB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for side in ("tracerl", "trl"):
        r = results.get(side)
        if r is None:
            continue
        # recomputed from the stored curve, so the table can be printed for any target <= the run's
        hit = next((e for e in r["evals"] if e["heldout_first_turn"] >= target - 1e-9), None)
        if hit is None and r["reached"] is None and target > r["args"]["target"]:
            print(f"(note: {side} stopped training at its own target {r['args']['target']})")
        name = f"tracerl ({r.get('inference')}, multi-turn)" if side == "tracerl" else "TRL 1.16 GRPOTrainer (single-turn)"
        print(
            f"| {name} | {fmt_time(hit['train_seconds']) if hit else 'not reached'} | {hit['step'] if hit else '–'} | "
            f"{r['start_heldout_first_turn']:.3f} → {r['final_heldout_first_turn']:.3f} ({r['best_heldout_first_turn']:.3f}) | "
            f"{'–' if r.get('final_heldout_full') is None else format(r['final_heldout_full'], '.3f')} | {r['steps']} | "
            f"{fmt_time(r['train_seconds'])} | {r['train_seconds'] / max(r['steps'], 1):.1f} | {r['setup_seconds']:.0f} s | {r['peak_rss_mb']} |"
        )
    hits = {
        side: next((e for e in r["evals"] if e["heldout_first_turn"] >= target - 1e-9), None) for side, r in results.items()
    }
    if hits.get("tracerl") and hits.get("trl"):
        ratio = hits["trl"]["train_seconds"] / max(hits["tracerl"]["train_seconds"], 1e-9)
        print(f"\nTRL / tracerl time-to-target ratio: {ratio:.2f}x")
    for side, r in results.items():
        curve = ", ".join(f"{e['step']}:{e['heldout_first_turn']:.2f}@{e['train_seconds'] / 60:.1f}m" for e in r["evals"])
        print(f"\n{side} held-out curve (step:reward@train-clock): {curve}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sides", default="tracerl,trl")
    p.add_argument("--max-minutes", type=float, default=12.0, help="training-clock budget per side")
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--target", type=float, default=0.5, help="held-out greedy first-turn reward to reach (0.8 max)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base-model", default="smollm2-135m")
    p.add_argument("--inference", choices=["auto", "vllm", "transformers"], default="auto", help="tracerl's server")
    p.add_argument("--groups-per-step", type=int, default=2)
    p.add_argument("--rollouts", type=int, default=8, help="group size")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--val-tasks", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=3)
    p.add_argument("--results", default=".tracerl/bench/time_to_reward.json", help="results are merged into this JSON file")
    p.add_argument("--table-only", action="store_true", help="print the table from --results and exit")
    p.add_argument("--worker", choices=["tracerl", "trl"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return

    path = Path(args.results)
    path.parent.mkdir(parents=True, exist_ok=True)
    stored = json.loads(path.read_text()) if path.exists() else {}
    if not args.table_only:
        for side in args.sides.split(","):
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", side] + sys.argv[1:]
            print(f"=== {side} ===", flush=True)
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
            line, tail = None, []
            for raw in proc.stdout:
                if raw.startswith("RESULT "):
                    line = raw
                elif raw.startswith("["):
                    print(raw, end="", flush=True)
                tail = (tail + [raw])[-80:]
            proc.wait()
            if proc.returncode != 0 or line is None:
                print("".join(tail))
                raise SystemExit(f"{side} worker failed (rc {proc.returncode})")
            result = json.loads(line[len("RESULT ") :])
            result["args"] = {k: v for k, v in vars(args).items() if k not in ("worker", "table_only", "results", "sides")}
            result["command"] = " ".join(sys.argv)
            stored = json.loads(path.read_text()) if path.exists() else {}  # another run may have written
            stored[side] = result
            path.write_text(json.dumps(stored, indent=2))
    print_table(stored, args.target)


if __name__ == "__main__":
    main()
