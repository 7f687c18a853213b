"""Combine several seeds of a training example into one held-out curve (mean, min–max band) and print the numbers.

    python examples/plot_seeds.py --out docs/langgraph_learns_seeds.png \\
        .tracerl/langgraph_learns/models/langgraph-company-s{0,1,2}

Each argument is a run directory (or its ``history.jsonl``); the label of a run is its
directory's name.  Only steps every run evaluated at are averaged.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tracerl.runs.plots import plot_seeds


def read_history(path: Path) -> list[dict]:
    path = path / "history.jsonl" if path.is_dir() else path
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="run directories or history.jsonl files")
    p.add_argument("--metric", default="val/reward")
    p.add_argument("--out", type=Path, required=True, help="PNG to write")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    histories = {(r.parent.name if r.name == "history.jsonl" else r.name.removesuffix(".jsonl").removesuffix("_history")): read_history(r) for r in args.runs}
    summary = plot_seeds(histories, args.metric, args.out, title=args.title or f"{args.metric}, {len(histories)} seeds")
    print(f"{'step':>5}  {'mean':>6}  {'std':>6}  {'min':>6}  {'max':>6}   " + "  ".join(histories))
    for s in summary:
        values = "  ".join(f"{ {r['step']: r[args.metric] for r in rows if args.metric in r}[s['step']]:.3f}" for rows in histories.values())
        print(f"{s['step']:>5}  {s['mean']:.3f}  {s['std']:.3f}  {s['min']:.3f}  {s['max']:.3f}   {values}")
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
