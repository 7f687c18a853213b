"""``LocalBackend``: train and serve a ``TrainableModel`` on this machine (CPU or GPU).

``register`` resolves the base model, writes the fresh LoRA as checkpoint 0000 (or resumes
from the newest complete checkpoint) and starts the inference server; ``train`` runs one
GRPO step, writes checkpoint ``step+1`` atomically and hot-loads it as ``name@step+1``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterable, Literal

from ..base_models import resolve_base_model, with_chat_template
from ..errors import CheckpointError, ConfigError, MismatchError, NonFiniteError, TrajectoryError
from ..gather import GatheredGroups
from ..inference.devices import DTYPES, default_device, release_cached_gpu_memory
from ..inference.vllm_server import VLLMServer, has_gpu, vllm_lora_rank, vllm_python
from ..model import Model, TrainableModel, aggregate_metrics, trajectories_jsonl
from ..runs.run_lock import RunLock
from ..runs.storage import TRAIN_SPLIT, RunDir, atomic_dir
from ..types import Choice, TrainResult, TrajectoryGroup, check_groups
from ..validation import check_train_arguments, describe_group, describe_trajectory, lora_values
from .memory_plan import DEFAULT_TARGETS, PlanDoesNotFitError, PlanSettings, check_at_register, vllm_max_loras
from .sampled_turns import check_sampled_turns
from .served_policies import ServedPolicies
from .step_config import StepConfig
from .tokenization import TokenizeStats, TrainingSequence, tokenize_trajectory

if TYPE_CHECKING:  # pragma: no cover
    from ..inference.base import InferenceServer
    from .sft_config import SFTConfig
    from .sft_data import SFTItem
    from .trainer import LoRATrainer

log = logging.getLogger("tracerl")

InferenceKind = Literal["auto", "vllm", "transformers"]
LOGPROB_CORR_WARN = 0.9


@dataclass
class _Registered:
    model: TrainableModel
    run_dir: RunDir
    model_path: Path
    lock: RunLock
    trainer: "LoRATrainer | None" = None
    server: "InferenceServer | None" = None
    tokenizer: Any = None
    merged_dir: Path | None = None
    """``serve_merged``: where the merged policy of the served step is written for vLLM to reload."""
    served: ServedPolicies = field(default_factory=ServedPolicies)
    gradient_checkpointing: bool | int = False
    """What the trainer recomputes: the backend's setting, or with ``"auto"`` what the memory plan chose."""


def _lora_rank(model: TrainableModel) -> int:
    """The rank of ``model``'s LoRA (``lora_config['r']``, LoRASettings' 8 when not given)."""
    return int(lora_values(model.lora_config).get("r", 8))


def _import_training_stack() -> None:
    """Import what the trainer's load imports, before it runs in a thread beside the server's start:
    transformers' lazily imported package, imported by two threads at once, can hand one of them a
    half-initialised module (``ImportError: cannot import name 'AutoModel'``)."""
    import peft  # noqa: F401  (it imports transformers' model classes)

    from . import trainer  # noqa: F401


