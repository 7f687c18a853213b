"""``tracerl.TinkerBackend``: tracerl's ``Backend`` over any Tinker-API service, through the official SDK.

``backend.train(model, groups)`` trains what :class:`~tracerl.LocalBackend` trains on the same
groups, with the same keywords, defaults and checks (:class:`~tracerl.train.step_config.StepConfig`):
the groups are tokenized by LocalBackend's own code (:func:`tracerl.train.local_backend.training_sequences`:
the sampled turns' token ids and logprobs, each turn's policy lag from its ``name@step``), and the
loss is tracerl's :func:`~tracerl.train.grpo.policy_loss` itself, computed here on the logprobs the
service computed.  That is the SDK's ``forward_backward_custom``: a ``forward`` returns the
trainer's logprob of every target token, the loss is computed and differentiated here, and its
gradient with respect to those logprobs goes back as the weights of a ``cross_entropy`` backward,
which gives the adapter the loss's exact gradient.  So everything LocalBackend's loss does comes
with it: CISPO or PPO with its clips, token- or sequence-level ratios, equal weight per trajectory
over the step's trained tokens (the same normaliser), the decoupled off-policy correction of turns
an older policy sampled, turns without sampler logprobs at ratio 1, per-token advantages, and the
k3 KL to the base model, whose logprobs come from a sampling client of the base model
(``compute_logprobs``).  The train–inference mismatch metrics are computed on the same logprobs and
``max_mismatch_kl`` is enforced before ``optim_step`` (a refused step sends a zero gradient and
applies nothing).  ``optim_step`` is Adam with LocalBackend's betas, eps and gradient clip.

Then the new weights are saved for sampling as ``name@step``, which the service serves at once
on its OpenAI-compatible endpoint (``tracerl serve --tinker``: ``/v1``), so
``model.openai_client()`` and capture work as with any backend.  The run's Tinker state paths are
kept in the run directory (``tinker.json``), so a new process resumes from the newest saved state.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterable
from typing import Any, Literal

from ..errors import ConfigError, MismatchError, NonFiniteError
from ..model import Model, TrainableModel
from ..redact import register_secret
from ..runs.durable import atomic_write_text
from ..runs.storage import history_row
from ..train.step_config import StepConfig
from ..types import TrainResult, TrajectoryGroup, check_groups
from ..validation import check_train_arguments

log = logging.getLogger("tracerl.tinker")

UNFILTERED = (1.0, 0, 1.0)
"""A turn's sampling ``(temperature, top_k, top_p)`` that a Tinker ``forward``'s logprobs are of."""


class TinkerBackend:
    """Train through a Tinker-API service (``tracerl serve --tinker``, or a hosted one)."""

    def __init__(
        self, base_url: str | None = None, api_key: str | None = None, *, openai_base_url: str | None = None, seed: int | None = None
    ) -> None:  # fmt: skip
        """``base_url``/``api_key``: the service and your ``tml-`` key (default ``$TINKER_BASE_URL`` /
        ``$TINKER_API_KEY``, as the SDK reads them).  ``openai_base_url``: where the saved sampler
        weights answer OpenAI requests (default ``<base_url>/v1``, ``tracerl serve``'s).  ``seed``: the
        initialisation seed of a new model's LoRA (``create_lora_training_client(seed=...)``; None: the service's choice)."""
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
        self.base_samplers: dict[str, Any] = {}  # base model -> a SamplingClient of it (KL's reference logprobs)
        self.seed = seed

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
            training = await self.service.create_lora_training_client(
                base_model=model.base_model, rank=rank, seed=self.seed, train_unembed=False
            )
            await training.save_weights_for_sampler(name=model.get_inference_name(0))
        self.clients[model.project, model.name] = training
        self.tokenizers[model.project, model.name] = training.get_tokenizer()
        model.inference_base_url = self.openai_base_url
        model.inference_api_key = self.api_key
        model._step_cache = state["step"]

    async def train(
        self,
        model: Model,
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
        """One GRPO step on the groups, as :meth:`LocalBackend.train <tracerl.LocalBackend.train>` takes it.

        The keywords, their defaults and their checks are LocalBackend's
        (:class:`~tracerl.train.step_config.StepConfig`; docs/training.md, "What backend.train does");
        an unknown one is a ``TypeError``.  The metrics carry LocalBackend's names (``loss``,
        ``grad_norm``, ``ratio_mean``, ``kl``, ``stale_token_fraction``, ``mismatch_kl``, ...; not
        ``entropy``: a Tinker ``forward`` returns the target tokens' logprobs only).  A step whose
        loss is not finite, or whose gradient norm is not, applies nothing: :class:`NonFiniteError`,
        or with ``on_non_finite="skip"`` a new step with the adapter unchanged; a mismatch above
        ``max_mismatch_kl`` is a :class:`~tracerl.errors.MismatchError` and the step does not advance.
        Turns sampled with a temperature other than 1, top-k or top-p are refused (``ConfigError``):
        a Tinker ``forward`` computes the unprocessed distribution's logprobs.
        """
        check_train_arguments(scale_rewards=scale_rewards, allow_retokenize=allow_retokenize, on_non_finite=on_non_finite)
        config = StepConfig.from_train_kwargs(
            learning_rate=learning_rate, loss_fn=loss_fn, epsilon=epsilon, epsilon_high=epsilon_high,
            importance_sampling_level=importance_sampling_level, kl_penalty_coef=kl_penalty_coef, max_grad_norm=max_grad_norm,
            off_policy_cap=off_policy_cap, max_mismatch_kl=max_mismatch_kl, mismatch_correction=mismatch_correction,
            mismatch_cap=mismatch_cap,
        )  # fmt: skip
        from ..train.local_backend import PolicyLags, training_sequences
        from ..train.sampled_turns import check_sampled_turns

        trainable = self._registered(model)
        groups = list(trajectory_groups)
        without_sampled_turns = check_sampled_turns(groups)
        check_groups(groups)
        started = time.monotonic()
        step = self._state(trainable)["step"] + 1
        lags = PolicyLags(trainable, trained_from=step - 1)
        tokenizer = self.tokenizers[trainable.project, trainable.name]
        sequences, metrics = training_sequences(
            groups, lambda: tokenizer, scale_rewards=scale_rewards, allow_retokenize=allow_retokenize, max_seq_len=None, lags=lags
        )
        metrics.update(lags.metrics())
        metrics["trajectories_without_sampled_turns"] = float(without_sampled_turns)
        if sequences:
            await self._step(trainable, sequences, config, metrics, on_non_finite)
        metrics["train_seconds"] = time.monotonic() - started
        result = await self._commit(trainable, step, metrics)
        result.metrics["step_seconds"] = time.monotonic() - started
        return result

    async def _step(
        self, model: TrainableModel, sequences: list[Any], config: StepConfig, metrics: dict[str, float], on_non_finite: str
    ) -> None:
        """``forward_backward_custom`` with tracerl's loss, the checks, then ``optim_step`` (or nothing, see :meth:`train`)."""
        import tinker
        from tinker import types

        from ..train.local_backend import trajectory_weights

        _check_sampling(sequences)
        reference = await self._reference_logprobs(model, sequences) if config.kl_penalty_coef else None
        loss = StepLoss(sequences, trajectory_weights(sequences), config, reference)
        training = self.clients[model.project, model.name]
        await training.forward_backward_custom([_datum(seq, {}) for seq in sequences], loss)
        metrics.update(loss.metrics)
        refused = loss.refused
        if refused is None:
            adam = types.AdamParams(learning_rate=config.learning_rate, beta1=0.9, beta2=0.99, eps=1e-8, grad_clip_norm=config.max_grad_norm)
            try:
                optimizer = await training.optim_step(adam)
            except tinker.RequestFailedError as error:
                if "NonFiniteError" not in str(error):
                    raise
                refused = NonFiniteError(f"{error}; the optimizer step was not taken")
            else:
                optimizer_metrics = {key.split(":")[0]: float(value) for key, value in (optimizer.metrics or {}).items()}
                metrics["grad_norm"] = optimizer_metrics.pop("grad_norm", float("nan"))
                metrics.update(optimizer_metrics)
        if isinstance(refused, NonFiniteError) and on_non_finite == "skip":
            log.warning("on_non_finite='skip': %s; the update is skipped and the adapter saved unchanged as the new step", refused)
            metrics["skipped_non_finite"] = 1.0
        elif isinstance(refused, NonFiniteError):
            raise NonFiniteError(
                f"{refused}; the step did not advance, the adapter and optimizer state are unchanged "
                "(on_non_finite='skip' skips such updates instead)"
            ) from refused
        elif refused is not None:
            raise refused

    async def _reference_logprobs(self, model: TrainableModel, sequences: list[Any]) -> list[list[float | None]]:
        """The base model's logprob of each token of each sequence (KL's reference), from a sampling
        client of the base model (``compute_logprobs``; the first token's is None)."""
        import asyncio

        from tinker import types

        sampler = self.base_samplers.get(model.base_model)
        if sampler is None:
            sampler = self.base_samplers[model.base_model] = await self.service.create_sampling_client(base_model=model.base_model)
        return list(await asyncio.gather(*(sampler.compute_logprobs(types.ModelInput.from_ints(seq.token_ids)) for seq in sequences)))

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
        self.base_samplers.clear()
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


