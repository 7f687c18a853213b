"""``Model`` (any OpenAI-compatible endpoint), ``TrainableModel`` (a LoRA we train) and ``Backend``.

Rollout code only needs ``openai_client()`` / ``litellm_completion_params()`` and
``get_inference_name()``; which backend trains and serves the model is chosen once,
by ``await model.register(backend)``.  The ``Backend`` interface lives here, beside the model
it serves, because each names the other: apart they would import each other.
"""

from __future__ import annotations

import logging
import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, runtime_checkable

from .errors import CheckpointError, ConfigError
from .runs.durable import JsonlReport, dumps_jsonl
from .runs.storage import RunDir, history_row, logged_splits, validate_name
from .timeouts import DEFAULT_INFERENCE_TIMEOUT, check_timeout
from .types import TrainResult, Trajectory, TrajectoryGroup, check_groups
from .validation import lora_values

if TYPE_CHECKING:  # pragma: no cover
    from openai import AsyncOpenAI

DEFAULT_BASE_PATH = ".tracerl"
logger = logging.getLogger("tracerl")

on_log: list[Callable[["Model", list[TrajectoryGroup], str, int, dict[str, Any]], Any]] = []
"""Called with ``(model, groups, split, step, row)`` after each :meth:`Model.log` wrote its row
(exporters and ``tracerl.integrations.wandb`` register here); a failing hook is logged, never raised."""


