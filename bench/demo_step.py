"""The demo's training step, the code of the day issue 13 was filed vs today's, measured in one run.

Every side is ``examples/demo.py`` run as its own process, the way a user runs it, with the same
seed (so the same tasks and the same per-rollout sampling seeds) and ``--inference vllm``:

- ``filed``: the demo exactly as it was when the speed issue was filed (commit ``8c46f79``,
  2026-12-01 12:28 UTC: vLLM serving the policy as a LoRA, no gradient checkpointing, a 2 GiB
  KV cache, the trainer of that day), exported from git into a temporary folder and imported
  from there (``PYTHONPATH``), the rest of the environment shared;
- ``lora``: today's code with that day's serving configuration
  (``--serving lora --no-gradient-checkpointing --kv-cache-mib 2048 --no-jemalloc``);
- ``new``: today's demo with its defaults (the merged policy reloaded in vLLM after each step,
  gradient checkpointing of every second layer, a 256 MiB KV cache, jemalloc under the trainer
  when installed);
- ``fp32`` / ``bf16``: today's demo serving the LoRA (merged serving is fp32 only), with fp32 or
  bf16 base weights in the trainer and in vLLM (``--order fp32,bf16``: what bf16 costs or saves
  on this CPU).

The sides run one after another (``--order``; two at once would not fit this machine's memory
and would share its two cores), each from a fresh run directory; the ceiling
(``bench/ceiling.py``) is measured before each side and after the last, in this invocation.

From each side's own history (``history.jsonl``, a row per step with its wall-clock time): a
step's wall time = its train row's time − the previous row's (gather + ``backend.train`` +
``model.log``; no held-out eval between steps: ``--eval-every`` is set past the run), the split
``backend.train`` reports where that code reports it (``rollout_seconds``, ``train_seconds``,
``save_seconds``, ``hot_load_seconds``), the train reward, ``sampler_trainer_prob_corr``; set-up
= process start → the step-0 held-out row (registration, vLLM start-up, 16 greedy rollouts).  The
side is stopped (SIGINT: the demo closes its backend) once its last timed step is logged.
% of ceiling: the step's useful FLOPs over its wall time against the ceiling's best fp32 matmul
rate, useful FLOPs = 2·P·(trained tokens) for decoding + 4·P·(forward tokens) for the LoRA
training step (forward 2P + activation gradients 2P; the frozen weights get no gradients; the
prompts' prefill and the checkpointing recompute are not counted), P = 134.5M.  Memory:
the peak of the summed PSS of the demo's process tree (vLLM's processes included; each shared
page split between the processes mapping it) over the whole side, sampled every 0.2 s.

    flock /tmp/tracerl-heavy.lock .venv/bin/python bench/demo_step.py [--order filed,new] [--steps 4]
    .venv/bin/python bench/demo_step.py --table-only bench/results/demo_step.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

PARAMETERS = 134.5e6
FILED_COMMIT = "8c46f79"
SIDES: dict[str, dict[str, Any]] = {
    "filed": {"commit": FILED_COMMIT, "argv": [], "label": f"filed: the demo when issue 13 was filed ({FILED_COMMIT})"},
    "lora": {
        "commit": None,
        "argv": ["--serving", "lora", "--no-gradient-checkpointing", "--kv-cache-mib", "2048", "--no-jemalloc"],
        "label": "lora: today's code, vLLM serves the LoRA, no checkpointing, 2 GiB KV",
    },
    "new": {"commit": None, "argv": [], "label": "new: today's demo (merged policy, every 2nd layer checkpointed, 256 MiB KV, jemalloc)"},
    "fp32": {"commit": None, "argv": ["--serving", "lora"], "label": "fp32: today's demo, vLLM serving the LoRA, fp32 weights"},
    "bf16": {"commit": None, "argv": ["--serving", "lora", "--dtype", "bfloat16"],
             "label": "bf16: today's demo, vLLM serving the LoRA, bf16 base weights (make demo-bf16)"},
}
SPLIT = ("rollout_seconds", "train_seconds", "save_seconds", "hot_load_seconds")


def load_demo() -> Any:
    """This checkout's ``examples/demo.py`` as a module (``rollout_throughput.py`` runs its rollout and tasks)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tracerl_demo", ROOT / "examples" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def export_commit(commit: str, into: Path) -> Path:
    """``commit``'s tree in ``into/src`` and an importable ``tracerl`` for it in ``into/pkg``; returns ``into/pkg``.

    The package layout maps ``tracerl`` to ``core/`` and three subpackages to top-level folders
    (pyproject's ``package-dir``), so the shim links them where Python looks for them."""
    src, pkg = into / "src", into / "pkg"
    src.mkdir(parents=True)
    pkg.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(src, filter="data")
    for sub in ("integrations", "ruler", "mcp_rl"):
        if (src / sub).is_dir() and not (src / "core" / sub).exists():
            (src / "core" / sub).symlink_to(src / sub, target_is_directory=True)
    (pkg / "tracerl").symlink_to(src / "core", target_is_directory=True)
    return pkg