def _datum(row: Any, inputs: dict[str, list[float]]) -> Any:
    """A Tinker ``Datum`` of one tokenized row: position ``i`` predicts token ``i + 1`` (``inputs`` per target)."""
    from tinker import types

    return types.Datum(model_input=types.ModelInput.from_ints(row.token_ids[:-1]), loss_fn_inputs={"target_tokens": row.token_ids[1:], **inputs})


def _check_sampling(sequences: list[Any]) -> None:
    """Refuse trained tokens sampled from a processed distribution (a temperature other than 1, top-k, top-p)."""
    for seq in sequences:
        sampling = getattr(seq, "sampling", None)
        if sampling is None:
            continue
        for weight, params in zip(seq.weights, sampling):
            if weight > 0 and tuple(params) != UNFILTERED:
                temperature, top_k, top_p = params
                raise ConfigError(
                    f"{seq.label or 'a trajectory'} has a turn sampled with temperature={temperature}, top_k={top_k}, "
                    f"top_p={top_p}: TinkerBackend trains the logprobs a Tinker forward computes (temperature 1, no "
                    "top-k/top-p), so it would train another distribution than the one sampled; sample at "
                    "temperature 1 without top-k/top-p, or train with LocalBackend"
                )


class StepLoss:
    """tracerl's GRPO loss on the logprobs a Tinker service computed: ``forward_backward_custom``'s loss function.

    Built from the step's sequences (``TrainingSequence``: what LocalBackend packs), their
    trajectory weights, the :class:`StepConfig` and, for a KL penalty, the base model's logprob of
    each token.  Called by the SDK with the datums (one per sequence, ``token_ids[:-1]`` predicting
    ``token_ids[1:]``) and the trainer's logprob of each target; it picks the trained targets, calls
    :func:`~tracerl.train.grpo.policy_loss` with exactly the arguments LocalBackend's trainer passes (:meth:`StepConfig.loss_kwargs`),
    and records the trainer's metrics and the mismatch metrics in :attr:`metrics`.  A step that must
    not be applied (a non-finite loss, a mismatch above ``max_mismatch_kl``) returns a loss with
    zero gradient and sets :attr:`refused` to the error to raise once the SDK call is done (an error
    raised inside the SDK's call would fail the training client for good).
    """

    def __init__(
        self, sequences: list[Any], trajectory_weights: list[float], config: StepConfig, reference: list[list[float | None]] | None = None
    ) -> None:  # fmt: skip
        import torch

        self.config = config
        positions, weights, advantages, old, lags, ids, ref = [], [], [], [], [], [], []
        for index, (seq, trajectory_weight) in enumerate(zip(sequences, trajectory_weights)):
            picked = [t for t in range(1, len(seq.token_ids)) if seq.weights[t] > 0]  # target t sits at position t - 1
            positions.append(torch.tensor([t - 1 for t in picked], dtype=torch.long))
            for t in picked:
                weights.append(seq.weights[t] * trajectory_weight)
                advantages.append(seq.advantage + (seq.token_advantages[t] if seq.token_advantages is not None else 0.0))
                old.append(seq.old_logprobs[t])
                lags.append(seq.policy_lags[t] if seq.policy_lags is not None else 0)
                ids.append(index)
                if reference is not None:
                    value = reference[index][t]
                    ref.append(float("nan") if value is None else float(value))
        self.positions = positions
        self.weights_N = torch.tensor(weights, dtype=torch.float32)
        self.advantages_N = torch.tensor(advantages, dtype=torch.float32)
        self.old_logprobs_N = torch.tensor(old, dtype=torch.float32)
        self.policy_lag_N = torch.tensor(lags, dtype=torch.long) if any(lags) else None
        self.sequence_ids_N = torch.tensor(ids, dtype=torch.long)
        self.ref_logprobs_N = torch.tensor(ref, dtype=torch.float32) if reference is not None else None
        if self.ref_logprobs_N is not None and bool(torch.isnan(self.ref_logprobs_N).any()):
            raise ConfigError("the service returned no reference logprob for some trained tokens: the KL penalty cannot be computed")
        self.normalizer = float((self.weights_N > 0).sum())
        self.metrics: dict[str, float] = {}
        self.refused: Exception | None = None

    def __call__(self, data: list[Any], logprobs_list: list[Any]) -> tuple[Any, dict[str, float]]:
        import torch

        from ..train.grpo import policy_loss, probability_correlation
        from ..train.mismatch import check_mismatch, mismatch_metrics, mismatch_sums

        config = self.config
        logprobs_N = torch.cat([lp.float()[index] for lp, index in zip(logprobs_list, self.positions)])
        out = policy_loss(
            logprobs_N,
            self.old_logprobs_N,
            self.advantages_N,
            self.weights_N,
            normalizer=self.normalizer,
            ref_logprobs_BT=self.ref_logprobs_N,
            sequence_ids_BT=self.sequence_ids_N,
            policy_lag_BT=self.policy_lag_N,
            **config.loss_kwargs(),
        )
        n = max(out.tokens, 1.0)
        metrics = {
            "loss": float(out.loss.detach()),
            "ratio_mean": out.ratio_sum / n,
            "ratio_max": out.ratio_max,
            "clipped_fraction": out.clipped / n,
            "trained_tokens": out.tokens,
            "forward_tokens": float(sum(datum.model_input.length for datum in data)),
        }
        if config.kl_penalty_coef:
            metrics["kl"] = out.kl_sum / n
        if out.stale_tokens:
            metrics["off_policy_ratio_mean"] = out.off_policy_ratio_sum / out.stale_tokens
            metrics["off_policy_ratio_max"] = out.off_policy_ratio_max
            metrics["off_policy_truncated_fraction"] = out.off_policy_truncated / out.stale_tokens
        metrics["stale_token_fraction"] = out.stale_tokens / n
        mask = self.weights_N > 0
        corr = probability_correlation(self.old_logprobs_N[mask], logprobs_N.detach()[mask])
        if not math.isnan(corr):
            metrics["sampler_trainer_prob_corr"] = corr
        fresh = mask if self.policy_lag_N is None else mask & (self.policy_lag_N == 0)
        metrics.update(mismatch_metrics(mismatch_sums(logprobs_N, self.old_logprobs_N, fresh, config.mismatch_cap)))
        if config.mismatch_correction == "mis":
            metrics["mismatch_masked_fraction"] = out.mismatch_masked / n
        self.metrics = metrics
        if not torch.isfinite(out.loss):
            self.refused = NonFiniteError(f"the loss is {float(out.loss.detach())}; the optimizer step was not taken")
        else:
            try:
                check_mismatch(metrics, config.max_mismatch_kl)
            except MismatchError as error:
                self.refused = error
        if self.refused is not None:  # nothing of this step may reach the adapter: a zero gradient
            return sum((lp * torch.zeros_like(lp)).sum() for lp in logprobs_list), {}
        return out.loss, {}