class Model:
    """A model reachable through an OpenAI-compatible endpoint (hosted, local, or served by us)."""

    trainable: bool = False

    def __init__(
        self,
        name: str,
        project: str,
        *,
        inference_base_url: str | None = None,
        inference_api_key: str | None = None,
        inference_model_name: str | None = None,
        base_path: str | Path = DEFAULT_BASE_PATH,
        inference_timeout: float | None = DEFAULT_INFERENCE_TIMEOUT,
    ) -> None:
        """``inference_timeout``: seconds per model call through ``openai_client()`` and
        ``litellm_completion_params()`` (``None``: no limit)."""
        self.name = validate_name(name, "model name")
        self.project = validate_name(project, "project name")
        self.inference_base_url = inference_base_url
        self.inference_api_key = inference_api_key
        self.inference_model_name = inference_model_name
        self.inference_timeout = check_timeout(inference_timeout, "inference_timeout")
        self.base_path = Path(base_path)
        self.run_dir = RunDir(self.base_path, project, name)
        self._backend: Backend | None = None
        self._client: AsyncOpenAI | None = None
        self._client_key: tuple[str | None, str | None, float | None] | None = None

    # -- inference -----------------------------------------------------------------
    def get_inference_name(self, step: int | None = None) -> str:
        return self.inference_model_name or self.name

    def openai_client(self) -> "AsyncOpenAI":
        """A cached ``AsyncOpenAI`` pointed at this model's endpoint."""
        if self.inference_base_url is None:
            raise ConfigError(
                f"model {self.name!r} has no inference endpoint yet: pass inference_base_url=... "
                "or call `await model.register(backend)` first"
            )
        key = (self.inference_base_url, self.inference_api_key, self.inference_timeout)
        if self._client is None or self._client_key != key:
            from openai import AsyncOpenAI, DefaultAsyncHttpxClient

            from .net.http_pool import http_module_of, openai_transport

            # a pool that stays cheap with 1,000 rollouts in flight, at less CPU per call (see tracerl.net.http_pool)
            self._client = AsyncOpenAI(
                base_url=self.inference_base_url,
                api_key=self.inference_api_key or "tracerl",
                max_retries=0,
                timeout=self.inference_timeout,
                http_client=DefaultAsyncHttpxClient(
                    event_hooks={"request": [_tag_group]},
                    transport=openai_transport(http_module_of(DefaultAsyncHttpxClient))),
            )
            self._client_key = key
        return self._client

    def litellm_completion_params(self, step: int | None = None) -> dict[str, Any]:
        """Keyword arguments for ``litellm.completion`` that reach this model."""
        params: dict[str, Any] = {"model": self.get_inference_name(step), "temperature": 1.0}
        if self.inference_timeout is not None:
            params["timeout"] = self.inference_timeout
        if self.inference_base_url:
            params.update(
                model=f"hosted_vllm/{self.get_inference_name(step)}",
                base_url=self.inference_base_url,
                api_key=self.inference_api_key or "tracerl",
            )
        return params

    # -- lifecycle -----------------------------------------------------------------
    async def register(self, backend: "Backend") -> None:
        """Attach a backend; a trainable model starts being served by it."""
        self._backend = backend
        await backend.register(self)

    async def get_step(self) -> int:
        if self._backend is not None:
            return await self._backend.get_step(self)
        latest = self.run_dir.latest_step()
        return latest or 0

    # -- logging -------------------------------------------------------------------
    async def log(
        self,
        groups_or_trajectories: Iterable[TrajectoryGroup | Trajectory] | TrajectoryGroup | None = None,
        *,
        split: str = "val",
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> dict[str, float]:
        """Average rewards and metrics, store the trajectories, append one row to ``history.jsonl``.

        Returns the row (metric names prefixed by ``split/``).  Idempotent per ``(step, split)``:
        when the history already holds that row (a rerun after a kill, or the row the backend
        recovered from the step's checkpoint) nothing is written, no ``on_log`` hook runs, and
        that row is returned.  The trajectories are written first, so the row is never there
        without them.
        """
        validate_name(split, "split")
        groups = _as_groups(groups_or_trajectories)
        check_groups(groups)  # a NaN set in place (t.metrics["x"] = nan) would poison the averages
        if step is None:
            step = await self.get_step()
        for row in reversed(self.run_dir.read_history()):
            if row.get("step") == step and split in logged_splits(row):
                return row
        row_metrics = aggregate_metrics(groups)
        row_metrics.update(metrics or {})
        if groups:
            self.run_dir.write_trajectories(split, step, trajectories_jsonl(groups))
        row = history_row(step, split, row_metrics)
        self.run_dir.append_history(row)
        for hook in on_log:
            try:
                hook(self, groups, split, step, row)
            except Exception:  # noqa: BLE001 - dashboards must never break training
                logger.warning("a model.log hook failed", exc_info=True)
        return row

    def history(self) -> list[dict[str, Any]]:
        """The rows of ``history.jsonl`` (torn or corrupt lines are skipped and logged)."""
        return self.run_dir.read_history()

    def history_report(self) -> JsonlReport:
        """The history rows plus the lines skipped as torn or corrupt, with their line numbers."""
        return self.run_dir.history_report()


class TrainableModel(Model):
    """A LoRA on ``base_model`` that a backend trains and serves as ``name@step``."""

    trainable = True

    def __init__(
        self,
        name: str,
        project: str,
        base_model: str,
        *,
        base_path: str | Path = DEFAULT_BASE_PATH,
        lora_config: dict[str, Any] | None = None,
        inference_base_url: str | None = None,
        inference_api_key: str | None = None,
        inference_timeout: float | None = DEFAULT_INFERENCE_TIMEOUT,
        chat_template: str | None = None,
        tool_call_parser: str | None = "auto",
        reasoning_parser: str | None = "auto",
    ) -> None:
        """``base_model``: ``"smollm2-135m"`` (embedded), a local Hugging Face folder, or a hub id.

        Serving settings, for the model's family (docs/supported-models.md); the defaults read them
        from the model's own chat template:

        - ``chat_template``: a Jinja template (text, or a ``.jinja`` file) used instead of the model's,
          for serving and training alike;
        - ``tool_call_parser``: how sampled tool calls are read: ``"auto"``, ``"hermes"``,
          ``"llama3"``, ``"mistral"``, ``"harmony"``, or None (left as text);
        - ``reasoning_parser``: ``"auto"`` (where the template writes reasoning back), ``"think"``
          (``<think>`` blocks) or None; the reply's reasoning becomes ``reasoning_content``.
        """
        super().__init__(
            name,
            project,
            inference_base_url=inference_base_url,
            inference_api_key=inference_api_key,
            base_path=base_path,
            inference_timeout=inference_timeout,
        )
        from .inference.turns import check_parsers

        check_parsers(tool_call_parser, reasoning_parser)
        if chat_template is not None and (not isinstance(chat_template, str) or not chat_template.strip()):
            raise ConfigError("chat_template must be a Jinja template (text, or a .jinja file's path)")
        self.chat_template = chat_template
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        if not base_model:
            raise ConfigError("base_model must name a model, e.g. 'smollm2-135m' or a local HF folder")
        self.base_model = base_model
        lora_values(lora_config)  # a bad rank or dropout fails here, not at the first train step
        self.lora_config = dict(lora_config or {})
        self._step_cache: int | None = None

    @property
    def serving_settings(self) -> dict[str, Any]:
        """``chat_template``, ``tool_call_parser`` and ``reasoning_parser``, as a backend passes them on."""
        return {"chat_template": self.chat_template, "tool_call_parser": self.tool_call_parser,
                "reasoning_parser": self.reasoning_parser}  # fmt: skip

    def get_inference_name(self, step: int | None = None) -> str:
        """``"name@step"``; the latest step when ``step`` is None."""
        if step is None:
            step = self._step_cache if self._step_cache is not None else (self.run_dir.latest_step() or 0)
        return f"{self.name}@{step}"

    def policy_step(self, served_name: str | None) -> int | None:
        """The step in ``served_name`` when it names a policy of this model (``"name@step"``), else None.

        Sampled turns carry the name their server answered with (:attr:`tracerl.Choice.model`),
        so this is the policy version that sampled a turn."""
        if not served_name:
            return None
        name, at, step = served_name.rpartition("@")
        return int(step) if at and name == self.name and step.isdigit() else None

    async def train_sft(self, trajectories: Any, config: Any = None, **kwargs: Any) -> "TrainResult":
        """ART's ``model.train_sft(trajectories, config)``: ``backend.train_sft`` on the registered backend."""
        if self._backend is None:
            raise CheckpointError("register the model with a backend before train_sft")
        return await self._backend.train_sft(self, trajectories, config, **kwargs)

    async def delete_checkpoints(self, best_checkpoint_metric: str = "val/reward", *, keep_last: int = 1) -> list[int]:
        """Delete checkpoints except the latest ``keep_last`` and the best by ``best_checkpoint_metric``.

        The steps come from the backend (a remote one keeps the checkpoints on its machine); the
        best step from this model's ``history.jsonl``, where ``log`` writes.  Returns the deleted steps.
        """
        if self._backend is None:
            raise CheckpointError("register the model with a backend before deleting checkpoints")
        if keep_last < 1:
            raise ConfigError(f"keep_last must be at least 1 (the latest checkpoint is the one served), got {keep_last}")
        best = best_step(self.history(), best_checkpoint_metric)
        steps = await self._backend.list_checkpoints(self)
        keep = set(steps[-keep_last:]) | ({best} if best is not None else set())
        return await self._backend.delete_checkpoints(self, keep=sorted(keep))


def best_step(history: list[dict[str, Any]], metric: str) -> int | None:
    """The step whose logged ``metric`` is highest (None when never logged)."""
    scored = [(row[metric], row["step"]) for row in history if isinstance(row.get(metric), (int, float))]
    return max(scored)[1] if scored else None


def _as_groups(items: Any) -> list[TrajectoryGroup]:
    if items is None:
        return []
    if isinstance(items, (TrajectoryGroup, Trajectory)):
        items = [items]
    groups: list[TrajectoryGroup] = []
    loose: list[Trajectory] = []
    for item in items:
        if isinstance(item, TrajectoryGroup):
            groups.append(item)
        elif isinstance(item, Trajectory):
            loose.append(item)
        else:
            raise ConfigError(f"log() takes trajectory groups or trajectories, got {type(item).__name__}")
    if loose:
        groups.append(TrajectoryGroup(loose))
    return groups


def trajectories_jsonl(groups: list[TrajectoryGroup]) -> str:
    """The stored form of a step's trajectories: one per line, with its group's index."""
    return dumps_jsonl({"group": gi, **t.to_json_dict()} for gi, group in enumerate(groups) for t in group.trajectories)


def aggregate_metrics(groups: list[TrajectoryGroup]) -> dict[str, float]:
    """Means over trajectories of reward and every metric, plus group-level spread and failures."""
    trajectories = [t for g in groups for t in g.trajectories]
    n_exceptions = sum(len(g.exceptions) for g in groups)
    out: dict[str, float] = {}
    if trajectories:
        out["reward"] = statistics.fmean(t.reward for t in trajectories)
        spreads = [statistics.pstdev(g.rewards) for g in groups if len(g.trajectories) > 1]
        if spreads:
            out["reward_std_dev"] = statistics.fmean(spreads)
        keys = sorted({k for t in trajectories for k in t.metrics})
        for key in keys:
            values = [float(t.metrics[key]) for t in trajectories if key in t.metrics]
            values = [v for v in values if math.isfinite(v)]
            if values:
                out[key] = statistics.fmean(values)
    for key in sorted({k for g in groups for k in g.metrics}):
        values = [float(g.metrics[key]) for g in groups if key in g.metrics]
        out[f"group_{key}"] = statistics.fmean(values)
    total = len(trajectories) + n_exceptions
    out["num_trajectories"] = float(len(trajectories))
    out["exception_rate"] = n_exceptions / total if total else 0.0
    return out


async def _tag_group(request: Any) -> None:
    """Name the rollout group on each model call (header ``x-tracerl-group``), so a router in front
    of several replicas keeps a group's calls on one of them (its shared prompt is cached there)."""
    from .cluster.routing import GROUP_HEADER
    from .types import current_group_id

    group = current_group_id()
    if group is not None and GROUP_HEADER not in request.headers:
        request.headers[GROUP_HEADER] = group


@runtime_checkable
class Backend(Protocol):
    """Who serves and trains a ``TrainableModel``.

    Implementations: :class:`tracerl.LocalBackend` (this machine, CPU or GPU) and
    :class:`tracerl.RemoteBackend` (the HTTP client of ``tracerl serve``, which wraps a
    ``LocalBackend`` on the machine with the GPUs, so rollouts can stay on a laptop).  Backend
    knobs are explicit keyword arguments of ``train``; an unknown keyword is a ``TypeError``.
    Optional: ``policy_lease(model, step)``, an async context manager that keeps ``name@step``
    served while it is held (``LocalBackend``; ``PipelineTrainer`` uses it where it exists).
    """

    async def register(self, model: "Model") -> None:
        """Prepare storage for ``model`` and, if trainable, start serving its latest step."""

    async def train(self, model: "Model", groups: Iterable["TrajectoryGroup"], **kwargs: object) -> "TrainResult":
        """Run one GRPO step on ``groups``, save checkpoint ``step+1``, serve it, return the result."""

    async def train_sft(self, model: "Model", trajectories: Any, config: Any = None, **kwargs: object) -> "TrainResult":
        """Supervised fine-tuning of the same LoRA (one checkpoint step, served as ``name@step``; ``tracerl.train.sft``)."""

    async def get_step(self, model: "Model") -> int:
        """The model's latest complete checkpoint step."""

    async def list_checkpoints(self, model: "Model") -> list[int]:
        """Steps of the model's complete checkpoints where this backend keeps them, oldest first."""

    async def delete_checkpoints(self, model: "Model", keep: list[int]) -> list[int]:
        """Delete every checkpoint not in ``keep`` (the latest is always kept); return the deleted steps."""

    async def close(self) -> None:
        """Stop servers and release the trainer."""