class LocalBackend:
    """Trains LoRAs with GRPO here and serves them through vLLM (or transformers)."""

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        inference: InferenceKind | None = "auto",
        device: str | None = None,
        micro_batch_tokens: int = 2048,
        max_seq_len: int | None = 4096,
        server_options: dict[str, Any] | None = None,
        serve_merged: bool = False,
        train_workers: int = 1,
        gradient_checkpointing: bool | int | Literal["auto"] = "auto",
        pause_serving_while_training: bool = True,
        dtype: Literal["auto", "float32", "bfloat16"] = "auto",
    ) -> None:
        """``path``: data directory (overrides the model's ``base_path``); ``inference=None`` trains without serving.

        ``serve_merged=True`` (vLLM only) serves the policy as one merged model instead of a
        LoRA: vLLM runs without ``--enable-lora`` (so, on CPU, with torch.compile) and after
        each step the merged weights are written and reloaded in place.  On a CPU this decodes
        at base-model speed where a served LoRA runs at ~0.3-0.5x (``bench/serving_speed.py``);
        each step pays a merge + write + reload of the full model instead of an adapter load.

        ``train_workers=N`` (N > 1): each GRPO step is taken by N data-parallel torchrun processes
        (gloo on CPU, nccl on CUDA; ``tracerl.cluster.data_parallel``), one process's step to float tolerance.

        ``gradient_checkpointing=True`` recomputes activations in backward: about half the
        trainer's peak memory for up to ~35% more step time; an int ``n`` checkpoints every n-th
        decoder layer only, in between (:class:`~tracerl.train.trainer.LoRATrainer`; with
        ``train_workers`` on every rank).  ``"auto"`` (the default) lets the memory plan choose at ``register``: off when the
        step fits without it, on when only checkpointing makes it fit (logged).

        ``pause_serving_while_training=False`` lets the server go on generating while a step
        trains.  Keep the default where serving and training share the compute (this CPU, one
        GPU): the two would only slow each other.  Turn it off when the server has its own
        device or cores; that is what lets :class:`~tracerl.PipelineTrainer` overlap rollouts
        with training (``bench/pipeline.py --split-cores``).
        """
        if inference not in (None, "auto", "vllm", "transformers"):
            raise ConfigError(f"inference must be 'auto', 'vllm', 'transformers' or None, got {inference!r}")
        if serve_merged and inference not in ("auto", "vllm"):
            raise ConfigError(f"serve_merged=True reloads weights in a vLLM server; it needs inference='vllm' or 'auto', not {inference!r}")
        if dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(map(repr, DTYPES))}, got {dtype!r}")
        served_dtype = (server_options or {}).get("dtype") or dtype
        if serve_merged and (served_dtype if served_dtype != "auto" else ("bfloat16" if has_gpu() else "float32")) != "float32":
            raise ConfigError(
                f"serve_merged=True with {served_dtype!r} weights would lose the update: a merged bf16 weight W + δ rounds a "
                "learning-rate-sized δ back to W, so the base model would be served as the trained policy. Serve adapters "
                "(serve_merged=False, the default) or merge in fp32 (dtype='float32')"
            )
        self.dtype = dtype
        self.path = Path(path) if path is not None else None
        self.inference = inference
        self.device = device
        self.micro_batch_tokens = micro_batch_tokens
        self.max_seq_len = max_seq_len
        self.server_options = dict(server_options or {})
        self.serve_merged = serve_merged
        self.pause_serving_while_training = pause_serving_while_training
        if train_workers < 1:
            raise ConfigError(f"train_workers must be >= 1, got {train_workers}")
        if gradient_checkpointing not in ("auto", False, True) and not isinstance(gradient_checkpointing, int):
            raise ConfigError(f"gradient_checkpointing must be True, False, an int or 'auto', got {gradient_checkpointing!r}")
        self.train_workers = train_workers
        self.gradient_checkpointing = gradient_checkpointing
        self._models: dict[str, _Registered] = {}
        self._staleness: dict[str, int] = {}  # model name -> the largest max_staleness a PipelineTrainer announced

    def expect_staleness(self, model: Model, max_staleness: int) -> None:
        """A :class:`~tracerl.PipelineTrainer` announces how stale its groups may be: vLLM needs a LoRA slot for every
        policy served at once (:func:`~tracerl.train.memory_plan.vllm_max_loras`), and sizes its slots at start-up.

        Announced before ``register`` (a pipeline created first), vLLM starts with the slots.  After it, a vLLM
        started with fewer slots keeps serving every policy, but a batch that mixes more policies than it has
        slots is split, which costs throughput: that is logged, with the setting that avoids it."""
        self._staleness[model.name] = max(max_staleness, self._staleness.get(model.name, 0))
        state = self._models.get(model.name)
        server = state.server if state is not None else None
        wanted = vllm_max_loras(self._staleness[model.name])
        if isinstance(server, VLLMServer) and server.enable_lora and server.max_loras < wanted:
            log.warning(
                "%s: vLLM was started with max_loras=%d, and a PipelineTrainer with max_staleness=%d serves up to %d policies "
                "at once; batches that mix more than %d are split (throughput, not results). Create the PipelineTrainer "
                "before model.register(backend), or pass LocalBackend(server_options={'max_loras': %d}).",
                model.name, server.max_loras, max_staleness, wanted, server.max_loras, wanted,
            )  # fmt: skip

    # -- registration -------------------------------------------------------------
    async def register(self, model: Model) -> None:
        if not isinstance(model, TrainableModel):
            return  # a prompted model needs no storage or serving from us
        if self.path is not None:
            model.base_path = self.path
            model.run_dir = RunDir(self.path, model.project, model.name)
        run_dir = model.run_dir
        held = next((s.lock for s in self._models.values() if s.run_dir.root == run_dir.root), None)
        lock = held or run_dir.lock()
        lock.acquire()  # before anything touches the directory: RunLockedError if another process has it
        try:
            await self._open(model, run_dir, lock)
        except BaseException:
            if held is None:  # a first registration that failed leaves the directory to others
                failed = self._models.pop(model.name, None)
                if failed is not None and failed.server is not None:
                    await _stop_quietly(failed.server)  # and never leaves its inference server running
                lock.release()
            raise

    async def _open(self, model: TrainableModel, run_dir: RunDir, lock: RunLock) -> None:
        """Under the run lock: repair what a kill left, write checkpoint 0 if new, start serving."""
        run_dir.read_model_info()  # a run of a newer format is refused before anything touches it
        model_path = await asyncio.to_thread(resolve_base_model, model.base_model)
        if model.chat_template is not None:
            model_path = await asyncio.to_thread(with_chat_template, model_path, model.chat_template)
        run_dir.repair()
        state = _Registered(model=model, run_dir=run_dir, model_path=model_path, lock=lock)
        self._models[model.name] = state
        _write_model_json(run_dir, model, model_path)
        await asyncio.to_thread(self._check_memory_plan, state)  # a run that cannot fit stops here, before any load
        # vLLM (its own process) starts while the trainer loads on a CPU: its start is the longest wait of a
        # new run.  On a GPU it starts *before* the trainer loads: its start-up profiles the free GPU memory
        # and takes gpu_memory_utilization of it, which must not race the trainer's load.  The transformers
        # server starts after the trainer (its load in this process would race the trainer's: transformers'
        # loading is not thread-safe).
        server = self._make_server(state) if self.inference is not None else None
        launch: asyncio.Future[None] | None = None
        if isinstance(server, VLLMServer):
            if (self.device or default_device()) == "cpu":
                await asyncio.to_thread(_import_training_stack)
                launch = asyncio.create_task(self._start(state, server))
            else:
                await self._start(state, server)
                launch = asyncio.get_running_loop().create_future()
                launch.set_result(None)
        try:
            if run_dir.latest_step() is None:
                trainer = await asyncio.to_thread(self._trainer, state)
                with atomic_dir(run_dir.checkpoint_path(0)) as tmp:
                    await asyncio.to_thread(trainer.save, tmp, step=0, with_optimizer=False)
        except BaseException:
            if launch is not None:  # register stops whatever part of the server started
                launch.cancel()
                await asyncio.gather(launch, return_exceptions=True)
            raise
        step = run_dir.latest_step() or 0
        model._step_cache = step
        if server is not None:
            await (launch or self._start(state, server))
            await self._serve_step(state, step)
            model.inference_base_url = server.base_url
            model.inference_api_key = getattr(server, "api_key", None) or "tracerl"  # the server's per-process key
        model.inference_model_name = model.get_inference_name(step)

    def _make_server(self, state: _Registered) -> "InferenceServer":
        """The inference server for the base model, not started (vLLM without LoRA when it serves the merged policy)."""
        from ..inference.base import make_server

        if not self.serve_merged:
            kind = self._inference_kind()
            return make_server(kind, state.model_path, served_name=state.model.name, **self._server_options(state, lora=kind == "vllm"))
        from ..inference.vllm_server import vllm_python

        if vllm_python() is None:
            raise ConfigError("serve_merged=True needs the vLLM runtime (python -m tracerl.inference.vllm_server install)")
        options = {**self._server_options(state), "enable_lora": False}
        return make_server("vllm", state.model_path, served_name=state.model.name, **options)

    @staticmethod
    async def _start(state: _Registered, server: "InferenceServer") -> None:
        state.server = server  # before start(): a start that fails half-way is stopped by register
        await server.start()

    async def _serve_step(self, state: _Registered, step: int) -> None:
        """Have the started server serve checkpoint ``step``: its LoRA, or (``serve_merged``) the merged policy."""
        server = state.server
        assert server is not None
        name = state.model.get_inference_name(step)
        if not self.serve_merged:
            await server.load_adapter(name, str(state.run_dir.checkpoint_path(step)))
        else:
            state.merged_dir = Path(tempfile.mkdtemp(prefix="tracerl-merged-"))
            if step > 0:  # checkpoint 0 is a fresh LoRA (B = 0): the base weights already are that policy
                await self._reload_merged(state, step, await asyncio.to_thread(self._trainer, state), name)
            server.aliases.add(name)  # type: ignore[attr-defined]
            server.gate.policy = name  # type: ignore[attr-defined]
        state.served.serve(step)

    def _server_options(self, state: _Registered, *, lora: bool = False) -> dict[str, Any]:
        """``server_options`` plus the model's reply parsers (its own settings win); with ``lora`` (a vLLM serving
        adapters) vLLM's LoRA limits derived from the model (:meth:`_vllm_lora_options`) unless ``server_options`` set them."""
        model = state.model
        dtype = {} if self.dtype == "auto" else {"dtype": self.dtype}
        derived = self._vllm_lora_options(state) if lora else {}
        return {**dtype, **derived, **self.server_options, "tool_call_parser": model.tool_call_parser, "reasoning_parser": model.reasoning_parser}

    def _inference_kind(self) -> str:
        """``"vllm"`` or ``"transformers"`` (``"auto"``: vLLM when its runtime is installed)."""
        if self.inference == "auto":
            return "vllm" if self.serve_merged or vllm_python() is not None else "transformers"
        return self.inference or "vllm"

    def _vllm_lora_options(self, state: _Registered) -> dict[str, Any]:
        """vLLM's ``max_lora_rank``: the model's LoRA rank rounded up to one vLLM accepts (a rank it cannot serve
        is a :class:`ConfigError` here, not a refused hot-load after the first step); ``max_loras``: the
        policies served at once (:func:`~tracerl.train.memory_plan.vllm_max_loras`, for the staleness a
        :class:`~tracerl.PipelineTrainer` announced through :meth:`expect_staleness`)."""
        rank = _lora_rank(state.model)
        return {"max_lora_rank": vllm_lora_rank(rank), "max_loras": self._max_loras(state)}

    def _max_loras(self, state: _Registered) -> int:
        """vLLM's LoRA slots: ``server_options``' own, else the policies this model's pipeline serves at once."""
        return self.server_options.get("max_loras") or vllm_max_loras(self._staleness.get(state.model.name, 1))

    def _plan_settings(self, state: _Registered) -> PlanSettings:
        """The memory plan's settings of this backend and ``state``'s model (:mod:`tracerl.train.memory_plan`)."""
        values = lora_values(state.model.lora_config)
        device = self.device or default_device()
        options = self.server_options
        inference = None if self.inference is None else self._inference_kind()
        micro = self.micro_batch_tokens
        return PlanSettings(
            device="cuda" if str(device).startswith("cuda") else "cpu", lora_rank=_lora_rank(state.model),
            target_modules=tuple(values.get("target_modules") or DEFAULT_TARGETS), seq_len=self.max_seq_len or micro,
            micro_batch_tokens=micro, dtype=self.dtype, gradient_checkpointing=state.gradient_checkpointing is True or state.gradient_checkpointing == 1,
            inference=inference, gpu_memory_utilization=options.get("gpu_memory_utilization") or 0.9,
            tensor_parallel_size=options.get("tensor_parallel_size"), max_loras=self._max_loras(state),
            max_model_len=options.get("max_model_len") or 4096, kv_cache_memory_bytes=options.get("kv_cache_memory_bytes"),
            sleep=options.get("sleep_while_training"),
        )  # fmt: skip

    def _check_memory_plan(self, state: _Registered) -> None:
        """Before anything loads: the run's memory plan must fit its device (``PlanDoesNotFitError`` with the plan's table).

        A model folder without a ``config.json``, or one the plan cannot read (a configuration it does not know), is
        left to the loader's own checks, with a warning."""
        state.gradient_checkpointing = False if self.gradient_checkpointing == "auto" else self.gradient_checkpointing
        if not (state.model_path / "config.json").is_file():
            return
        settings = self._plan_settings(state)
        try:
            try:
                result = check_at_register(state.model_path, settings)
            except PlanDoesNotFitError as error:
                if self.gradient_checkpointing != "auto":
                    raise
                result = check_at_register(state.model_path, replace(settings, gradient_checkpointing=True))
                state.gradient_checkpointing = True
                log.info("memory plan of %s: gradient checkpointing turned on (without it the step needs %.2f GiB of %.2f GiB)",
                         state.model.name, error.need_bytes / 2**30, error.total_bytes / 2**30)  # fmt: skip
        except PlanDoesNotFitError:
            raise
        except Exception as error:  # noqa: BLE001 - the plan is a check before the load, never a new way to fail it
            log.warning("no memory plan for %s (%s: %s); loading without it", state.model.name, type(error).__name__, error)
            return
        log.info("memory plan of %s: trainer peak %.2f GiB, with inference %.2f GiB of %.2f GiB",
                 state.model.name, result.trainer_peak / 2**30, result.peak / 2**30, result.capacity / 2**30)  # fmt: skip

    async def _reload_merged(self, state: _Registered, step: int, trainer: "LoRATrainer", policy: str) -> None:
        """Write the trainer's policy as a full model and have vLLM reload it in place; keep only that copy."""
        from .merged_weights import write_merged_model

        assert state.merged_dir is not None and state.server is not None
        target = state.merged_dir / f"step-{step:04d}"
        await asyncio.to_thread(write_merged_model, trainer.model, state.model_path, target)
        await state.server.reload_weights(target, policy)  # type: ignore[attr-defined]
        for old in state.merged_dir.iterdir():
            if old != target:
                shutil.rmtree(old, ignore_errors=True)

    def _state(self, model: Model) -> _Registered:
        state = self._models.get(model.name)
        if state is None or state.model is not model and state.run_dir.root != model.run_dir.root:
            raise CheckpointError(f"model {model.name!r} is not registered with this backend: await model.register(backend)")
        return state

    def _writable(self, model: Model) -> _Registered:
        """The state of a model about to be written: after close(), the lock is taken back (or ``RunLockedError``)."""
        state = self._state(model)
        state.lock.acquire()
        return state

    def _paused_for_step(self, state: _Registered) -> contextlib.AbstractAsyncContextManager[None]:
        """Generation held for the step, unless ``pause_serving_while_training=False``."""
        return _serving_paused(state.server if self.pause_serving_while_training else None)

    def _trainer(self, state: _Registered) -> "LoRATrainer":
        """Load the trainer lazily (resuming from the newest checkpoint's adapter and optimizer)."""
        if state.trainer is None:
            from .trainer import LoRASettings, LoRATrainer

            latest = state.run_dir.latest_step()
            adapter = state.run_dir.checkpoint_path(latest) if latest is not None else None
            options: dict[str, Any] = dict(lora=LoRASettings.from_dict(state.model.lora_config), adapter_path=adapter,
                                           device=self.device, dtype=None if self.dtype == "auto" else self.dtype)
            if self.train_workers > 1:
                from ..cluster.data_parallel import PersistentLoRATrainer

                state.trainer = PersistentLoRATrainer(state.model_path, workers=self.train_workers,
                                                      gradient_checkpointing=state.gradient_checkpointing, **options)  # fmt: skip
            else:
                state.trainer = LoRATrainer(state.model_path, gradient_checkpointing=state.gradient_checkpointing, **options)
        return state.trainer

    def tokenizer(self, model: Model) -> Any:
        state = self._state(model)
        if state.tokenizer is None:
            from transformers import AutoTokenizer

            state.tokenizer = AutoTokenizer.from_pretrained(state.model_path)
        return state.tokenizer

    async def get_step(self, model: Model) -> int:
        return self._state(model).run_dir.latest_step() or 0

    async def list_checkpoints(self, model: Model) -> list[int]:
        return self._state(model).run_dir.checkpoint_steps()

    async def delete_checkpoints(self, model: Model, keep: list[int]) -> list[int]:
        run_dir = self._writable(model).run_dir
        latest = run_dir.latest_step()
        deleted = []
        for step in run_dir.checkpoint_steps():
            if step not in keep and step != latest:
                run_dir.delete_checkpoint(step)
                deleted.append(step)
        return deleted

    async def close(self) -> None:
        """Stop the servers, drop the trainers and release the run locks (another backend may then take the models)."""
        for state in self._models.values():
            try:
                if state.server is not None:
                    await state.server.stop()
                    state.server = None
                if state.merged_dir is not None:
                    shutil.rmtree(state.merged_dir, ignore_errors=True)
                    state.merged_dir = None
                getattr(state.trainer, "close", lambda: None)()  # data-parallel ranks: stopped now, not when collected
                state.trainer = None
            finally:
                state.lock.release()

    async def __aenter__(self) -> "LocalBackend":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- training -----------------------------------------------------------------
    async def train(
        self,
        model: TrainableModel,
        trajectory_groups: Iterable[TrajectoryGroup],
        *,
        learning_rate: float = StepConfig.learning_rate,
        loss_fn: Literal["cispo", "ppo"] = StepConfig.loss_fn,
        epsilon: float | None = StepConfig.epsilon,
        epsilon_high: float | None = StepConfig.epsilon_high,
        importance_sampling_level: Literal["token", "sequence"] = StepConfig.importance_level,
        kl_penalty_coef: float = StepConfig.kl_penalty_coef,
        max_grad_norm: float = StepConfig.max_grad_norm,
        off_policy_cap: float | None = StepConfig.off_policy_cap,
        max_mismatch_kl: float | None = StepConfig.max_mismatch_kl,
        mismatch_correction: Literal["none", "tis", "mis"] = StepConfig.mismatch_correction,
        mismatch_cap: float = StepConfig.mismatch_cap,
        scale_rewards: bool = True,
        allow_retokenize: bool = False,
        on_non_finite: Literal["raise", "skip"] = "raise",
    ) -> TrainResult:
        """One GRPO step on ``trajectory_groups``; returns the new step, metrics and checkpoint path.

        The keywords are every backend's (``TinkerBackend``, ``RemoteBackend``, ``PipelineTrainer``
        take the same, with the same defaults and checks): the step's loss and optimizer settings
        are :class:`~tracerl.train.step_config.StepConfig`'s (``importance_sampling_level`` is its
        ``importance_level``), ``scale_rewards``, ``allow_retokenize`` and ``on_non_finite`` this
        call's; docs/training.md, "What backend.train does", has the table.  A sampled turn without
        sampler logprobs (``Choice.logprobs=None``) trains with ratio 1 (its logprobs are unknown:
        NaN in :func:`~tracerl.train.grpo.policy_loss`).

        A sampled turn whose :attr:`~tracerl.Choice.model` names an older step of ``model`` than
        the one trained from (a pipelined loop, a straggler) is corrected off-policy: decoupled
        PPO with a truncated importance weight capped at ``off_policy_cap``
        (:func:`tracerl.train.grpo.policy_loss`; None: no correction).  The metrics count such
        turns (``stale_turns``, ``policy_lag_max``) and report the weights
        (``off_policy_ratio_mean``/``_max``, ``off_policy_truncated_fraction``).

        The metrics carry the step's wall-time split: ``train_seconds`` (tokenization, forwards,
        backwards, update), ``save_seconds`` (checkpoint and trajectories written),
        ``hot_load_seconds`` (the adapter loaded, or the merged weights written and reloaded) and
        ``step_seconds`` (this whole call); ``rollout_seconds`` too when ``trajectory_groups`` is
        what :func:`~tracerl.gather_trajectory_groups` returned (its wall time).  The checkpoint's
        ``step.json`` row is written before the save and hot-load finish, so it holds only the
        first two.

        Arguments and every number of every trajectory are checked before any model is loaded
        (``ConfigError`` / ``TrajectoryError``; a call where no trajectory has a sampled turn is a
        ``TrajectoryError`` that names them and the likely cause).  Zero-variance groups are skipped (unless a sampled turn carries
        ``token_advantages``: on-policy distillation, added to the reward advantage); if none is
        trainable the step still advances and the previous adapter is copied.  A non-finite
        loss, gradient or update raises :class:`NonFiniteError` with nothing changed, or with
        ``on_non_finite="skip"`` is logged and advances like a step without trainable groups
        (README, "What backend.train does").  An unsupported keyword is a ``TypeError``.
        """
        check_train_arguments(scale_rewards=scale_rewards, allow_retokenize=allow_retokenize, on_non_finite=on_non_finite)
        config = StepConfig.from_train_kwargs(
            learning_rate=learning_rate, loss_fn=loss_fn, epsilon=epsilon, epsilon_high=epsilon_high,
            importance_sampling_level=importance_sampling_level, kl_penalty_coef=kl_penalty_coef, max_grad_norm=max_grad_norm,
            off_policy_cap=off_policy_cap, max_mismatch_kl=max_mismatch_kl, mismatch_correction=mismatch_correction,
            mismatch_cap=mismatch_cap,
        )  # fmt: skip
        rollout_seconds = _gather_seconds(trajectory_groups)
        groups = list(trajectory_groups)
        without_sampled_turns = check_sampled_turns(groups)  # none at all: raises, naming them and why
        state = self._writable(model)
        check_groups(groups, vocab_size=_embedding_rows(state.model_path))
        started = time.monotonic()
        step = (state.run_dir.latest_step() or 0) + 1
        lags = PolicyLags(model, trained_from=step - 1)
        sequences, metrics = self._prepare(state, groups, scale_rewards, allow_retokenize, lags)
        metrics.update(lags.metrics())
        metrics["trajectories_without_sampled_turns"] = float(without_sampled_turns)
        if rollout_seconds is not None:
            metrics["rollout_seconds"] = rollout_seconds
        final = state.run_dir.checkpoint_path(step)
        trainer = None
        if sequences and await self._step_or_skip(state, sequences, config, metrics, on_non_finite):
            trainer = self._trainer(state)
        elif not state.run_dir.checkpoint_path(step - 1).exists():
            raise CheckpointError(f"checkpoint {state.run_dir.checkpoint_path(step - 1)} is missing; cannot advance to step {step}")
        metrics["train_seconds"] = metrics["step_seconds"] = time.monotonic() - started
        saving = time.monotonic()
        await asyncio.to_thread(_commit_step, state.run_dir, step, trainer, groups, metrics)
        metrics["save_seconds"] = time.monotonic() - saving
        corr = metrics.get("sampler_trainer_prob_corr")
        if corr is not None and corr < LOGPROB_CORR_WARN:
            log.warning(
                "sampler and trainer token probabilities disagree (correlation %.3f < %.2f): "
                "the served model may not match the trained one (dtype, template, adapter not loaded?)",
                corr,
                LOGPROB_CORR_WARN,
            )
        hot_load = await self._publish(state, model, step, trainer)
        model._step_cache = step  # named by get_inference_name() only once it is served
        if hot_load is not None:
            metrics["hot_load_seconds"] = hot_load
        metrics["step_seconds"] = time.monotonic() - started
        return TrainResult(step=step, metrics=metrics, checkpoint_path=str(final))

    async def _publish(self, state: _Registered, model: TrainableModel, step: int, trainer: "LoRATrainer | None") -> float | None:
        """Serve committed checkpoint ``step`` as ``name@step`` (the adapter loaded, or the merged weights
        written and reloaded), keeping ``step - 1`` for stragglers and what a lease holds; ``trainer`` None:
        a skipped step.
        Returns the seconds it took, None when nothing is served."""
        loading = time.monotonic()
        if state.server is not None:
            if self.serve_merged:
                if trainer is not None:
                    await self._reload_merged(state, step, trainer, model.get_inference_name(step))
                else:  # a skipped step copies the adapter: the served weights already are this policy
                    state.server.gate.policy = model.get_inference_name(step)  # type: ignore[attr-defined]
                state.server.aliases.add(model.get_inference_name(step))  # type: ignore[attr-defined]
            else:
                await state.server.load_adapter(model.get_inference_name(step), str(state.run_dir.checkpoint_path(step)))
            state.served.serve(step)
            await self._retire_old_policies(state)
        model.inference_model_name = model.get_inference_name(step)
        return time.monotonic() - loading if state.server is not None else None

    async def _retire_old_policies(self, state: _Registered) -> None:
        """Stop serving the policies no straggler or lease needs (merged serving: a dropped alias; a
        request for it then gets a 404, as for an unloaded adapter)."""
        assert state.server is not None
        while (old := state.served.next_to_retire()) is not None:
            state.served.retire(old)
            name = state.model.get_inference_name(old)
            if self.serve_merged:
                state.server.aliases.discard(name)  # type: ignore[attr-defined]
            else:
                await _unload_quietly(state.server, name)

    @contextlib.asynccontextmanager
    async def policy_lease(self, model: Model, step: int) -> AsyncIterator[None]:
        """Keep serving ``name@step`` while the block runs, however many steps train meanwhile.

        For rollouts that pinned their policy's name when they started (a LangGraph agent builds
        its chat model once): without the lease their turns after two more steps would get a 404
        for a retired adapter.  ``PipelineTrainer`` holds one for each group it runs; the policy
        is retired when the last lease on it ends, if it is by then two steps old.
        """
        state = self._state(model)
        state.served.hold(step)
        try:
            yield
        finally:
            state.served.release(step)
            if state.server is not None:
                await self._retire_old_policies(state)

    async def train_sft(
        self,
        model: TrainableModel,
        trajectories: "Iterable[SFTItem] | str | Path",
        config: "SFTConfig | dict[str, Any] | None" = None,
        *,
        val_trajectories: "Iterable[SFTItem] | str | Path | None" = None,
    ) -> TrainResult:
        """Supervised fine-tuning of the same LoRA: one new checkpoint step, hot-loaded as ``name@step``.

        ``trajectories``: captured or imported ``Trajectory``s (or groups: every assistant turn
        trained), OpenAI chat fine-tuning examples (dicts with ``messages``, ``tools``, per-message
        ``weight``), or the path of a JSONL file of either.  ``val_trajectories`` overrides
        ``config.val_fraction`` as the held-out set.  ``config`` is an :class:`~tracerl.SFTConfig`
        (or its dict), checked before any model is loaded.  The history row is written with split
        ``sft`` (README, "SFT: warm-start the adapter, then RL").
        """
        from .sft import batches, commit, prepare, run_sft
        from .sft_config import SFTConfig
        from .sft_data import as_sft_examples

        config = SFTConfig.coerce(config)
        examples = as_sft_examples(trajectories)
        val = as_sft_examples(val_trajectories) if val_trajectories is not None else None
        state = self._writable(model)
        check_groups([TrajectoryGroup(examples + (val or []))], vocab_size=_embedding_rows(state.model_path))
        started = time.monotonic()
        tokenizer = self.tokenizer(model)
        run = await asyncio.to_thread(prepare, tokenizer, examples, val, config, self.max_seq_len)
        config.schedule(len(batches(list(range(len(run.train))), config.resolved_batch_size, config.epochs, False, 0)))  # a wrong list: before loading
        step = (state.run_dir.latest_step() or 0) + 1
        pad = tokenizer.pad_token_id or 0
        try:
            async with self._paused_for_step(state):  # vLLM asleep first, as for a GRPO step
                trainer = await asyncio.to_thread(self._trainer, state)
                metrics = await asyncio.to_thread(run_sft, trainer, run, config, max_tokens=self.micro_batch_tokens, pad_token_id=pad)
            metrics["step_seconds"] = time.monotonic() - started
            await asyncio.to_thread(commit, state.run_dir, step, trainer, metrics)
        except BaseException:
            state.trainer = None  # earlier optimizer steps of this call were applied: reload the last checkpoint
            raise
        final = state.run_dir.checkpoint_path(step)
        await self._publish(state, model, step, trainer)
        model._step_cache = step  # named by get_inference_name() only once it is served
        return TrainResult(step=step, metrics=metrics, checkpoint_path=str(final))

    async def _step_or_skip(
        self, state: _Registered, sequences: list[TrainingSequence], config: Any, metrics: dict[str, float], on_non_finite: str
    ) -> bool:
        """Run the optimizer step; False when it was skipped for a non-finite number (``on_non_finite="skip"``).

        On :class:`NonFiniteError` nothing of this call remains: the trainer never applied the
        update, or (``adapter_changed``) is dropped so the next call reloads the last checkpoint;
        any other error drops it too (it may have stopped half-way through an update).  Serving
        resumes either way.
        """
        try:
            async with self._paused_for_step(state):  # vLLM asleep first: a trainer (re)loaded after a resume gets its memory
                trainer = await asyncio.to_thread(self._trainer, state)
                metrics.update(await asyncio.to_thread(self._run_step, trainer, sequences, config, state))
            return True
        except MismatchError:
            raise  # raised before the update: the trainer holds the last checkpoint still
        except NonFiniteError as error:
            if error.adapter_changed:
                state.trainer = None
            what = f"{error}{_name_sequences(sequences, error.sequences)}"
            if on_non_finite == "raise":
                raise NonFiniteError(
                    f"{what}; the step did not advance, the adapter and optimizer state are unchanged "
                    "(on_non_finite='skip' skips such updates instead)",
                    sequences=error.sequences,
                ) from error
            log.warning("on_non_finite='skip': %s; the update is skipped and the previous adapter copied to the new step", what)
            metrics["skipped_non_finite"] = 1.0
            return False
        except BaseException:
            state.trainer = None  # it may have failed half-way through an update: reload the last checkpoint
            raise

    def _prepare(
        self,
        state: _Registered,
        groups: list[TrajectoryGroup],
        scale_rewards: bool,
        allow_retokenize: bool,
        lags: "PolicyLags | None" = None,
    ) -> tuple[list[TrainingSequence], dict[str, float]]:
        """Advantages per group, then tokenization of the trainable groups' trajectories."""
        return training_sequences(
            groups, lambda: self.tokenizer(state.model), scale_rewards=scale_rewards, allow_retokenize=allow_retokenize,
            max_seq_len=self.max_seq_len, lags=lags,
        )  # fmt: skip

    def _run_step(
        self, trainer: "LoRATrainer", sequences: list[TrainingSequence], config: Any, state: _Registered
    ) -> dict[str, float]:
        from .packing import pack_sequences

        pad = self.tokenizer(state.model).pad_token_id or 0
        batches = pack_sequences(sequences, trajectory_weights(sequences), max_tokens=self.micro_batch_tokens, pad_token_id=pad)
        return trainer.step(batches, config)


