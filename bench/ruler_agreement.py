"""How well does RULER with a *small local* judge agree with a verifiable reward?

The demo task (``examples/demo.py``: a calculator agent, reward checked in code) gives groups
of rollouts from the few-shot-prompted base model at T=1.  Each group is then judged by RULER
with SmolLM2-135M itself as the judge, served by vLLM, in two ways:

- ``schema``: RULER asks for its JSON schema (``response_format``), which vLLM enforces with
  guided decoding (structured outputs), so even a 135M model answers in the right format;
- ``text``: no schema (``response_format=None``), RULER parses the free text tolerantly.

Reported per variant: the share of groups with well-formed scores (first try / after RULER's
one corrective re-ask), and agreement with the verifiable reward over the groups whose rewards
differ: the mean per-group Spearman rank correlation and the pairwise accuracy (pairs of one
group with different checked rewards that the judge orders the same way; judge ties count
half; chance = 0.5).  An honest number, whatever it is: it says whether such a judge can
stand in for a reward on this task.

    python bench/ruler_agreement.py --groups 60 --group-size 4 --out bench/results/ruler_agreement.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import tracerl
from tracerl.ruler import JudgeEndpoint, ruler

ROOT = Path(__file__).resolve().parents[1]


def load_demo() -> Any:
    """The demo's task, rollout and reward, reused as they are (examples/demo.py)."""
    spec = importlib.util.spec_from_file_location("tracerl_demo", ROOT / "examples" / "demo.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def ranks(values: list[float]) -> list[float]:
    """Ranks with ties averaged (what Spearman's rho is computed on)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman's rho, or None when either side is constant (undefined)."""
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    sy = math.sqrt(sum((b - my) ** 2 for b in ry))
    if sx == 0 or sy == 0:
        return None
    return sum((a - mx) * (b - my) for a, b in zip(rx, ry)) / (sx * sy)


def pairwise(truth: list[float], judged: list[float]) -> tuple[float, int]:
    """(agreeing pairs, pairs) over the pairs whose checked rewards differ; a judge tie counts half."""
    agree, pairs = 0.0, 0
    for i in range(len(truth)):
        for j in range(i + 1, len(truth)):
            if truth[i] == truth[j]:
                continue
            pairs += 1
            d = (truth[i] - truth[j]) * (judged[i] - judged[j])
            agree += 1.0 if d > 0 else 0.5 if judged[i] == judged[j] else 0.0
    return agree, pairs


async def judge_all(
    groups: list[tracerl.TrajectoryGroup], judge: JudgeEndpoint, *, schema: bool, max_tokens: int, concurrency: int,
    debug: bool = False,
) -> list[dict[str, Any]]:
    """One RULER call per group (at most ``concurrency`` at once); failures recorded, not raised."""
    params: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0}
    if not schema:
        params["response_format"] = None
    gate = asyncio.Semaphore(concurrency)

    async def one(group: tracerl.TrajectoryGroup) -> dict[str, Any]:
        async with gate:
            started = time.perf_counter()
            try:
                scores = await ruler(list(group.trajectories), judge, extra_litellm_params=params, cache=False, debug=debug)
            except tracerl.JudgeError as error:
                return {"ok": False, "error": str(error), "seconds": time.perf_counter() - started}
            return {
                "ok": True,
                "scores": [s.score for s in scores],
                "retries": scores.metrics.get("ruler_corrective_retries", 0.0),
                "completion_tokens": scores.metrics.get("ruler_judge_completion_tokens", 0.0),
                "seconds": time.perf_counter() - started,
            }

    return list(await asyncio.gather(*(one(g) for g in groups)))


def compared(truth: list[list[float]], results: list[dict[str, Any]]) -> list[tuple[float, float, int]]:
    """(Spearman, agreeing pairs, pairs) per group that is well-formed and whose checked rewards differ."""
    out = []
    for rewards, result in zip(truth, results):
        if not result["ok"] or len(set(rewards)) < 2:
            continue
        rho = spearman(rewards, result["scores"])
        a, p = pairwise(rewards, result["scores"])
        out.append((0.0 if rho is None else rho, a, p))  # a judge that gives all the same score ranks nothing
    return out


def bootstrap(rows: list[tuple[float, float, int]], draws: int = 2000, seed: int = 0) -> dict[str, list[float] | None]:
    """95% percentile intervals of mean Spearman and pairwise accuracy, groups resampled with replacement."""
    if len(rows) < 2:
        return {"mean_spearman_95": None, "pairwise_accuracy_95": None}
    rng = random.Random(seed)
    rhos, accs = [], []
    for _ in range(draws):
        sample = [rows[rng.randrange(len(rows))] for _ in rows]
        rhos.append(statistics.fmean(r for r, _, _ in sample))
        pairs = sum(p for _, _, p in sample)
        if pairs:
            accs.append(sum(a for _, a, _ in sample) / pairs)

    def interval(values: list[float]) -> list[float]:
        values = sorted(values)
        return [values[int(0.025 * len(values))], values[min(len(values) - 1, int(0.975 * len(values)))]]

    return {"mean_spearman_95": interval(rhos), "pairwise_accuracy_95": interval(accs) if accs else None}