def history_rows(data: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path in data.rglob("history.jsonl"):
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                pass
    return rows


def steps_from_history(rows: list[dict[str, Any]], started: float, steps: int) -> dict[str, Any]:
    """Set-up time, the step-0 held-out reward and the first ``steps`` steps (wall time, split, reward) of a run's history."""
    val0 = next(r for r in rows if r.get("step") == 0 and "val/reward" in r)
    previous = val0["time"]
    out: list[dict[str, Any]] = []
    for row in sorted(train_rows(rows), key=lambda r: r["step"])[:steps]:
        out.append({
            "step": row["step"],
            "wall_seconds": row["time"] - previous,
            **{key: row.get(f"train/{key}") for key in SPLIT},
            "backend_train_seconds": row.get("train/step_seconds"),  # all of backend.train: both days' code report it
            "train_reward": row["train/reward"],
            "sampler_trainer_prob_corr": row.get("train/sampler_trainer_prob_corr"),
            "forward_tokens": row.get("train/forward_tokens", 0.0),
            "trained_tokens": row.get("train/trained_tokens", 0.0),
        })  # fmt: skip
        previous = row["time"]
    return {"setup_and_eval_seconds": val0["time"] - started, "val_reward_step0": val0["val/reward"], "steps": out}


def train_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "train/reward" in r]


