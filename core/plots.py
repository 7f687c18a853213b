"""Reward curves from history.jsonl (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence


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
