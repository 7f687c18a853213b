"""Chaos: SIGKILL a real training loop at random instants, rerun it, check that nothing was lost.

    python tests/chaos.py --kills 24 --out bench/results/chaos.json          (``make chaos``)
    python tests/chaos.py --pipelined --kills 12 --out bench/results/chaos_pipelined.json

The child is :mod:`chaos_loop` (SmolLM2-135M, the transformers server, real generation,
``backend.train``, save, hot-load, ``model.log`` for train and val).  Kills mix two kinds:
*random* ones, the driver's SIGKILL after a random delay, and *targeted* ones, aimed at the
short phases (the commit/save, the hot-load, each ``model.log``, also rollouts, the train
step, the val eval and ``register``), where the child kills itself at a random file
operation or a random instant inside the phase.  Every run resumes the previous one and
asks for two more steps than are committed, so each kill lands in real work; after the
last kill a run goes to completion.  Then the checks: ``history.jsonl`` holds every step's
train and val row exactly once, every checkpoint loads with peft (finite weights), every
step's trajectories are there, no trajectory is trained twice, no temp files remain and
the run lock is free.  ``--pipelined``: the child's loop is ``tracerl.PipelineTrainer``
(rollouts overlap training); the same kills and checks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
CHILD = HERE / "chaos_loop.py"
RUN = ("chaos", "models", "chaos")
ROWS_PER_TRAIN_STEP, ROWS_PER_VAL_STEP = 4, 2  # chaos_loop: GROUPS * ROLLOUTS, len(VAL_PROMPTS)
# the short phases first: where a kill is most likely to leave something half-written
TARGETS = ["save", "hotload", "log_train", None, "log_val", "save", "train", None, "hotload", "log_train", "rollout",
           "save", None, "val", "register", "hotload", "save", None, "log_train", "train", "log_val", "save", None, "hotload"]  # fmt: skip
PIPELINED_TARGETS = ["save", "hotload", "log_train", None, "train", "log_val", "save", None, "hotload", "val", "log_train", None, "register"]
"""The pipelined loop has no rollout phase of its own (rollouts run beside the step)."""
CHILD_TIMEOUT_S = 900  # a run that hangs is a failure, not a wait


@dataclass
class Kill:
    """One killed run: what was aimed at, where the kill landed, the committed step before and after."""

    run: int
    aimed_at: str
    spec: str
    landed: str
    how: str
    step_before: int
    step_after: int
    seconds: float


def kill_spec(target: str | None, rng: random.Random) -> str:
    """How the child kills itself in ``target`` (``random:SECONDS``: the driver kills it after a delay)."""
    if target is None:
        return f"random:{rng.uniform(2.0, 30.0):.2f}"
    if target in ("save", "log_train", "log_val"):
        return f"{target}:op:{rng.randint(1, 14 if target == 'save' else 6)}"
    seconds = {"hotload": 0.4, "train": 4.0, "rollout": 1.5, "val": 1.0, "register": 10.0}[target]
    return f"{target}:delay:{rng.uniform(0.0, seconds):.3f}"


def run_child(
    data: Path, markers: Path, steps: int, spec: str | None, pipelined: bool = False, base_model: str = "smollm2-135m"
) -> tuple[int, int, float]:
    """Run the loop once (killed per ``spec``); returns its pid, return code and duration."""
    argv = [sys.executable, str(CHILD), "--data", str(data), "--markers", str(markers), "--steps", str(steps)]
    argv += ["--pipelined"] if pipelined else []
    argv += ["--base-model", base_model]
    delay = None
    if spec and spec.startswith("random:"):
        delay = float(spec.split(":")[1])
    elif spec:
        argv += ["--kill", spec]
    started = time.monotonic()
    with open(data.parent / "child.log", "a") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=delay if delay is not None else CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            if delay is None:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"the chaos child hung for {CHILD_TIMEOUT_S}s (see {data.parent / 'child.log'})") from None
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.pid, proc.returncode, time.monotonic() - started


def landed(markers: Path, pid: int) -> tuple[str, str]:
    """The innermost phase that ``pid`` started and never ended, and how it died."""
    stack: list[str] = []
    how = "SIGKILL from the driver"
    for line in markers.read_text().splitlines():
        event = json.loads(line)
        if event["pid"] != pid:
            continue
        if event["event"] == "start":
            stack.append(event["phase"])
        elif event["event"] == "end" and stack and stack[-1] == event["phase"]:
            stack.pop()
        elif event["event"] == "kill":
            how = event["how"]
    return (stack[-1] if stack else "between phases"), how


def run_dir(data: Path) -> Path:
    return data.joinpath(*RUN)


def committed_step(data: Path) -> int:
    checkpoints = run_dir(data) / "checkpoints"
    steps = [int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()] if checkpoints.is_dir() else []
    return max(steps, default=0)


def history_counts(data: Path) -> tuple[Counter, list[int], int]:
    """(step, split) -> rows, the numbers of unreadable lines, and how many rows were recovered on resume."""
    counts: Counter = Counter()
    bad, recovered = [], 0
    path = run_dir(data) / "history.jsonl"
    for number, line in enumerate(path.read_text().splitlines() if path.exists() else [], start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad.append(number)
            continue
        recovered += bool(row.get("recovered"))
        for split in {key.split("/")[0] for key in row if "/" in key}:
            counts[(row["step"], split)] += 1
    return counts, bad, recovered


def temp_files(data: Path) -> list[str]:
    return sorted(str(p.relative_to(data)) for p in data.rglob("*") if p.name.startswith((".tmp-", ".old-")))


def check_run(data: Path, final_step: int, base_model: str = "smollm2-135m") -> dict[str, Any]:
    """Everything a user would look at after the run; each entry True when it holds."""
    root = run_dir(data)
    counts, bad, recovered = history_counts(data)
    expected = Counter({**{(s, "train"): 1 for s in range(1, final_step + 1)}, **{(s, "val"): 1 for s in range(final_step + 1)}})
    missing = {
        f"{split}/{step:04d}.jsonl": n
        for split, steps, n in (("train", range(1, final_step + 1), ROWS_PER_TRAIN_STEP), ("val", range(final_step + 1), ROWS_PER_VAL_STEP))
        for step in steps
        if _trajectory_rows(root / "trajectories" / split / f"{step:04d}.jsonl") != n
    }
    extra = sorted(p.name for p in (root / "trajectories" / "train").glob("*.jsonl") if int(p.stem) > final_step)
    trained = [row["id"] for p in (root / "trajectories" / "train").glob("*.jsonl") for row in map(json.loads, p.read_text().splitlines())]
    checkpoints = sorted(int(p.name) for p in (root / "checkpoints").iterdir() if p.name.isdigit())
    return {
        "history_every_step_exactly_once": counts == expected,
        "history_unreadable_lines": bad,
        "history_rows_recovered_on_resume": recovered,
        "checkpoints_present": checkpoints == list(range(final_step + 1)),
        "checkpoints_load_with_peft": load_checkpoints(root, checkpoints, base_model),
        "trajectories_complete": not missing and not extra,
        "trajectories_missing_or_short": missing,
        "no_trajectory_trained_twice": len(trained) == len(set(trained)),
        "temp_files_left": temp_files(data),
        "run_lock_free": _lock_is_free(root / "run.lock"),
    }


def _trajectory_rows(path: Path) -> int:
    if not path.exists():
        return -1
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return len([r for r in rows if any(isinstance(m, dict) and m.get("token_ids") for m in r["messages_and_choices"])])


def _lock_is_free(path: Path) -> bool:
    import fcntl

    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
    return True


def load_checkpoints(root: Path, steps: list[int], base_model: str = "smollm2-135m") -> bool:
    """Load every checkpoint's adapter with peft (and its optimizer state) and check the weights are finite."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tracerl.base_models import resolve_base_model

    base = AutoModelForCausalLM.from_pretrained(resolve_base_model(base_model), dtype=torch.float32)
    model = None
    source = None  # the step whose training the previous checkpoint holds
    for step in steps:
        path = root / "checkpoints" / f"{step:04d}"
        if model is None:
            model = PeftModel.from_pretrained(base, path, adapter_name=f"s{step}")
        else:
            model.load_adapter(path, adapter_name=f"s{step}")
        if (path / "optimizer.pt").exists():
            torch.load(path / "optimizer.pt", weights_only=True)
        state = json.loads((path / "trainer_state.json").read_text())
        # a step with nothing to train copies the previous checkpoint forward, state file included (several in a row:
        # the tiny random model's groups often have no reward spread): it holds the same training as that one
        if state["step"] != step and (state["step"] != source or step - 1 not in steps):
            return False
        source = state["step"]
    lora = [p for name, p in model.named_parameters() if "lora_" in name] if model is not None else []
    return bool(lora) and all(bool(torch.isfinite(p).all()) for p in lora)


