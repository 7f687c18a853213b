"""The MCP•RL recipe: discover the tools, write practice tasks, run the agent, judge it with RULER, train.

``await train_mcp_agent(model, backend, server, judge_model=..., generator_model=...)``

1. ``discover(server)``: the tools (and resources) the server offers.
2. Scenarios: read from ``scenarios.jsonl`` in the model's run directory when it exists
   (a rerun reuses them), else generated once (``generate_scenarios``), split into train
   and val deterministically, and saved there.
3. For each step from ``await model.get_step()`` to ``steps``: gather
   ``groups_per_step`` groups of ``rollouts_per_group`` attempts (``run_mcp_agent``; each
   attempt opens its own MCP session, a stdio server is started per attempt, unless
   ``share_session``), score each group with RULER as it finishes,
   ``backend.train``, ``model.log(split="train")``.  Every ``val_every`` steps the val
   scenarios are run and judged the same way and logged as ``split="val"``.

Resuming is re-running: the step comes from the newest checkpoint and the dataset
iterator skips the batches already trained on.  ``train_mcp_agent_locally`` builds the
``TrainableModel`` + ``LocalBackend`` around it (what the CLI and the example use).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tracerl
from tracerl.errors import ConfigError
from tracerl.model import DEFAULT_BASE_PATH
from tracerl.ruler import DEFAULT_RUBRIC, ruler_score_group

from .agent import DEFAULT_SYSTEM_PROMPT, run_mcp_agent
from .scenarios import Scenario, generate_scenarios, load_scenarios, save_scenarios
from .server import Discovery, McpServerSpec, discover, open_session

logger = logging.getLogger("tracerl.mcp_rl")


@dataclass
class McpRLResult:
    """What a run did: the tools found, the scenarios used, one summary row per step trained now."""

    discovery: Discovery
    train_scenarios: list[Scenario]
    val_scenarios: list[Scenario]
    scenarios_path: Path
    final_step: int
    rows: list[dict[str, Any]] = field(default_factory=list)


def scenarios_file(model: tracerl.Model) -> Path:
    return model.run_dir.root / "mcp_rl" / "scenarios.jsonl"


async def prepare_scenarios(
    model: tracerl.Model,
    discovery: Discovery,
    *,
    generator_model: Any,
    num_train: int,
    num_val: int,
    custom_instructions: str | None = None,
    generator_params: dict[str, Any] | None = None,
    path: Path | None = None,
    seed: int = 0,
) -> tuple[list[Scenario], list[Scenario], Path]:
    """The run's (train, val) scenarios: reused from ``path`` when it exists, else generated and saved."""
    path = Path(path) if path is not None else scenarios_file(model)
    if path.exists():
        rows = load_scenarios(path)
        logger.info("reusing %d scenarios from %s", len(rows), path)
    else:
        generated = await generate_scenarios(
            discovery.tools,
            num_train + num_val,
            generator_model,
            resources=discovery.resources,
            custom_instructions=custom_instructions,
            extra_litellm_params=generator_params,
        )
        order = list(range(len(generated)))
        random.Random(seed).shuffle(order)
        val_ids = set(order[:num_val])
        rows = [
            Scenario(task=s.task, difficulty=s.difficulty, split="val" if i in val_ids else "train")
            for i, s in enumerate(generated)
        ]
        save_scenarios(path, rows)
        logger.info("generated %d scenarios into %s", len(rows), path)
    train = [s for s in rows if s.split == "train"]
    val = [s for s in rows if s.split == "val"]
    if not train:
        raise ConfigError(f"{path} holds no train scenarios")
    return train, val, path


async def _gather(
    model: tracerl.Model, server: McpServerSpec, scenarios: list[Scenario], settings: dict[str, Any], desc: str
) -> list[tracerl.TrajectoryGroup]:
    rollout = functools.partial(
        run_mcp_agent,
        max_turns=settings["max_turns"],
        max_tokens=settings["max_tokens"],
        temperature=settings["temperature"],
        system_prompt=settings["system_prompt"],
    )
    judge = functools.partial(
        ruler_score_group,
        judge_model=settings["judge_model"],
        rubric=settings["rubric"],
        extra_litellm_params=settings["judge_params"],
        swallow_exceptions=True,
    )
    async with contextlib.AsyncExitStack() as stack:
        target: Any = server
        if settings["share_session"]:  # one connection for every attempt of this gather
            target = await stack.enter_async_context(open_session(server))
        return await tracerl.gather_trajectory_groups(
            (
                tracerl.TrajectoryGroup(
                    (rollout(model, target, s) for _ in range(settings["rollouts_per_group"])),
                    metadata={"task": s.task, "scenario_id": s.id},
                )
                for s in scenarios
            ),
            pbar_desc=desc,
            max_exceptions=settings["max_exceptions"],
            after_each=judge,
        )