def stop_tree(proc: subprocess.Popen[str], grace_s: float = 90.0) -> None:
    """SIGINT (the demo's ``finally`` closes its backend and vLLM), then SIGKILL whatever is left of the tree."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.Error:
        tree = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    for process in tree:
        try:
            process.kill()
        except psutil.Error:
            pass
    proc.wait()


def run_side(name: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from ceiling import measure_ceiling
    from serving_speed import TreeRSS

    spec = SIDES[name]
    data = work / name / "data"
    data.mkdir(parents=True)
    env = dict(os.environ)
    tree = ROOT
    if spec["commit"]:
        pkg = export_commit(spec["commit"], work / name / "tree")
        tree = work / name / "tree" / "src"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pkg), env.get("PYTHONPATH", "")) if p)
    command = [
        sys.executable, str(tree / "examples" / "demo.py"), "--seed", str(args.seed), "--steps", str(args.steps + 2),
        "--inference", "vllm", "--eval-every", "1000", "--max-minutes", "60", "--data", str(data),
        "--plot", str(work / name / "curve.png"), *spec["argv"],
    ]  # fmt: skip
    ceiling = measure_ceiling()
    record: dict[str, Any] = {"side": name, "label": spec["label"], "command": command[1:], "ceiling_before": ceiling}
    log = (work / name / "demo.log").open("w")
    started = time.time()
    proc = subprocess.Popen(command, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        with TreeRSS(proc.pid, pss=True) as rss:
            while len(train_rows(history_rows(data))) < args.steps:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name}: the demo exited with {proc.returncode}; see {work / name / 'demo.log'}:\n"
                                       + (work / name / "demo.log").read_text()[-3000:])  # fmt: skip
                if time.time() - started > args.side_timeout_s:
                    raise TimeoutError(f"{name}: {args.steps} steps not logged within {args.side_timeout_s:.0f} s")
                time.sleep(0.5)
            stop_tree(proc)
    finally:
        if proc.poll() is None:
            stop_tree(proc, grace_s=10.0)
        log.close()
    record.update(steps_from_history(history_rows(data), started, args.steps))
    for s in record["steps"]:
        print(f"[{name}] step {s['step']}: {s['wall_seconds']:.1f}s  reward {s['train_reward']:.3f}  "
              + "  ".join(f"{k.split('_')[0]} {s[k]:.1f}" for k in SPLIT if s[k] is not None), flush=True)  # fmt: skip
    record["peak_tree_rss_mb"] = rss.peak / 2**20
    record["peak_tree_pss_mb"] = rss.pss_peak / 2**20
    allocator = [line for line in (work / name / "demo.log").read_text().splitlines() if line.startswith("allocator:")]
    record["allocator_line"] = allocator[0] if allocator else None
    print(f"[{name}] peak tree PSS {record['peak_tree_pss_mb']:.0f} MB; set-up + step-0 eval {record['setup_and_eval_seconds']:.0f} s", flush=True)
    return record


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    steps = record["steps"]
    walls = [s["wall_seconds"] for s in steps]
    flops = [2 * PARAMETERS * s["trained_tokens"] + 4 * PARAMETERS * s["forward_tokens"] for s in steps]
    gflops = statistics.median(f / s["wall_seconds"] / 1e9 for f, s in zip(flops, steps))
    split = {}
    for key in (*SPLIT, "backend_train_seconds"):
        values = [s[key] for s in steps if s.get(key) is not None]
        split[key] = statistics.median(values) if values else None
    corr = [s["sampler_trainer_prob_corr"] for s in steps if s.get("sampler_trainer_prob_corr") is not None]
    return {
        "median_wall": statistics.median(walls), "min_wall": min(walls), "max_wall": max(walls), **split,
        "gflops": gflops, "percent_of_ceiling": 100.0 * gflops / record["ceiling_before"]["matmul_gflops"],
        "min_corr": min(corr) if corr else None, "rewards": [s["train_reward"] for s in steps],
    }  # fmt: skip


def table(result: dict[str, Any]) -> str:
    from ceiling import describe

    def cell(value: float | None, digits: int = 1) -> str:
        return "–" if value is None else f"{value:.{digits}f}"

    lines = [
        "| side | s/step (median) | min–max | backend.train | rollouts | train | save | hot-load | set-up + step-0 eval (s) | "
        "GFLOP/s | % of ceiling | train reward per step | min prob corr | peak PSS of tree (MB) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    summaries = {}
    for record in result["sides"]:
        s = summaries[record["side"]] = summarize(record)
        lines.append(
            f"| {record['label']} | {s['median_wall']:.1f} | {s['min_wall']:.1f}–{s['max_wall']:.1f} | "
            f"{cell(s.get('backend_train_seconds'))} | {cell(s['rollout_seconds'])} | {cell(s['train_seconds'])} | {cell(s['save_seconds'], 2)} | {cell(s['hot_load_seconds'], 2)} | "
            f"{record['setup_and_eval_seconds']:.0f} | {s['gflops']:.1f} | {s['percent_of_ceiling']:.1f}% | "
            f"{', '.join(f'{r:.3f}' for r in s['rewards'])} | {cell(s['min_corr'], 10)} | {record['peak_tree_pss_mb']:.0f} |"
        )
    lines.append("")
    for baseline in ("filed", "lora"):
        if baseline in summaries and "new" in summaries:
            ratio = summaries["new"]["median_wall"] / summaries[baseline]["median_wall"]
            lines.append(f"new / {baseline} median s/step: **{ratio:.2f}×**")
    lines.append("")
    for record in result["sides"]:
        lines.append(f"- before {record['side']}: {describe(record['ceiling_before'])}")
    lines.append(f"- after the last side: {describe(result['ceiling_after'])}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per side")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--order", default="filed,new", help=f"sides, comma-separated, run in this order (known: {', '.join(SIDES)})")
    parser.add_argument("--side-timeout-s", type=float, default=1200.0, help="give up on a side after this long")
    parser.add_argument("--json", default=str(BENCH / "results" / "demo_step.json"), help="raw results (every step of every side)")
    parser.add_argument("--table-only", metavar="JSON", help="reprint the table from a stored result and exit")
    args = parser.parse_args()
    if args.table_only:
        print(table(json.loads(Path(args.table_only).read_text())))
        return
    order = args.order.split(",")
    unknown = set(order) - set(SIDES)
    if unknown:
        raise SystemExit(f"unknown side(s) {sorted(unknown)}; known: {sorted(SIDES)}")
    from ceiling import measure_ceiling

    result: dict[str, Any] = {"command": sys.argv, "seed": args.seed, "steps": args.steps, "order": args.order, "sides": []}
    with tempfile.TemporaryDirectory(prefix="tracerl-demo-step-") as work:
        for name in order:
            result["sides"].append(run_side(name, args, Path(work)))
    result["ceiling_after"] = measure_ceiling()
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