def run_chaos(
    workdir: Path,
    kills: int,
    *,
    seed: int = 0,
    targets: list[str | None] | None = None,
    say: Callable[[str], None] = print,
    pipelined: bool = False,
    base_model: str = "smollm2-135m",
) -> dict[str, Any]:
    """Kill the loop ``kills`` times (per ``targets``, cycled), rerun to completion, check; returns the result.

    ``base_model``: the child's model (``smollm2-135m``, or a model folder: the suite's tiny random Llama;
    its run takes seconds, so a random kill, 2 to 30 s in, would mostly come after the end)."""
    rng = random.Random(seed)
    data, markers = workdir / "data", workdir / "markers.jsonl"
    data.mkdir(parents=True, exist_ok=True)
    plan = list(targets if targets is not None else PIPELINED_TARGETS if pipelined else TARGETS)
    started = time.monotonic()
    log: list[Kill] = []
    runs = finished_early = 0
    while len(log) < kills:
        if runs > 3 * kills:
            raise RuntimeError(f"only {len(log)} of {runs} runs were killed: the kills do not land")
        target = plan[runs % len(plan)]
        spec = kill_spec(target, rng)
        before = committed_step(data)
        pid, returncode, seconds = run_child(data, markers, before + 2, spec, pipelined, base_model)
        runs += 1
        if returncode != -signal.SIGKILL:
            if returncode != 0:
                raise RuntimeError(f"run {runs} failed with exit code {returncode} (see {workdir / 'child.log'})")
            finished_early += 1
            continue
        phase, how = landed(markers, pid)
        kill = Kill(runs, target or "random", spec, phase, how, before, committed_step(data), round(seconds, 1))
        log.append(kill)
        duplicates = [key for key, n in history_counts(data)[0].items() if n > 1]
        if duplicates:
            raise RuntimeError(f"after kill {len(log)} ({phase}) history holds rows twice: {duplicates}")
        say(f"kill {len(log)}/{kills}: aimed at {kill.aimed_at}, landed in {phase} ({how}); step {before} -> {kill.step_after}")
    final_step = committed_step(data) + 1
    pid, returncode, _ = run_child(data, markers, final_step, None, pipelined, base_model)
    runs += 1
    if returncode != 0:
        raise RuntimeError(f"the final rerun failed with exit code {returncode} (see {workdir / 'child.log'})")
    checks = check_run(data, final_step, base_model)
    return {
        "kills": len(log),
        "landed": dict(Counter(k.landed for k in log).most_common()),
        "runs": runs,
        "reruns": runs - 1,
        "runs_that_finished_before_their_kill": finished_early,
        "final_step": final_step,
        "checks": checks,
        "passed": _passed(checks),
        "seconds": round(time.monotonic() - started, 1),
        "seed": seed,
        "loop": "pipelined" if pipelined else "synchronous",
        "kill_log": [asdict(k) for k in log],
    }


def _passed(checks: dict[str, Any]) -> bool:
    return (
        checks["history_every_step_exactly_once"]
        and not checks["history_unreadable_lines"]
        and checks["checkpoints_present"]
        and checks["checkpoints_load_with_peft"]
        and checks["trajectories_complete"]
        and checks["no_trajectory_trained_twice"]
        and not checks["temp_files_left"]
        and checks["run_lock_free"]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pipelined", action="store_true", help="the child's loop is tracerl.PipelineTrainer")
    parser.add_argument("--workdir", type=Path, default=None, help="an empty folder for the run (default: a new temp folder)")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tracerl-chaos-"))
    if workdir.exists() and any(workdir.iterdir()):
        raise SystemExit(f"{workdir} is not empty: remove it or pass another --workdir")
    print(f"chaos: {args.kills} kills in {workdir}", flush=True)
    result = run_chaos(workdir, args.kills, seed=args.seed, say=lambda line: print(line, flush=True), pipelined=args.pipelined)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "kill_log"}, indent=2))
    raise SystemExit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
