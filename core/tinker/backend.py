"""``tracerl.TinkerBackend``: tracerl's ``Backend`` over any Tinker-API service, through the official SDK.

``backend.train(model, groups)`` tokenizes the groups as :class:`~tracerl.LocalBackend` does
(the sampled turns' own token ids and logprobs; :mod:`tracerl.train.tokenization`), turns each
row into a Tinker ``Datum`` (sampled-token advantages, the sampler's logprobs), and runs
``forward_backward`` + ``optim_step``, then saves the new weights for sampling as
``name@step``, which the service serves at once on its OpenAI-compatible endpoint
(``tracerl serve --tinker``: ``/v1``).  So ``model.openai_client()`` and capture work as with
any backend.

The loss is tracerl's GRPO loss, sent as Tinker's summed loss of the same name: each token's
advantage is scaled by its trajectory's weight over the step's trained tokens
(:func:`tracerl.train.grpo.equal_trajectory_weights`), which makes Tinker's sum equal to
LocalBackend's mean (PPO and CISPO scale linearly in the advantage).  Adam's betas and eps are
LocalBackend's.  The run's Tinker state paths are kept in the run directory (``tinker.json``),
so a new process resumes from the newest saved state.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterable
from typing import Any

from ..errors import ConfigError
from ..model import Model, TrainableModel
from ..redact import register_secret
from ..runs.durable import atomic_write_text
from ..runs.storage import history_row
from ..types import TrainResult, TrajectoryGroup

log = logging.getLogger("tracerl.tinker")

DEFAULT_CLIP = {"cispo": (0.0, 5.0), "ppo": (0.8, 1.2)}
"""Ratio bounds per loss: tracerl's GRPO defaults (CISPO ε 1.0 / 4.0, PPO ε 0.2) as Tinker's absolute bounds."""


class TinkerBackend:
    """Train through a Tinker-API service (``tracerl serve --tinker``, or a hosted one)."""

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *, openai_base_url: str | None = None) -> None:
        """``base_url``/``api_key``: the service and your ``tml-`` key (default ``$TINKER_BASE_URL`` /
        ``$TINKER_API_KEY``, as the SDK reads them).  ``openai_base_url``: where the saved sampler
        weights answer OpenAI requests (default ``<base_url>/v1``, ``tracerl serve``'s)."""
        self.base_url = (base_url or os.environ.get("TINKER_BASE_URL") or "").rstrip("/") or None
        self.api_key = api_key or os.environ.get("TINKER_API_KEY")
        if self.api_key is None:
            raise ConfigError("TinkerBackend needs an API key: api_key=... or $TINKER_API_KEY (tml-...)")
        register_secret(self.api_key)
        if openai_base_url is None and self.base_url is None:
            raise ConfigError("TinkerBackend needs openai_base_url=... for a hosted service (tracerl serve: base_url is enough)")
        self.openai_base_url = openai_base_url or f"{self.base_url}/v1"
        self.service: Any = None
        self.clients: dict[tuple[str, str], Any] = {}  # (project, name) -> the SDK's TrainingClient
        self.tokenizers: dict[tuple[str, str], Any] = {}

    # -- Backend ----------------------------------------------------------------------------
    async def register(self, model: Model) -> None:
        if not isinstance(model, TrainableModel):
            return
        import tinker

        if self.service is None:
            self.service = tinker.ServiceClient(base_url=self.base_url, api_key=self.api_key)
        state = self._state(model)
        if state["states"]:
            newest = state["states"][str(state["step"])]
            training = await self.service.create_training_client_from_state_with_optimizer(newest)
        else:
            rank = int(model.lora_config.get("r", 8))
            training = await self.service.create_lora_training_client(base_model=model.base_model, rank=rank, train_unembed=False)
            await training.save_weights_for_sampler(name=model.get_inference_name(0))
        self.clients[model.project, model.name] = training
        self.tokenizers[model.project, model.name] = training.get_tokenizer()
        model.inference_base_url = self.openai_base_url
        model.inference_api_key = self.api_key
        model._step_cache = state["step"]

    async def train(
        self, model: Model, trajectory_groups: Iterable[TrajectoryGroup], *, learning_rate: float = 5e-6, loss_fn: str = "cispo",
        epsilon: float | None = None, epsilon_high: float | None = None, max_grad_norm: float = 1.0, scale_rewards: bool = True,
        allow_retokenize: bool = False,
    ) -> TrainResult:  # fmt: skip
        """One step: GRPO on the groups (LocalBackend's keywords for the loss and optimizer)."""
        from tinker import types

        trainable = self._registered(model)
        if loss_fn not in DEFAULT_CLIP:
            raise ConfigError(f"loss_fn must be one of {sorted(DEFAULT_CLIP)}, got {loss_fn!r}")
        low, high = DEFAULT_CLIP[loss_fn]
        if epsilon is not None:
            low = 1.0 - epsilon
        if epsilon_high is not None or (epsilon is not None and loss_fn == "ppo"):
            high = 1.0 + (epsilon_high if epsilon_high is not None else epsilon)  # type: ignore[operator]
        groups = list(trajectory_groups)
        datums, metrics = self._datums(trainable, groups, scale_rewards, allow_retokenize)
        training = self.clients[trainable.project, trainable.name]
        started = time.monotonic()
        if datums:
            config = {"clip_low_threshold": max(low, 0.0), "clip_high_threshold": high}
            backward = await training.forward_backward(datums, loss_fn, loss_fn_config=config)
            adam = types.AdamParams(learning_rate=learning_rate, beta1=0.9, beta2=0.99, eps=1e-8, grad_clip_norm=max_grad_norm)
            optimizer = await training.optim_step(adam)
            metrics["loss"] = backward.metrics["loss:sum"]
            metrics.update({key.split(":")[0]: value for key, value in (optimizer.metrics or {}).items()})
        metrics["train_seconds"] = time.monotonic() - started
        return await self._commit(trainable, self._state(trainable)["step"] + 1, metrics)

    async def train_sft(
        self, model: Model, trajectories: Any, config: Any = None, *, val_trajectories: Any = None
    ) -> TrainResult:  # fmt: skip
        """Supervised fine-tuning as :meth:`LocalBackend.train_sft <tracerl.LocalBackend.train_sft>` does it: one new step.

        The examples are tokenized by LocalBackend's SFT path (:mod:`tracerl.train.sft`); each
        optimizer step is one ``forward_backward`` with Tinker's ``cross_entropy`` (a sum, so each
        token weighs ``SFTConfig.normalization``'s share of the batch) and one ``optim_step`` at
        the schedule's learning rate.  The held-out loss is a ``forward``.  The ``sft`` row is
        appended to the run's history, as LocalBackend appends it.
        """
        from tinker import types

        from ..train.sft import SFT_SPLIT, batches, prepare, sequence_weights
        from ..train.sft_config import SFTConfig
        from ..train.sft_data import as_sft_examples

        trainable = self._registered(model)
        config = SFTConfig.coerce(config)
        examples = as_sft_examples(trajectories)
        val = as_sft_examples(val_trajectories) if val_trajectories is not None else None
        run = prepare(self.tokenizers[trainable.project, trainable.name], examples, val, config, None)
        steps = batches(list(range(len(run.train))), config.resolved_batch_size, config.epochs, config.shuffle, config.seed)
        rates = config.schedule(len(steps))
        training = self.clients[trainable.project, trainable.name]

        def datums(sequences: list[Any]) -> list[Any]:
            weights = sequence_weights(sequences, config.normalization)
            return [_datum(seq, {"weights": [weight * w for w in seq.weights[1:]]}) for seq, weight in zip(sequences, weights)]

        async def val_loss() -> float:
            result = await training.forward(datums([s for example in run.val for s in example]), "cross_entropy")
            return float(result.metrics["loss:sum"])

        started = time.monotonic()
        metrics: dict[str, float] = {}
        if run.val:
            metrics["val_loss_before"] = await val_loss()
        losses: list[float] = []
        for (epoch, members), rate in zip(steps, rates):
            backward = await training.forward_backward(datums([s for i in members for s in run.train[i]]), "cross_entropy")
            adam = types.AdamParams(learning_rate=rate, beta1=0.9, beta2=0.99, eps=1e-8, grad_clip_norm=config.max_grad_norm)
            await training.optim_step(adam)
            losses.append(float(backward.metrics["loss:sum"]))
        if run.val:
            metrics["val_loss"] = await val_loss()
        metrics.update({
            "loss_first_step": losses[0], "loss_last_step": losses[-1], "optimizer_steps": float(len(steps)),
            "epochs": float(config.epochs), "num_examples": float(len(run.train)), "num_val_examples": float(len(run.val)),
            "examples_without_trained_tokens": float(run.skipped), "train_seconds": time.monotonic() - started, **run.stats.metrics(),
        })  # fmt: skip
        result = await self._commit(trainable, self._state(trainable)["step"] + 1, metrics)
        trainable.run_dir.append_history(history_row(result.step, SFT_SPLIT, metrics))
        return result

    async def get_step(self, model: Model) -> int:
        return int(self._state(self._registered(model))["step"])

    async def list_checkpoints(self, model: Model) -> list[int]:
        return sorted(int(step) for step in self._state(self._registered(model))["states"])

    async def delete_checkpoints(self, model: Model, keep: list[int]) -> list[int]:
        """Delete the saved states (and sampler weights) of every step not in ``keep``, never the newest."""
        import tinker

        trainable = self._registered(model)
        state = self._state(trainable)
        rest = tinker.RestClient(base_url=self.base_url, api_key=self.api_key)
        deleted = []
        for step, path in sorted(state["states"].items(), key=lambda item: int(item[0])):
            if int(step) in keep or int(step) == state["step"]:
                continue
            await rest.delete_checkpoint_from_tinker_path(path)
            del state["states"][step]
            deleted.append(int(step))
        self._write_state(trainable, state)
        return deleted

    async def close(self) -> None:
        self.clients.clear()
        self.service = None

    # -- helpers ---------------------------------------------------------------------------
    async def _commit(self, model: TrainableModel, step: int, metrics: dict[str, float]) -> TrainResult:
        """Save the state as ``step`` and its weights for sampling as ``name@step``; then record it in ``tinker.json``."""
        training = self.clients[model.project, model.name]
        started = time.monotonic()
        saved = await training.save_state(f"step-{step}")
        await training.save_weights_for_sampler(name=model.get_inference_name(step))
        metrics["save_seconds"] = time.monotonic() - started
        state = self._state(model)
        state["states"][str(step)] = saved.path
        state["step"] = step
        self._write_state(model, state)
        model._step_cache = step
        return TrainResult(step=step, metrics=metrics, checkpoint_path=saved.path)

    def _registered(self, model: Model) -> TrainableModel:
        if not isinstance(model, TrainableModel) or (model.project, model.name) not in self.clients:
            raise ConfigError(f"model {model.name!r} is not registered with this TinkerBackend: await model.register(backend) first")
        return model

    @staticmethod
    def _state(model: TrainableModel) -> dict[str, Any]:
        path = model.run_dir.root / "tinker.json"
        if path.exists():
            return json.loads(path.read_text())
        return {"step": 0, "states": {}}

    @staticmethod
    def _write_state(model: TrainableModel, state: dict[str, Any]) -> None:
        model.run_dir.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(model.run_dir.root / "tinker.json", json.dumps(state))

    def _datums(self, model: TrainableModel, groups: list[TrajectoryGroup], scale_rewards: bool, allow_retokenize: bool) -> tuple[list[Any], dict[str, float]]:
        """Rows tokenized as LocalBackend does, as Tinker datums whose summed loss is LocalBackend's mean."""
        from ..train.grpo import equal_trajectory_weights, group_advantages
        from ..train.tokenization import TokenizeStats, tokenize_trajectory

        tokenizer = self.tokenizers[model.project, model.name]
        stats = TokenizeStats()
        rows = []
        trajectory_index = trainable_groups = 0
        for g, group in enumerate(groups):
            if any(choice.token_advantages is not None for t in group.trajectories for choice in t.sampled_turns()):
                raise ConfigError("TinkerBackend does not train per-token advantages (on-policy distillation) yet: use LocalBackend")
            advantages, trainable = group_advantages(group.rewards, scale_rewards=scale_rewards)
            trainable_groups += trainable
            for trajectory, advantage in zip(group.trajectories, advantages):
                if trainable:
                    for row in tokenize_trajectory(
                        trajectory, tokenizer, trajectory_index=trajectory_index, group_index=g, allow_retokenize=allow_retokenize, stats=stats
                    ):
                        rows.append((row, advantage))
                trajectory_index += 1
        per_trajectory: dict[int, int] = {}
        for row, _ in rows:
            per_trajectory[row.trajectory_index] = per_trajectory.get(row.trajectory_index, 0) + row.num_trainable
        keys = sorted(per_trajectory)
        weight_of = dict(zip(keys, equal_trajectory_weights([per_trajectory[k] for k in keys])))
        total = max(sum(row.num_trainable for row, _ in rows), 1)
        datums = []
        for row, advantage in rows:
            scale = advantage * weight_of[row.trajectory_index] / total
            weights = row.weights[1:]  # token i+1 is the target at position i
            logprobs = [lp if w > 0 and not math.isnan(lp) else 0.0 for lp, w in zip(row.old_logprobs[1:], weights)]
            datums.append(_datum(row, {"logprobs": logprobs, "advantages": [scale * w for w in weights]}))
        metrics = {
            "num_groups": float(len(groups)),
            "num_groups_trainable": float(trainable_groups),
            "num_trajectories": float(trajectory_index),
            "num_sequences": float(len(rows)),
            "trained_tokens": float(total),
            **stats.metrics(),
        }
        return datums, metrics


def _datum(row: Any, inputs: dict[str, list[float]]) -> Any:
    """A Tinker ``Datum`` of one tokenized row: position ``i`` predicts token ``i + 1`` (``inputs`` per target)."""
    from tinker import types

    return types.Datum(model_input=types.ModelInput.from_ints(row.token_ids[:-1]), loss_fn_inputs={"target_tokens": row.token_ids[1:], **inputs})
