"""Time to reward: the calculator demo task trained by tracerl vs by TRL ``GRPOTrainer``, over seeds.

Same base model (SmolLM2-135M-Instruct, fp32, CPU), LoRA (r=16, alpha=32, all 7 projections,
dropout 0), group size (``--rollouts``), groups per step, learning rate (1e-4, constant),
grad-norm clip 0.1, AdamW (beta2 0.99, no weight decay), CISPO-style loss, no KL, same train
and held-out tasks (``examples/demo.make_tasks``), same prompt tokens (the demo's system
message, worked examples, user message and ``add`` tool rendered by the model's chat template).

* **tracerl** runs the demo's own path: ``demo.make_model`` / ``demo.make_backend`` with
  ``--serving auto`` (vLLM serving the merged policy, reloaded in place after each step, when
  its runtime is installed) and ``demo.train_step``'s multi-turn rollout (tool call, tool
  result, final answer; reward up to 1.0).
* **TRL** trains the single-turn version (our multi-turn tool loop is not TRL's): the same
  first-turn prompt, ``max_completion_length`` 40 (the demo's first-turn ``max_tokens``) and
  the first-turn part of the demo's reward (``demo.score_call`` on the text parsed with
  tracerl's Hermes tool-call parser, 0.8 max).  Generation: ``--trl-generation`` picks TRL's
  transformers paths (``generate``: one left-padded batch of the step's rows with the KV cache;
  ``continuous``: ``use_transformers_continuous_batching``).  TRL's vLLM modes cannot run here
  (see ``bench/history/RESULTS-until-2026-12-04.md``): both import vLLM into the trainer
  process and the server mode's weight sync is NCCL-only (``VLLMClient.init_communicator``
  raises for a non-CUDA device).

Both sides are compared on the same held-out metric: the **first-turn reward (0.8 max)** of a
greedy reply to each of ``--val-tasks`` fixed held-out tasks, before training and after
**every** step (``--eval-every 1``), so the step that crosses ``--target`` is known exactly.
Before training both sides score 0.000, so any target > 0 needs learning.  The clock counts
training only (rollouts/generation + reward + update + checkpoint/reload); **set-up** (process
start to the first held-out eval: imports, model load, vLLM start-up, trainer construction)
and the held-out evals are measured and shown separately.  A run stops at ``--target``, at
``--max-minutes`` of training clock, or at ``--max-steps``.

Each (seed, side) runs in its own subprocess; the driver samples the **summed RSS of that
process and all its descendants** (tracerl's vLLM server processes included) every 0.2 s and
measures the matmul/copy ceiling (``bench/ceiling.py``) right before it, in this invocation.
Sides alternate per seed (even seeds tracerl first).  Each finished run is written into
``--results`` at once, so an interrupted sweep keeps what finished.  The table gives per side
the median time to target over seeds with a 95% percentile-bootstrap interval (seeds
resampled, 10,000 draws), and the TRL/tracerl ratio of medians with a paired bootstrap
interval; a run that never reached the target counts as +inf (it can make a median "not
reached").  Throughput as % of the ceiling: the FLOPs each side computed on its train clock,
2·P·(sampled tokens) + 4·P·(tokens run forward+backward by the trainer: a LoRA step's forward
2P + activation gradients 2P, no gradients for the frozen weights), P = 134.5M, over the train
clock, against that seed's ceiling.

    flock /tmp/tracerl-heavy.lock .venv/bin/python bench/time_to_reward.py --seeds 0,1,2,3,4
    .venv/bin/python bench/time_to_reward.py --table-only [--target 0.6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

STARTED = time.monotonic()  # set-up is measured from here (before torch & co. are imported)
ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(BENCH))

LORA = {"r": 16, "alpha": 32}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PARAMETERS = 134.5e6
SIDES = ("tracerl", "trl")


def first_turn_score_text(text: str, task: dict) -> float:
    """The demo's first-turn reward for raw generated text (parsed like our servers parse it)."""
    import demo
    from tracerl.inference.tool_calls import parse_tool_calls

    parsed = parse_tool_calls(text)
    message = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls or None}
    return demo.score_call(SimpleNamespace(message=message), task)[0]