async def train_mcp_agent(
    model: tracerl.TrainableModel,
    backend: Any,
    server: McpServerSpec,
    *,
    judge_model: Any,
    generator_model: Any,
    steps: int = 10,
    groups_per_step: int = 2,
    rollouts_per_group: int = 4,
    num_train_scenarios: int = 16,
    num_val_scenarios: int = 4,
    val_every: int = 0,
    max_turns: int = 5,
    max_tokens: int = 256,
    temperature: float = 1.0,
    learning_rate: float = 1e-5,
    system_prompt: str = DEFAULT_SYSTEM_PROMPT,
    rubric: str = DEFAULT_RUBRIC,
    judge_params: dict[str, Any] | None = None,
    generator_params: dict[str, Any] | None = None,
    custom_instructions: str | None = None,
    scenarios_path: str | Path | None = None,
    max_exceptions: float = 0.5,
    share_session: bool = False,
    seed: int = 0,
    train_kwargs: dict[str, Any] | None = None,
) -> McpRLResult:
    """Train ``model`` (registered with ``backend``) as an agent on ``server`` until step ``steps``.

    ``judge_model`` / ``generator_model``: a LiteLLM model string, a
    ``tracerl.ruler.JudgeEndpoint`` or a ``tracerl.Model``.  ``max_exceptions``: the
    fraction of failed attempts tolerated per gather.  ``train_kwargs`` go to
    ``backend.train`` (e.g. ``loss_fn``).  Groups the judge cannot score are dropped
    (``groups_dropped`` in the logged metrics); a step with no group left is skipped.
    """
    if rollouts_per_group < 2:
        raise ConfigError("RULER and GRPO compare attempts: rollouts_per_group must be >= 2")
    discovery = await discover(server)
    logger.info("MCP server %s: %d tools (%s)", server.label, len(discovery.tools), ", ".join(t.name for t in discovery.tools))
    train, val, path = await prepare_scenarios(
        model,
        discovery,
        generator_model=generator_model,
        num_train=num_train_scenarios,
        num_val=num_val_scenarios,
        custom_instructions=custom_instructions,
        generator_params=generator_params,
        path=Path(scenarios_path) if scenarios_path else None,
        seed=seed,
    )
    settings = dict(
        max_turns=max_turns, max_tokens=max_tokens, temperature=temperature, system_prompt=system_prompt,
        judge_model=judge_model, rubric=rubric, judge_params=judge_params,
        rollouts_per_group=rollouts_per_group, max_exceptions=max_exceptions, share_session=share_session,
    )  # fmt: skip
    result = McpRLResult(discovery, train, val, path, final_step=await model.get_step())
    start = result.final_step
    if start >= steps:
        logger.info("model %s is already at step %d >= %d: nothing to do", model.name, start, steps)
        return result
    epochs = math.ceil(steps * groups_per_step / len(train)) + 1
    for batch in tracerl.iterate_dataset(train, groups_per_step, num_epochs=epochs, initial_step=start, use_tqdm=False, seed=seed):
        if batch.step >= steps:
            break
        groups = await _gather(model, server, batch.items, settings, desc=f"step {batch.step + 1}/{steps}")
        if not groups:
            logger.warning("step %d: every group was dropped (judge failures?); skipping the step", batch.step + 1)
            continue
        trained = await backend.train(model, groups, learning_rate=learning_rate, **(train_kwargs or {}))
        metrics = {**trained.metrics, **{f"gather_{k}": v for k, v in getattr(groups, "metrics", {}).items()}}
        row = await model.log(groups, split="train", metrics=metrics, step=trained.step)
        result.rows.append(row)
        result.final_step = trained.step
        logger.info("step %d: train/reward %.3f", trained.step, row.get("train/reward", float("nan")))
        if val and val_every and trained.step % val_every == 0:
            val_groups = await _gather(model, server, val, settings, desc=f"val {trained.step}")
            if val_groups:
                result.rows.append(await model.log(val_groups, split="val", step=trained.step))
    return result


async def train_mcp_agent_locally(
    server: McpServerSpec,
    *,
    name: str,
    project: str = "mcp-rl",
    base_model: str = "smollm2-135m",
    base_path: str | Path = DEFAULT_BASE_PATH,
    inference: str = "auto",
    **kwargs: Any,
) -> McpRLResult:
    """``train_mcp_agent`` with a ``TrainableModel`` served and trained by a ``LocalBackend`` here."""
    from tracerl.local_backend import LocalBackend

    model = tracerl.TrainableModel(name, project, base_model, base_path=base_path)
    backend = LocalBackend(inference=inference)  # type: ignore[arg-type]
    try:
        await model.register(backend)
        return await train_mcp_agent(model, backend, server, **kwargs)
    finally:
        await backend.close()


def server_spec(command: str | None, url: str | None, env: list[str] | tuple[str, ...] = ()) -> McpServerSpec:
    """The spec for ``--server-command`` / ``--server-url`` / ``--env KEY=VALUE`` (raises ``ConfigError``)."""
    if bool(command) == bool(url):
        raise ConfigError("give exactly one of --server-command or --server-url")
    pairs = {}
    for item in env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--env wants KEY=VALUE, got {item!r}")
        pairs[key] = value
    if url:
        return McpServerSpec.http(url)
    return McpServerSpec.stdio(str(command), env=pairs or None)


def llm_target(model: str, base_url: str | None = None) -> Any:
    """A LiteLLM model string, or a ``JudgeEndpoint`` when an OpenAI-compatible ``base_url`` is given."""
    if base_url:
        from tracerl.ruler import JudgeEndpoint

        return JudgeEndpoint(base_url=base_url, model=model)
    return model