def summarize(truth: list[list[float]], results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in results if r["ok"]]
    rows = compared(truth, results)
    rhos = [r for r, _, _ in rows]
    agree, pairs = sum(a for _, a, _ in rows), sum(p for _, _, p in rows)
    return {
        "groups": len(results),
        "well_formed": len(ok),
        "well_formed_first_try": sum(1 for r in ok if not r.get("retries")),
        "groups_compared": len(rhos),
        "mean_spearman": statistics.fmean(rhos) if rhos else None,
        "pairwise_accuracy": agree / pairs if pairs else None,
        "pairs": pairs,
        **bootstrap(rows),
        "all_same_score": sum(1 for r in ok if len(set(r["scores"])) == 1),
        "median_seconds_per_group": statistics.median(r["seconds"] for r in results) if results else None,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    demo = load_demo()
    backend = tracerl.LocalBackend(path=tempfile.mkdtemp(prefix="ruler-agreement-"), inference="vllm")
    model = tracerl.TrainableModel(name="policy", project="ruler-agreement", base_model="smollm2-135m")
    try:
        started = time.perf_counter()
        await model.register(backend)
        setup_s = time.perf_counter() - started
        tasks = demo.make_tasks(args.seed + 1000, args.groups)
        started = time.perf_counter()
        groups = await tracerl.gather_trajectory_groups(
            (
                tracerl.TrajectoryGroup(demo.rollout(model, task, temperature=1.0, seed=None) for _ in range(args.group_size))
                for task in tasks
            ),
            pbar_desc="rollouts",
            max_exceptions=args.groups * args.group_size,
        )
        rollout_s = time.perf_counter() - started
        truth = [[float(t.reward) for t in g.trajectories] for g in groups]
        judge = JudgeEndpoint(base_url=str(model.inference_base_url), model=model.get_inference_name(), api_key=model.inference_api_key)
        variants: dict[str, Any] = {}
        for name, schema in (("schema", True), ("text", False)):
            if name not in args.variants:
                continue
            started = time.perf_counter()
            results = await judge_all(groups, judge, schema=schema, max_tokens=args.judge_max_tokens, concurrency=args.concurrency,
                                     debug=args.debug)
            variants[name] = {**summarize(truth, results), "seconds": time.perf_counter() - started, "results": results}
        return {
            "args": vars(args),
            "setup_s": setup_s,
            "rollout_s": rollout_s,
            "groups_with_reward_spread": sum(1 for r in truth if len(set(r)) > 1),
            "rewards": truth,
            "variants": variants,
        }
    finally:
        await backend.close()


def _interval(bounds: list[float] | None, spec: str) -> str:
    return "" if not bounds else f" [{bounds[0]:{spec}}, {bounds[1]:{spec}}]"


def rescore(path: Path) -> dict[str, Any]:
    """Recompute every variant's summary from the raw results in ``path`` (no model needed)."""
    outcome = json.loads(path.read_text())
    for variant in outcome["variants"].values():
        variant.update(summarize(outcome["rewards"], variant["results"]))
    return outcome


def table(result: dict[str, Any]) -> str:
    lines = [
        "| judge answer | well-formed groups (first try) | groups compared | mean Spearman ρ | pairwise accuracy (chance 0.5) | median s / group |",
        "|---|---|---|---|---|---|",
    ]
    for name, label in (("schema", "JSON schema (vLLM guided decoding)"), ("text", "free text, parsed tolerantly")):
        if name not in result["variants"]:
            continue
        v = result["variants"][name]
        rho = "–" if v["mean_spearman"] is None else f"{v['mean_spearman']:+.2f}" + _interval(v.get("mean_spearman_95"), "+.2f")
        acc = "–" if v["pairwise_accuracy"] is None else (
            f"{v['pairwise_accuracy']:.2f}" + _interval(v.get("pairwise_accuracy_95"), ".2f") + f" ({v['pairs']} pairs)"
        )
        lines.append(
            f"| {label} | {v['well_formed']}/{v['groups']} ({v['well_formed_first_try']}) | {v['groups_compared']} | {rho} | {acc} | {v['median_seconds_per_group']:.1f} |"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=60)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--judge-max-tokens", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--variants", type=lambda text: text.split(","), default=["schema", "text"], help="schema,text")
    parser.add_argument("--debug", action="store_true", help="print each judge prompt and raw answer to stderr")
    parser.add_argument("--rescore", type=Path, help="recompute the summaries of a saved result file, write it back, print the table")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ruler_agreement.json")
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.rescore:
        rescored = rescore(arguments.rescore)
        arguments.rescore.write_text(json.dumps(rescored, indent=1, default=str))
        print(table(rescored))
        sys.exit(0)
    outcome = asyncio.run(main(arguments))
    arguments.out.write_text(json.dumps(outcome, indent=1, default=str))
    print(f"setup {outcome['setup_s']:.0f} s, rollouts {outcome['rollout_s']:.0f} s; "
          f"{outcome['groups_with_reward_spread']}/{arguments.groups} groups have different checked rewards")
    print(table(outcome))