def score_call_sha1() -> str:
    """Which version of the demo's reward was used (stored with the results)."""
    import hashlib
    import inspect

    import demo

    return hashlib.sha1((inspect.getsource(demo.score_call) + inspect.getsource(demo.format_pieces)).encode()).hexdigest()[:12]


class Tracker:
    """Training clock (eval and set-up paused out), per-step work, evaluations, stop decision."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.train_seconds = 0.0
        self.eval_seconds = 0.0
        self.setup_seconds: float | None = None
        self.evals: list[dict] = []
        self.steps: list[dict] = []
        self.reached_at: dict | None = None
        self.step = 0

    def setup_done(self) -> None:
        if self.setup_seconds is None:
            self.setup_seconds = time.monotonic() - STARTED
            print(f"[{self.args.worker}] set-up {self.setup_seconds:.0f}s", flush=True)

    def record_step(self, step: int, seconds: float, train_reward: float, sampled: float, forward: float, **extra: Any) -> None:
        self.train_seconds += seconds
        self.step = step
        row = {"step": step, "seconds": round(seconds, 2), "train_reward": round(train_reward, 4),
               "sampled_tokens": sampled, "forward_tokens": forward, **extra}  # fmt: skip
        self.steps.append(row)
        print(f"[{self.args.worker}] step {step}: {seconds:.1f}s  train reward {train_reward:.3f}  "
              f"sampled {sampled:.0f} tok, trained {forward:.0f} tok  clock {self.train_seconds / 60:.2f} min", flush=True)  # fmt: skip

    def record_eval(self, step: int, first_turn: float, full: float | None, eval_seconds: float, failed: list[str] = ()) -> None:
        self.eval_seconds += eval_seconds
        row = {"step": step, "train_seconds": round(self.train_seconds, 2), "heldout_first_turn": round(first_turn, 4),
               "eval_seconds": round(eval_seconds, 2)}  # fmt: skip
        if full is not None:
            row["heldout_full"] = round(full, 4)
        if failed:
            row["failed_rollouts"] = list(failed)
            print(f"[{self.args.worker}] step {step}: {len(failed)} held-out rollout(s) failed: {failed}", flush=True)
        self.evals.append(row)
        if self.reached_at is None and first_turn >= self.args.target - 1e-9:
            self.reached_at = row
        extra = f"  (full multi-turn {full:.3f})" if full is not None else ""
        print(f"[{self.args.worker}] step {step}: held-out first-turn {first_turn:.3f}{extra}  (eval {eval_seconds:.1f}s)", flush=True)

    def should_stop(self) -> bool:
        return self.reached_at is not None or self.train_seconds >= self.args.max_minutes * 60 or self.step >= self.args.max_steps

    def result(self) -> dict:
        return {
            "setup_seconds": round(self.setup_seconds or 0.0, 1),
            "train_seconds": round(self.train_seconds, 2),
            "eval_seconds_total": round(self.eval_seconds, 1),
            "steps_run": self.step,
            "reached": self.reached_at,
            "evals": self.evals,
            "steps": self.steps,
            "peak_rss_own_process_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "score_call_sha1": score_call_sha1(),
        }


# -- tracerl: the demo's own model, backend and step --------------------------------------
def demo_args(args: argparse.Namespace) -> argparse.Namespace:
    """The demo's own defaults (its parser: serving, vLLM KV cache, ...) with this run's settings.

    Activation checkpointing is off on both sides (TRL's too): the same computation, and the
    faster one on this CPU; the demo turns it on to fit a laptop's memory.
    """
    import demo

    dargs = demo.parse_args([])
    overrides = dict(seed=args.seed, base_model=args.base_model, data=tempfile.mkdtemp(prefix="ttr-tracerl-"), inference=args.inference,
                     serving=args.serving, rollouts=args.rollouts, lr=args.lr, groups_per_step=args.groups_per_step, steps=args.max_steps)  # fmt: skip
    for key, value in overrides.items():
        setattr(dargs, key, value)
    if hasattr(dargs, "gradient_checkpointing"):
        dargs.gradient_checkpointing = False
    return dargs


async def run_tracerl(args: argparse.Namespace) -> dict:
    import demo
    import tracerl

    dargs = demo_args(args)
    train_tasks = demo.make_tasks(args.seed, 400)
    val_tasks = demo.make_tasks(10_000 + args.seed, args.val_tasks)
    tracker = Tracker(args)
    model = demo.make_model(dargs, name=f"ttr-s{args.seed}")
    backend = demo.make_backend(dargs)
    await model.register(backend)
    tracker.setup_done()
    print(f"[tracerl] serving {'the merged policy' if backend.serve_merged else 'the LoRA'} (inference={args.inference})", flush=True)

    async def evaluate(step: int) -> None:
        t = time.monotonic()
        groups = await demo.evaluate(model, val_tasks)
        first, full, failed = [], [], []
        for group in groups:
            failed += [f"{e.type}: {e.message}"[:300] for e in group.exceptions]
            for traj in group.trajectories:
                choice = next(item for item in traj.messages_and_choices if isinstance(item, tracerl.Choice))
                first.append(demo.score_call(choice, {"a": traj.metadata["a"], "b": traj.metadata["b"]})[0])
                full.append(traj.reward)
        n = len(val_tasks)  # failed rollouts count as 0 (and are listed with the eval)
        tracker.record_eval(step, sum(first) / n, sum(full) / n, time.monotonic() - t, failed=failed)

    try:
        await evaluate(0)
        for batch in tracerl.iterate_dataset(train_tasks, groups_per_step=args.groups_per_step, num_epochs=100, use_tqdm=False):
            if tracker.should_stop():
                break
            t = time.monotonic()
            groups, result = await demo.train_step(model, backend, batch, dargs)
            seconds = time.monotonic() - t
            sampled = sum(len(item.token_ids or []) for g in groups for traj in g for item in traj.messages_and_choices
                          if isinstance(item, tracerl.Choice))  # fmt: skip
            m = result.metrics
            rewards = [traj.reward for g in groups for traj in g]
            split = {k: round(m[k], 2) for k in ("rollout_seconds", "train_seconds", "save_seconds", "hot_load_seconds") if k in m}
            tracker.record_step(result.step, seconds, sum(rewards) / max(len(rewards), 1), float(sampled),
                                float(m.get("forward_tokens", 0.0)), split=split)  # fmt: skip
            if result.step % args.eval_every == 0:
                await evaluate(result.step)
        if tracker.evals[-1]["step"] != tracker.step:
            await evaluate(tracker.step)
    finally:
        await backend.close()
    out = tracker.result()
    out["serving"] = "merged" if backend.serve_merged else "lora"
    out["demo_kv_cache_mib"] = getattr(dargs, "kv_cache_mib", None)  # None: the demo had no such flag (vLLM's 2 GiB then)
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

    torch.manual_seed(args.seed)
    model_path = str(resolve_base_model(args.base_model))
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")

    def prompt_text(task: dict) -> str:
        return tokenizer.apply_chat_template(demo.first_turn_messages(task), tools=[demo.ADD_TOOL], tokenize=False, add_generation_prompt=True)

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
        out = model.generate(**enc, max_new_tokens=40, do_sample=False, use_cache=True,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        scores = [first_turn_score_text(text, task) for text, task in zip(texts, val_tasks)]
        if was_training:
            model.train()
        tracker.record_eval(step, sum(scores) / len(scores), None, time.monotonic() - t)

    class Clock(TrainerCallback):
        """Times each optimizer step (generation + reward + update) and evaluates between steps."""

        def __init__(self) -> None:
            self.mark = 0.0
            self.seconds = 0.0
            self.tokens_seen = 0

        def on_train_begin(self, targs, state, control, model=None, **kw):
            tracker.setup_done()
            evaluate(model, 0)
            self.mark = time.monotonic()

        def on_step_end(self, targs, state, control, model=None, **kw):
            self.seconds = time.monotonic() - self.mark

        def on_log(self, targs, state, control, logs=None, model=None, **kw):
            if not logs or "reward" not in logs:
                return
            seconds = self.seconds + (time.monotonic() - self.mark - self.seconds)  # the step and its logging
            rows = args.groups_per_step * args.rollouts
            seen = int(logs.get("num_tokens", 0))
            tracker.record_step(state.global_step, seconds, float(logs["reward"]), float(logs["completions/mean_length"]) * rows,
                                float(seen - self.tokens_seen), trl_step_time=logs.get("step_time"))  # fmt: skip
            self.tokens_seen = seen
            if state.global_step % args.eval_every == 0:
                evaluate(model, state.global_step)
            if tracker.should_stop():
                control.should_training_stop = True
            self.mark = time.monotonic()

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    peft_config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    rows = args.groups_per_step * args.rollouts
    with tempfile.TemporaryDirectory(prefix="ttr-trl-") as out:
        config = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=rows,  # one generation batch = the step's rows, generated together
            gradient_accumulation_steps=1,
            num_generations=args.rollouts,
            max_completion_length=40,
            temperature=1.0,
            use_transformers_continuous_batching=args.trl_generation == "continuous",
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
            activation_checkpointing=False,  # faster on this CPU (TRL's default, on, recomputes the forward)
            use_cpu=True,
            report_to=[],
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            max_steps=args.max_steps,
            seed=args.seed,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer,
                              peft_config=peft_config, callbacks=[Clock()])  # fmt: skip
        trainer.train()
        if tracker.evals[-1]["step"] != tracker.step:
            evaluate(trainer.model, tracker.step)
    out = tracker.result()
    out["trl_generation"] = args.trl_generation
    return out


# -- driver -----------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    result = asyncio.run(run_tracerl(args)) if args.worker == "tracerl" else run_trl(args)
    print("RESULT " + json.dumps(result), flush=True)


def run_one(side: str, seed: int, args: argparse.Namespace) -> dict:
    """One (side, seed) in its own process, with the ceiling before it and its tree's peak RSS."""
    from ceiling import measure_ceiling
    from serving_speed import TreeRSS

    ceiling = measure_ceiling()
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", side, "--seed", str(seed)] + worker_flags(args)
    print(f"=== {side} seed {seed} (ceiling {ceiling['matmul_gflops']:.0f} GFLOP/s) ===", flush=True)
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    line, tail = None, []
    with TreeRSS(proc.pid) as rss:
        assert proc.stdout is not None
        for raw in proc.stdout:
            if raw.startswith("RESULT "):
                line = raw
            elif raw.startswith("["):
                print(raw, end="", flush=True)
            tail = (tail + [raw])[-80:]
        proc.wait()
    if proc.returncode != 0 or line is None:
        print("".join(tail))
        raise SystemExit(f"{side} seed {seed} failed (rc {proc.returncode})")
    result = json.loads(line[len("RESULT ") :])
    result.update(side=side, seed=seed, ceiling=ceiling, peak_tree_rss_mb=round(rss.peak / 2**20),
                  process_wall_seconds=round(time.monotonic() - started, 1), config=config_of(args),
                  command=" ".join([os.path.relpath(sys.executable, ROOT), "bench/time_to_reward.py", *sys.argv[1:]]))  # fmt: skip
    return result


WORKER_KEYS = ("max_minutes", "max_steps", "target", "base_model", "inference", "serving", "groups_per_step", "rollouts", "lr",
               "val_tasks", "eval_every", "trl_generation")  # fmt: skip


def worker_flags(args: argparse.Namespace) -> list[str]:
    return [x for k in WORKER_KEYS for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]


def config_of(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in WORKER_KEYS}


def store(path: Path, result: dict) -> None:
    """Replace this (side, seed, config)'s run in the results file, keep everything else."""
    stored = json.loads(path.read_text()) if path.exists() else {"runs": []}
    key = (result["side"], result["seed"], json.dumps(result["config"], sort_keys=True))
    stored["runs"] = [r for r in stored["runs"] if (r["side"], r["seed"], json.dumps(r["config"], sort_keys=True)) != key]
    stored["runs"].append(result)
    path.write_text(json.dumps(stored, indent=1) + "\n")


# -- table ------------------------------------------------------------------------------
def time_to(run: dict, target: float) -> tuple[float, int | None]:
    """(train-clock seconds, step) of the first held-out eval >= target; (+inf, None) if never."""
    hit = next((e for e in run["evals"] if e["heldout_first_turn"] >= target - 1e-9), None)
    return (float("inf"), None) if hit is None else (hit["train_seconds"], hit["step"])


def bootstrap(values: list[float], stat: Any, draws: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of ``stat`` over resamples of ``values`` (with replacement)."""
    rng = random.Random(seed)
    samples = sorted(stat([rng.choice(values) for _ in values]) for _ in range(draws))
    return samples[int(0.025 * draws)], samples[min(int(0.975 * draws), draws - 1)]


def gflops(run: dict) -> float:
    flops = sum(2 * PARAMETERS * s["sampled_tokens"] + 4 * PARAMETERS * s["forward_tokens"] for s in run["steps"])
    return flops / max(run["train_seconds"], 1e-9) / 1e9


def peak_mb(run: dict) -> int:
    """The tree's sampled peak RSS, or the worker's own ``ru_maxrss`` where a 0.2 s sample missed a spike."""
    return max(run["peak_tree_rss_mb"], run["peak_rss_own_process_mb"])


def fmt_s(seconds: float) -> str:
    return "not reached" if seconds == float("inf") else f"{seconds:.0f} s"


def side_name(run: dict) -> str:
    if run["side"] == "tracerl":
        return f"tracerl (vLLM, {run.get('serving', '?')} policy, multi-turn)" if run["inference"] != "transformers" else "tracerl (transformers)"
    return f"TRL 1.16 GRPOTrainer ({run.get('trl_generation', 'generate')}, single-turn)"


def print_table(runs: list[dict], target: float | None) -> None:
    if not runs:
        print("no runs stored")
        return
    target = runs[0]["config"]["target"] if target is None else target
    by_side = {side: sorted((r for r in runs if r["side"] == side), key=lambda r: r["seed"]) for side in SIDES}
    c = runs[0]["config"]
    print(f"\n#### target: held-out greedy first-turn reward >= {target} (0.8 max); lr {c['lr']}, {c['groups_per_step']} group(s) x "
          f"{c['rollouts']} rollouts per step, {c['val_tasks']} held-out tasks, eval after every step, at most {c['max_steps']} steps / "
          f"{c['max_minutes']} min of train clock\n")  # fmt: skip
    print("| side | seeds | time to target, median [95% CI] | steps to target (per seed) | s/step (median) | set-up (median) "
          "| set-up + time to target (median) | held-out eval s (median per eval) | GFLOP/s on train clock (median) "
          "| % of matmul ceiling (median) | peak RSS of process tree, MB (median, max) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    medians = {}
    for side, rs in by_side.items():
        if not rs:
            continue
        times = [time_to(r, target)[0] for r in rs]
        med = medians[side] = statistics.median(times)
        lo, hi = bootstrap(times, statistics.median)
        steps = ", ".join(str(time_to(r, target)[1] or "–") for r in rs)
        per_step = statistics.median(r["train_seconds"] / max(r["steps_run"], 1) for r in rs)
        evals = statistics.median(e["eval_seconds"] for r in rs for e in r["evals"])
        pct = statistics.median(100 * gflops(r) / r["ceiling"]["matmul_gflops"] for r in rs)
        rss = [peak_mb(r) for r in rs]
        print(f"| {side_name(rs[0])} | {len(rs)} | {fmt_s(med)} [{fmt_s(lo)} – {fmt_s(hi)}] | {steps} | {per_step:.1f} | "
              f"{statistics.median(r['setup_seconds'] for r in rs):.0f} s | "
              f"{fmt_s(statistics.median(r['setup_seconds'] + t for r, t in zip(rs, times)))} | {evals:.1f} | {statistics.median(gflops(r) for r in rs):.1f} | "
              f"{pct:.1f}% | {statistics.median(rss):.0f} ({max(rss)}) |")  # fmt: skip
    paired = sorted(set(r["seed"] for r in by_side["tracerl"]) & set(r["seed"] for r in by_side["trl"]))
    if paired:
        pairs = [(time_to(next(r for r in by_side["trl"] if r["seed"] == s), target)[0],
                  time_to(next(r for r in by_side["tracerl"] if r["seed"] == s), target)[0]) for s in paired]  # fmt: skip

        def ratio(sample: list[tuple[float, float]]) -> float:
            a, b = statistics.median(p[0] for p in sample), statistics.median(p[1] for p in sample)
            return float("inf") if b == 0 or a == float("inf") else a / b

        lo, hi = bootstrap(pairs, ratio)
        print(f"\nTRL / tracerl ratio of median times to target over the {len(paired)} seeds both ran ({', '.join(map(str, paired))}): "
              f"**{ratio(pairs):.2f}x** (95% paired bootstrap CI {lo:.2f}x – {hi:.2f}x); per seed: "
              + ", ".join(f"{a / b:.2f}x" if b not in (0, float("inf")) and a != float("inf") else "–" for a, b in pairs))  # fmt: skip
    print("\n| seed | side | ceiling GFLOP/s | set-up | time to target | steps to target | steps run | s/step | GFLOP/s (% of ceiling) "
          "| peak RSS tree (MB) | held-out first-turn per step (full multi-turn) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(runs, key=lambda r: (r["seed"], r["side"])):
        seconds, step = time_to(r, target)
        curve = " ".join(f"{e['heldout_first_turn']:.2f}" + (f" ({e['heldout_full']:.2f})" if "heldout_full" in e else "") for e in r["evals"])
        g = gflops(r)
        print(f"| {r['seed']} | {r['side']} | {r['ceiling']['matmul_gflops']:.0f} | {r['setup_seconds']:.0f} s | {fmt_s(seconds)} | "
              f"{step or '–'} | {r['steps_run']} | {r['train_seconds'] / max(r['steps_run'], 1):.1f} | "
              f"{g:.1f} ({100 * g / r['ceiling']['matmul_gflops']:.1f}%) | {peak_mb(r)} | {curve} |")  # fmt: skip
    failed = [(r["seed"], r["side"], e["step"], len(e["failed_rollouts"])) for r in runs for e in r["evals"] if e.get("failed_rollouts")]
    if failed:
        print("\nfailed held-out rollouts (counted as 0): " + ", ".join(f"seed {a} {b} step {c}: {d}" for a, b, c, d in failed))
    print(f"\ncommands: {'; '.join(sorted(set(r['command'] for r in runs)))}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sides", default="tracerl,trl")
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated; each runs both sides")
    p.add_argument("--max-minutes", type=float, default=3.0, help="training-clock budget per side and seed")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--target", type=float, default=0.6, help="held-out greedy first-turn reward to reach (0.8 max)")
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--base-model", default="smollm2-135m")
    p.add_argument("--inference", choices=["auto", "vllm", "transformers"], default="auto", help="tracerl's server (the demo's flag)")
    p.add_argument("--serving", choices=["auto", "merged", "lora"], default="auto", help="tracerl's serving (the demo's flag)")
    p.add_argument("--trl-generation", choices=["generate", "continuous"], default="generate",
                   help="TRL's transformers generation path (see bench/history/ for the measurement behind the default)")  # fmt: skip
    p.add_argument("--groups-per-step", type=int, default=1)
    p.add_argument("--rollouts", type=int, default=8, help="group size")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--val-tasks", type=int, default=12)
    p.add_argument("--eval-every", type=int, default=1)
    p.add_argument("--results", default=str(BENCH / "results" / "time_to_reward.json"), help="each finished run is stored here at once")
    p.add_argument("--table-only", action="store_true", help="print the table from --results (for --target if given) and exit")
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    path = Path(args.results)
    target = args.target if "--target" in sys.argv else None
    if not args.table_only:
        path.parent.mkdir(parents=True, exist_ok=True)
        sides = [s for s in args.sides.split(",") if s]
        for seed in (int(s) for s in args.seeds.split(",") if s):
            for side in sides if seed % 2 == 0 else sides[::-1]:
                store(path, run_one(side, seed, args))
    runs = json.loads(path.read_text())["runs"] if path.exists() else []
    configs: dict[str, list[dict]] = {}  # one table per configuration, in the order first run
    for r in runs:
        configs.setdefault(json.dumps(r["config"], sort_keys=True), []).append(r)
    wanted = json.dumps(config_of(args), sort_keys=True)
    for key, group in configs.items():
        if args.table_only or key == wanted:
            print_table(group, target)


if __name__ == "__main__":
    main()