class PolicyLags:
    """How many steps older than the trained checkpoint the policy that sampled a turn is.

    Read from the name the server answered with (``name@step``, :attr:`tracerl.Choice.model`);
    0 for a turn with no such name (another server, a hand-built ``Choice``), which trains as before."""

    def __init__(self, model: TrainableModel, *, trained_from: int) -> None:
        self.model, self.trained_from = model, trained_from
        self.seen: list[int] = []

    def __call__(self, choice: Choice) -> int:
        sampled = self.model.policy_step(choice.model)
        lag = self.trained_from - sampled if sampled is not None and sampled < self.trained_from else 0
        self.seen.append(lag)
        return lag

    def metrics(self) -> dict[str, float]:
        return {"stale_turns": float(sum(1 for lag in self.seen if lag)), "policy_lag_max": float(max(self.seen, default=0))}


def training_sequences(
    groups: list[TrajectoryGroup],
    tokenizer: Callable[[], Any],
    *,
    scale_rewards: bool,
    allow_retokenize: bool,
    max_seq_len: int | None,
    lags: PolicyLags | None = None,
) -> tuple[list[TrainingSequence], dict[str, float]]:
    """What a GRPO step trains, whichever backend takes it: advantages per group, then the trainable
    groups' trajectories tokenized (``tokenizer()`` is called only when one is needed), each
    sequence carrying its trajectory's advantage; and the step's counting metrics."""
    from .grpo import group_advantages

    stats = TokenizeStats()
    sequences: list[TrainingSequence] = []
    trainable_groups = 0
    trajectory_index = 0
    distilled_groups = 0
    for g, group in enumerate(groups):
        advantages, trainable = group_advantages(group.rewards, scale_rewards=scale_rewards)
        distilled = _has_token_advantages(group)  # per-token advantages train even when the rewards are equal
        distilled_groups += distilled
        if not trainable and not distilled:
            trajectory_index += len(group.trajectories)
            continue
        if not all(math.isfinite(a) for a in advantages):
            raise TrajectoryError(f"{describe_group(g, group)}: rewards {group.rewards} are too large: their advantages overflow")
        trainable_groups += 1
        tokens = tokenizer()
        for i, (trajectory, advantage) in enumerate(zip(group.trajectories, advantages)):
            for seq in tokenize_trajectory(
                trajectory,
                tokens,
                trajectory_index=trajectory_index,
                group_index=g,
                allow_retokenize=allow_retokenize,
                stats=stats,
                max_seq_len=max_seq_len,
                label=describe_trajectory(g, group, i, trajectory),
                policy_lag=lags,
            ):
                seq.advantage = advantage
                sequences.append(seq)
            trajectory_index += 1
    metrics = {
        "num_groups": float(len(groups)),
        "num_groups_trainable": float(trainable_groups),
        "num_groups_with_token_advantages": float(distilled_groups),
        "num_trajectories": float(sum(len(g.trajectories) for g in groups)),
        "num_sequences": float(len(sequences)),
        "skipped_non_finite": 0.0,
        **stats.metrics(),
    }
    return sequences, metrics


