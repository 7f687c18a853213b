"""The demo's training step, old configuration vs new, measured in one run of this script.

Both sides run ``examples/demo.py``'s own code (its tasks, multi-turn rollout, reward and
``train_step``: 2 tasks x 8 rollouts at T=1, one GRPO step, the train row logged), with the
same seed, so they see the same tasks and the same per-rollout sampling seeds:

- ``old``: vLLM serving the policy as a LoRA (``LocalBackend(inference="vllm")``), the demo's
  configuration until 2026-12-01.
- ``new``: the demo's configuration now, vLLM serving the merged policy, reloaded in place
  after each step (``LocalBackend(inference="vllm", serve_merged=True)``), the trainer with
  gradient checkpointing and vLLM with a 512 MiB KV cache (the old side: none, 2 GiB).

The sides run back to back (``--order``, default old then new), each from a fresh run
directory: register (timed as set-up: vLLM start-up, trainer load), the step-0 held-out eval
(16 greedy rollouts, timed: the demo runs four of them), then ``--steps`` timed steps.  Two
sides up at once would need two trainers and two vLLMs in this machine's memory, so they are
not interleaved; the ceiling (``bench/ceiling.py``) is measured before each side and after the
last, in this same invocation, so drift of the shared machine shows.

Per step: its wall time (gather + ``backend.train`` + ``model.log``) and the split that
``backend.train`` reports (``rollout_seconds``, ``train_seconds``, ``save_seconds``,
``hot_load_seconds``), the train reward and ``sampler_trainer_prob_corr``.  % of ceiling:
the step's useful FLOPs over its wall time, against the ceiling's best fp32 matmul rate, with
useful FLOPs = 2·P·(sampled tokens) for the rollouts (decode only; the prompts' prefill is
left out, most of it is a cached shared prefix) + 6·P·(forward tokens) for training
(forward + backward of the packed rows; the activation-checkpoint recompute is not counted),
P = 134.5M parameters.  Memory: the peak of the summed PSS of this process and its children
(vLLM's processes) during the side, sampled every 0.2 s (each shared page split between the
processes that map it: what the machine holds for the tree), and the summed RSS (shared pages
counted once per process: an upper bound).

    flock /tmp/tracerl-heavy.lock .venv/bin/python bench/demo_step.py [--steps 4] [--json bench/demo_step.json]
    .venv/bin/python bench/demo_step.py --table-only bench/demo_step.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

PARAMETERS = 134.5e6
SIDES = {
    "old": {
        "argv": ["--serving", "lora", "--no-gradient-checkpointing", "--kv-cache-mib", "2048"],
        "label": "old: vLLM serves the LoRA",
    },
    "new": {"argv": ["--serving", "merged"], "label": "new: merged policy, checkpointed, 512 MiB KV (the demo now)"},
}
SPLIT = ("rollout_seconds", "train_seconds", "save_seconds", "hot_load_seconds")


def load_demo() -> Any:
    """``examples/demo.py`` as a module: the benchmark runs the demo's own step, not a copy."""
    spec = importlib.util.spec_from_file_location("tracerl_demo", ROOT / "examples" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def demo_args(demo: Any, seed: int, steps: int, side_argv: list[str], data: Path) -> argparse.Namespace:
    """The demo's defaults (its own parser), with this side's flags and run directory."""
    argv = ["--seed", str(seed), "--steps", str(steps), "--inference", "vllm", *side_argv, "--data", str(data)]
    saved = sys.argv
    try:
        sys.argv = ["demo.py", *argv]
        return demo.parse_args()
    finally:
        sys.argv = saved


def token_counts(groups: list[Any]) -> tuple[int, int]:
    """(sampled tokens, prompt tokens) over every turn of every rollout."""
    sampled = prompt = 0
    for group in groups:
        for trajectory in group.trajectories:
            for item in trajectory.messages_and_choices:
                if getattr(item, "token_ids", None):
                    sampled += len(item.token_ids)
                    prompt += len(item.prompt_token_ids or [])
    return sampled, prompt


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds used so far by this process (trainer, proxy) and by its live children (vLLM)."""
    import psutil

    me = psutil.Process()
    children = 0.0
    for child in me.children(recursive=True):
        try:
            times = child.cpu_times()
            children += times.user + times.system
        except psutil.Error:
            pass
    times = me.cpu_times()
    return times.user + times.system, children


async def run_side(name: str, args: argparse.Namespace, data: Path) -> dict[str, Any]:
    import tracerl
    from ceiling import measure_ceiling
    from serving_speed import TreeRSS

    demo = load_demo()
    ceiling = measure_ceiling()
    dargs = demo_args(demo, args.seed, args.steps, SIDES[name]["argv"], data)
    model = demo.make_model(dargs, name=f"calculator-{name}-s{args.seed}")
    backend = demo.make_backend(dargs)
    assert backend.serve_merged == (name == "new"), backend.serve_merged
    record: dict[str, Any] = {"side": name, "label": SIDES[name]["label"], "ceiling_before": ceiling, "steps": []}
    with TreeRSS(os.getpid(), pss=True) as rss:
        started = time.monotonic()
        await model.register(backend)
        record["setup_seconds"] = time.monotonic() - started
        try:
            val_tasks = demo.make_tasks(10_000 + args.seed, dargs.val_tasks)
            started = time.monotonic()
            val = await demo.evaluate(model, val_tasks)
            record["eval_seconds"] = time.monotonic() - started
            row = await model.log(val, split="val", step=0)
            record["val_reward_step0"] = row["val/reward"]
            train_tasks = demo.make_tasks(args.seed, 400)
            for batch in tracerl.iterate_dataset(train_tasks, groups_per_step=dargs.groups_per_step, num_epochs=100, use_tqdm=False):
                if batch.step >= args.steps:
                    break
                started, cpu = time.monotonic(), cpu_seconds()
                groups, result = await demo.train_step(model, backend, batch, dargs)
                wall = time.monotonic() - started
                own_cpu, children_cpu = (after - before for after, before in zip(cpu_seconds(), cpu))
                sampled, prompt = token_counts(groups)
                m = result.metrics
                step = {
                    "step": result.step,
                    "wall_seconds": wall,
                    **{key: m.get(key) for key in SPLIT},
                    "train_reward": statistics.fmean(t.reward for g in groups for t in g),
                    "sampler_trainer_prob_corr": m.get("sampler_trainer_prob_corr"),
                    "forward_tokens": m.get("forward_tokens", 0.0),
                    "sampled_tokens": sampled,
                    "prompt_tokens": prompt,
                    "num_groups_trainable": m.get("num_groups_trainable"),
                    "cpu_seconds_this_process": own_cpu,
                    "cpu_seconds_children": children_cpu,
                }
                record["steps"].append(step)
                print(f"[{name}] step {result.step}: {wall:.1f}s  ({demo.step_split(m)})  reward {step['train_reward']:.3f}  "
                      f"corr {step['sampler_trainer_prob_corr']}  cpu s: here {own_cpu:.0f}, vLLM {children_cpu:.0f}", flush=True)  # fmt: skip
        finally:
            await backend.close()
    record["peak_tree_rss_mb"] = rss.peak / 2**20
    record["peak_tree_pss_mb"] = rss.pss_peak / 2**20
    return record


def summarize(record: dict[str, Any], ceiling: dict[str, Any]) -> dict[str, Any]:
    steps = record["steps"]
    walls = [s["wall_seconds"] for s in steps]
    median_wall = statistics.median(walls)
    flops = [2 * PARAMETERS * s["sampled_tokens"] + 6 * PARAMETERS * s["forward_tokens"] for s in steps]
    gflops = statistics.median(f / s["wall_seconds"] / 1e9 for f, s in zip(flops, steps))
    return {
        "median_wall": median_wall,
        "min_wall": min(walls),
        "max_wall": max(walls),
        **{key: statistics.median(s[key] for s in steps if s[key] is not None) for key in SPLIT},
        "gflops": gflops,
        "percent_of_ceiling": 100.0 * gflops / ceiling["matmul_gflops"],
        "min_corr": min((s["sampler_trainer_prob_corr"] for s in steps if s["sampler_trainer_prob_corr"] is not None), default=None),
        "rewards": [s["train_reward"] for s in steps],
    }


def table(result: dict[str, Any]) -> str:
    from ceiling import describe

    lines = [
        "| side | s/step (median) | min–max | rollouts | train | save | hot-load | set-up | step-0 eval | "
        "GFLOP/s | % of ceiling | train reward per step | min prob corr | peak PSS of tree (MB) | peak summed RSS (MB) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    summaries = {}
    for record in result["sides"]:
        s = summaries[record["side"]] = summarize(record, record["ceiling_before"])
        corr = f"{s['min_corr']:.10f}" if s["min_corr"] is not None else "–"
        pss = f"{record['peak_tree_pss_mb']:.0f}" if "peak_tree_pss_mb" in record else "–"  # older runs: RSS only
        lines.append(
            f"| {record['label']} | {s['median_wall']:.1f} | {s['min_wall']:.1f}–{s['max_wall']:.1f} | "
            f"{s['rollout_seconds']:.1f} | {s['train_seconds']:.1f} | {s['save_seconds']:.2f} | {s['hot_load_seconds']:.2f} | "
            f"{record['setup_seconds']:.0f} | {record['eval_seconds']:.1f} | {s['gflops']:.1f} | {s['percent_of_ceiling']:.1f}% | "
            f"{', '.join(f'{r:.3f}' for r in s['rewards'])} | {corr} | {pss} | {record['peak_tree_rss_mb']:.0f} |"
        )
    if "old" in summaries and "new" in summaries:
        ratio = summaries["new"]["median_wall"] / summaries["old"]["median_wall"]
        lines.append(f"\nnew / old median s/step: **{ratio:.2f}×**")
    lines.append("")
    for record in result["sides"]:
        lines.append(f"- before {record['side']}: {describe(record['ceiling_before'])}")
    lines.append(f"- after the last side: {describe(result['ceiling_after'])}")
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from ceiling import measure_ceiling

    result: dict[str, Any] = {"command": sys.argv, "seed": args.seed, "steps": args.steps, "order": args.order, "sides": []}
    with tempfile.TemporaryDirectory(prefix="tracerl-demo-step-") as data:
        for name in args.order.split(","):
            result["sides"].append(await run_side(name, args, Path(data) / name))
    result["ceiling_after"] = measure_ceiling()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per side")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--order", default="old,new", help="sides, comma-separated, run in this order")
    parser.add_argument("--json", default=str(BENCH / "demo_step.json"), help="raw results (every step of every side)")
    parser.add_argument("--table-only", metavar="JSON", help="reprint the table from a stored result and exit")
    args = parser.parse_args()
    if args.table_only:
        print(table(json.loads(Path(args.table_only).read_text())))
        return
    unknown = set(args.order.split(",")) - set(SIDES)
    if unknown:
        raise SystemExit(f"unknown side(s) {sorted(unknown)}; known: {sorted(SIDES)}")
    result = asyncio.run(run(args))
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
