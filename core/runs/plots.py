"""Reward curves from history.jsonl (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence


def plot_history(rows: Sequence[dict[str, Any]], metrics: Sequence[str], out: Path, *, title: str = "") -> Path:
    """One line per metric against the step; missing points are skipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for metric in metrics:
        points = sorted((r["step"], r[metric]) for r in rows if isinstance(r.get(metric), (int, float)))
        if points:
            ax.plot(*zip(*points), marker="o", label=metric)
    ax.set_xlabel("step")
    ax.set_ylabel("value")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def seed_summary(histories: Mapping[str, Sequence[dict[str, Any]]], metric: str) -> list[dict[str, float]]:
    """Per step that every run logged ``metric`` at: the mean, sample standard deviation, min and max over runs.

    A step some seeds did not reach (a run stopped early) is left out rather than averaged over
    fewer seeds, so a curve never mixes populations.
    """
    import statistics

    per_run = [{r["step"]: float(r[metric]) for r in rows if isinstance(r.get(metric), (int, float))} for rows in histories.values()]
    steps = sorted(set.intersection(*(set(p) for p in per_run))) if per_run else []
    summary = []
    for step in steps:
        values = [p[step] for p in per_run]
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        summary.append({"step": step, "mean": statistics.fmean(values), "std": std, "min": min(values), "max": max(values), "n": len(values)})
    return summary


def plot_seeds(histories: Mapping[str, Sequence[dict[str, Any]]], metric: str, out: Path, *, title: str = "") -> list[dict[str, float]]:
    """Several runs (seeds) of one recipe: each run's ``metric`` faintly, their mean bold, the min–max band shaded.

    Returns :func:`seed_summary` (what the plot shows), so a caller can print the same numbers.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = seed_summary(histories, metric)
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, rows in histories.items():
        points = sorted((r["step"], r[metric]) for r in rows if isinstance(r.get(metric), (int, float)))
        if points:
            ax.plot(*zip(*points), marker=".", alpha=0.35, linewidth=1, label=label)
    if summary:
        steps = [s["step"] for s in summary]
        ax.fill_between(steps, [s["min"] for s in summary], [s["max"] for s in summary], alpha=0.2, color="C0", label="min–max")
        ax.plot(steps, [s["mean"] for s in summary], marker="o", linewidth=2.5, color="C0", label=f"mean of {len(histories)}")
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return summary