def trajectory_weights(sequences: list[TrainingSequence]) -> list[float]:
    """Each sequence's token weight so that every trajectory weighs the same in the step, whatever
    its length (:func:`tracerl.train.grpo.equal_trajectory_weights` over the trajectories' trained tokens)."""
    from .grpo import equal_trajectory_weights

    per_trajectory: dict[int, int] = {}
    for seq in sequences:
        per_trajectory[seq.trajectory_index] = per_trajectory.get(seq.trajectory_index, 0) + seq.num_trainable
    keys = sorted(per_trajectory)
    weight_of = dict(zip(keys, equal_trajectory_weights([per_trajectory[k] for k in keys])))
    return [weight_of[seq.trajectory_index] for seq in sequences]


def _has_token_advantages(group: TrajectoryGroup) -> bool:
    """Whether a sampled turn of ``group`` carries per-token advantages (on-policy distillation)."""
    return any(choice.token_advantages is not None for t in group.trajectories for choice in t.sampled_turns())


def _gather_seconds(trajectory_groups: object) -> float | None:
    """The wall time ``gather_trajectory_groups`` recorded on its result (``None`` for any other iterable)."""
    if not isinstance(trajectory_groups, GatheredGroups):
        return None
    seconds = trajectory_groups.metrics.get("seconds")
    return float(seconds) if isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0 else None


def _name_sequences(sequences: list[TrainingSequence], indices: tuple[int, ...]) -> str:
    """``" (in group 0 (task ...), trajectory 1 (id ...), advantage inf; ...)"``: whose tokens went non-finite."""
    if not indices:
        return ""
    seen: dict[str, float] = {}
    for i in indices:
        if 0 <= i < len(sequences):
            seen.setdefault(sequences[i].label or f"sequence {i}", sequences[i].advantage)
    named = "; ".join(f"{label}, advantage {advantage:.6g}" for label, advantage in list(seen.items())[:5])
    more = f" and {len(seen) - 5} more" if len(seen) > 5 else ""
    return f" (non-finite token losses in: {named}{more})"


@functools.lru_cache(maxsize=32)
def _embedding_rows(model_path: Path) -> int | None:
    """The base model's vocabulary size (embedding rows) from its ``config.json``; None when unknown."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size) if isinstance(size, int) and size > 0 else None


def _commit_step(
    run_dir: RunDir, step: int, trainer: "LoRATrainer | None", groups: list[TrajectoryGroup], metrics: dict[str, float]
) -> None:
    """Write checkpoint ``step`` and everything ``model.log(split="train")`` would record, committed by one rename.

    The trajectories go to their final place first; the checkpoint (adapter, optimizer and
    ``step.json``, the step's train row) is renamed into place last.  A kill before that
    rename leaves an uncommitted step that ``register`` cleans away; a kill after it, a
    committed step whose missing row ``register`` writes from ``step.json``.
    """
    run_dir.write_trajectories(TRAIN_SPLIT, step, trajectories_jsonl(groups))
    with atomic_dir(run_dir.checkpoint_path(step)) as tmp:
        if trainer is not None:
            trainer.save(tmp, step=step)
        else:  # nothing trainable: the step still advances, with the previous adapter
            shutil.copytree(run_dir.checkpoint_path(step - 1), tmp, dirs_exist_ok=True)
        run_dir.write_step_record(tmp, step, {**aggregate_metrics(groups), **metrics})


async def _stop_quietly(server: "InferenceServer") -> None:
    """Stop a server whose registration failed; a second failure is logged, the first one is raised."""
    try:
        await server.stop()
    except Exception as error:  # noqa: BLE001 - the registration's own error matters more
        log.warning("tracerl: could not stop the inference server of a failed registration: %s: %s", type(error).__name__, error)


async def _unload_quietly(server: Any, name: str) -> None:
    """Free an old adapter so a long run does not accumulate one per step."""
    unload = getattr(server, "unload_adapter", None)
    if unload is None:
        return
    try:
        await unload(name)
    except Exception:  # noqa: BLE001 - it may never have been loaded (resume, step 0)
        pass


@contextlib.asynccontextmanager
async def _serving_paused(server: Any) -> AsyncIterator[None]:
    """Hold generation while training when the server can pause (both servers can; ``None``: no pause)."""
    pause, resume = getattr(server, "pause", None), getattr(server, "resume", None)
    if pause is None or resume is None:
        yield
        return
    await pause()
    try:
        yield
    finally:
        await asyncio.to_thread(release_cached_gpu_memory)  # before the wake: vLLM re-allocates from the driver
        await resume()


def _write_model_json(run_dir: RunDir, model: TrainableModel, model_path: Path) -> None:
    data = {
        "name": model.name,
        "project": model.project,
        "base_model": model.base_model,
        "resolved_base_model": str(model_path),
        "lora_config": model.lora_config,
        **model.serving_settings,
    }
    previous = run_dir.read_model_info()
    if previous is not None and previous.get("base_model") != model.base_model:
        raise ConfigError(
            f"{run_dir.root} was trained from base_model {previous.get('base_model')!r}, not {model.base_model!r}: "
            "use another model name or delete that directory"
        )
    run_dir.write_model_info(data)
