"""``RemoteBackend``: the HTTP client of ``tracerl serve`` (DESIGN §5.7).

Rollouts stay on this machine (a laptop); the LoRA is trained and served on another one.
After ``register`` the model's inference endpoint is the server's ``/v1`` proxy, so
``model.openai_client()`` and capture (token ids joined by response id) work exactly as
with a :class:`~tracerl.LocalBackend`.  Groups travel in the same JSON format that
``trajectories/{split}/{step}.jsonl`` stores (:meth:`Trajectory.to_json_dict`).

Only httpx is imported here: an agent process that trains remotely never loads torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import uuid
from typing import Any, AsyncIterator, Iterable, Literal

import httpx

from ..errors import (
    CheckpointError,
    ConfigError,
    InferenceServerError,
    MismatchError,
    NonFiniteError,
    RemoteBackendError,
    RemoteConnectionError,
    RemoteTimeoutError,
    TooManyExceptionsError,
    TrajectoryError,
)
from ..model import Model, TrainableModel
from ..redact import register_secret
from ..train.step_config import StepConfig
from ..types import TrainResult, TrajectoryGroup
from ..validation import check_train_arguments

log = logging.getLogger("tracerl")

API = "/tracerl/v1"
"""Prefix of the backend endpoints; bumped when the wire format changes incompatibly."""

TOKEN_ENV = "TRACERL_SERVE_TOKEN"
IDEMPOTENCY_HEADER = "Idempotency-Key"  # tracerl.serve.idempotency reads it
DEFAULT_TRAIN_TIMEOUT = 1800.0
"""Seconds for one ``train`` or ``register`` call: a CPU step or a vLLM start takes minutes, a hung server forever."""


# Server-side error types re-raised client-side as the same class, so ``except ConfigError`` etc.
# behave as with a LocalBackend.  TypeError (unknown train keyword) keeps its message unchanged.
_SAME_CLASS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (ConfigError, TrajectoryError, CheckpointError, InferenceServerError, TooManyExceptionsError, NonFiniteError, MismatchError)
}


def _is_default(name: str, value: Any) -> bool:
    """Whether ``backend.train``'s keyword ``name`` is at its default (``RemoteBackend.train``'s signature's)."""
    default = inspect.signature(RemoteBackend.train).parameters[name].default
    return type(value) is type(default) and value == default


# -- wire format (shared with tracerl.serve.server) -----------------------------------------------------
def encode_groups(groups: Iterable[TrajectoryGroup]) -> list[dict[str, Any]]:
    """Groups as JSON-ready dicts (:meth:`TrajectoryGroup.to_json_dict`; trajectories as ``model.log`` stores them)."""
    return [group.to_json_dict() for group in groups]


def decode_groups(data: Any) -> list[TrajectoryGroup]:
    """Inverse of :func:`encode_groups` (raises ``TrajectoryError`` on a malformed payload)."""
    if not isinstance(data, list):
        raise TrajectoryError(f"'groups' must be a list of trajectory groups, got {type(data).__name__}")
    groups = []
    for index, group in enumerate(data):
        try:
            groups.append(TrajectoryGroup.from_json_dict(group))
        except TrajectoryError as error:
            raise TrajectoryError(f"group {index}: {error}") from error
    return groups


def dumps_body(body: dict[str, Any]) -> bytes:
    """JSON like ``storage.dumps_jsonl`` (``default=str`` for odd metadata values)."""
    return json.dumps(body, default=str).encode()


# -- the client ----------------------------------------------------------------------------------
class RemoteBackend:
    """A :class:`~tracerl.Backend` whose models are trained and served by ``tracerl serve`` at ``url``."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout: float = 60.0,
        train_timeout: float | None = DEFAULT_TRAIN_TIMEOUT,
        train_retries: int = 2,
    ) -> None:
        """``token`` defaults to ``$TRACERL_SERVE_TOKEN``.

        ``timeout`` bounds quick calls (step, checkpoints, health) and connecting;
        ``train_timeout`` bounds ``train`` and ``register`` (model loading), ``None``: no limit.
        ``train_retries``: how often a ``train`` call that timed out or lost its connection is sent
        again.  Every attempt carries the call's ``Idempotency-Key``, so the server trains once and a
        retry gets the first attempt's result (waiting for it while it runs): client and server stay
        at the same step.
        """
        if isinstance(train_retries, bool) or not isinstance(train_retries, int) or train_retries < 0:
            raise ConfigError(f"train_retries must be an integer >= 0, got {train_retries!r}")
        url = url.strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"RemoteBackend url must start with http:// or https://, got {url!r}")
        self.url = url.removesuffix("/v1")
        self.token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        register_secret(self.token)  # it travels as the rollouts' api_key: redacted wherever it is recorded
        self.timeout = timeout
        self.train_timeout = train_timeout
        self.train_retries = train_retries
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._max_body_bytes: int | None = None  # the server's request size limit, learned at register
        self._staleness: dict[str, int] = {}  # model name -> the largest max_staleness a PipelineTrainer announced

    # -- Backend --------------------------------------------------------------------------------
    def expect_staleness(self, model: Model, max_staleness: int) -> None:
        """``LocalBackend.expect_staleness`` on the server: a :class:`~tracerl.PipelineTrainer` created before
        ``register`` has its staleness sent with the registration, so the server's vLLM starts with a LoRA slot for
        every policy served at once (the server logs a vLLM started with fewer)."""
        self._staleness[model.name] = max(max_staleness, self._staleness.get(model.name, 0))

    async def register(self, model: Model) -> None:
        if not isinstance(model, TrainableModel):
            return  # a prompted model needs no storage or serving from us
        body = {
            "name": model.name,
            "project": model.project,
            "base_model": model.base_model,
            "lora_config": model.lora_config,
            **model.serving_settings,
            **({"max_staleness": self._staleness[model.name]} if model.name in self._staleness else {}),
        }
        # the first registration loads the model and starts its inference server: minutes, not seconds
        answer = await self._request("POST", f"{API}/models/register", "register", body, timeout=self.train_timeout)
        model.inference_base_url = f"{self.url}/v1"
        model.inference_api_key = self.token or "tracerl"
        model._step_cache = int(answer["step"])
        model.inference_model_name = answer["inference_model_name"]
        if isinstance(answer.get("max_body_bytes"), int):
            self._max_body_bytes = answer["max_body_bytes"]
        await self._recover_history(model)

    async def _recover_history(self, model: TrainableModel) -> None:
        """History lives here, checkpoints there: write the rows of server steps this client never logged.

        A client killed after ``train`` returned and before ``model.log`` ran would otherwise lose
        that step's row for good; the server committed it with the checkpoint (``step.json``)."""
        answer = await self._request("GET", self._path(model, "step_records"), "step_records")
        records = answer.get("records")
        if isinstance(records, list) and records:
            for action in await asyncio.to_thread(model.run_dir.recover_rows, records, source=f"the server's checkpoint ({self.url})"):
                log.warning("%s: %s", model.run_dir.root, action)

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
        """One GRPO step on the server's ``LocalBackend``: the same keywords, defaults and checks
        (:class:`~tracerl.train.step_config.StepConfig`; docs/training.md, "What backend.train does";
        an unknown one is a ``TypeError``).  They are checked here before anything is sent; the ones
        that differ from the defaults travel, so a server that predates a keyword accepts every call
        that leaves it at its default."""
        settings: dict[str, Any] = dict(
            learning_rate=learning_rate, loss_fn=loss_fn, epsilon=epsilon, epsilon_high=epsilon_high,
            importance_sampling_level=importance_sampling_level, kl_penalty_coef=kl_penalty_coef, max_grad_norm=max_grad_norm,
            off_policy_cap=off_policy_cap, max_mismatch_kl=max_mismatch_kl, mismatch_correction=mismatch_correction,
            mismatch_cap=mismatch_cap,
        )  # fmt: skip
        options = {"scale_rewards": scale_rewards, "allow_retokenize": allow_retokenize, "on_non_finite": on_non_finite}
        check_train_arguments(**options)
        StepConfig.from_train_kwargs(**settings)
        kwargs = {name: value for name, value in {**settings, **options}.items() if not _is_default(name, value)}
        trainable = self._trainable(model)
        body = {"groups": encode_groups(trajectory_groups), "kwargs": kwargs}
        key = uuid.uuid4().hex  # one per call, the same on its retries
        for attempt in range(self.train_retries + 1):
            try:
                answer = await self._request(
                    "POST", self._path(trainable, "train"), "train", body, timeout=self.train_timeout, idempotency_key=key
                )
                break
            except (RemoteTimeoutError, _ConnectionLost) as error:  # the server may have got it: ask again, same key
                if attempt == self.train_retries:
                    raise
                log.warning("tracerl: %s; retrying train (%d of %d, same request id)", error, attempt + 1, self.train_retries)
                await asyncio.sleep(min(0.5 * 2**attempt, 10.0))
        trainable._step_cache = int(answer["step"])
        trainable.inference_model_name = answer.get("inference_model_name") or trainable.get_inference_name(answer["step"])
        return TrainResult(
            step=int(answer["step"]), metrics=dict(answer.get("metrics") or {}), checkpoint_path=answer.get("checkpoint_path")
        )

    async def train_sft(
        self,
        model: Model,
        trajectories: Any,
        config: Any = None,
        *,
        val_trajectories: Any = None,
    ) -> TrainResult:
        """``LocalBackend.train_sft`` on the server: the examples are read and checked here (a bad file
        line fails before anything is sent), travel as Trajectory JSON, and the ``sft`` history row is
        also written to this machine's ``history.jsonl``, where ``model.log`` writes the others."""
        from ..runs.storage import history_row, logged_splits
        from ..train.sft_config import SFTConfig
        from ..train.sft_data import as_sft_examples

        trainable = self._trainable(model)
        config = SFTConfig.coerce(config)
        body: dict[str, Any] = {
            "trajectories": [t.to_json_dict() for t in as_sft_examples(trajectories)],
            "config": config.to_dict(),
            "val_trajectories": None if val_trajectories is None else [t.to_json_dict() for t in as_sft_examples(val_trajectories)],
        }
        answer = await self._request("POST", self._path(trainable, "train_sft"), "train_sft", body, timeout=self.train_timeout)
        step, metrics = int(answer["step"]), dict(answer.get("metrics") or {})
        trainable._step_cache = step
        trainable.inference_model_name = answer.get("inference_model_name") or trainable.get_inference_name(step)
        run_dir = trainable.run_dir
        if not any(row.get("step") == step and "sft" in logged_splits(row) for row in run_dir.read_history()):
            run_dir.append_history(history_row(step, "sft", metrics))
        return TrainResult(step=step, metrics=metrics, checkpoint_path=answer.get("checkpoint_path"))

    async def get_step(self, model: Model) -> int:
        answer = await self._request("GET", self._path(self._trainable(model), "step"), "get_step")
        return int(answer["step"])

    async def list_checkpoints(self, model: Model) -> list[int]:
        """The checkpoint steps on the server (the local run directory has none)."""
        answer = await self._request("GET", self._path(self._trainable(model), "checkpoints"), "list_checkpoints")
        return [int(step) for step in answer["steps"]]

    async def delete_checkpoints(self, model: Model, keep: list[int]) -> list[int]:
        path = self._path(self._trainable(model), "delete_checkpoints")
        answer = await self._request("POST", path, "delete_checkpoints", {"keep": list(keep)})
        return [int(step) for step in answer["deleted"]]

    @contextlib.asynccontextmanager
    async def policy_lease(self, model: Model, step: int, *, seconds: float | None = None) -> AsyncIterator[None]:
        """``LocalBackend.policy_lease`` on the server: keep ``name@step`` served while the block runs.

        ``PipelineTrainer`` holds one per group.  Should this process die inside the block, the
        server ends the lease after ``seconds`` (its default: an hour; at most a day).
        """
        path = self._path(self._trainable(model), "leases")
        answer = await self._request("POST", path, "policy_lease", {"step": step, "seconds": seconds})
        try:
            yield
        finally:
            try:
                await self._request("DELETE", f"{path}/{answer['lease']}", "policy_lease release")
            except RemoteBackendError as error:  # the server ends it when it expires
                log.warning("tracerl: could not release the lease on %s: %s", model.get_inference_name(step), error)

    async def close(self) -> None:
        """Close the HTTP connections (the server and its models keep running)."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def health(self) -> dict[str, Any]:
        """The server's ``/tracerl/v1/health`` answer (raises ``RemoteConnectionError`` when down)."""
        return await self._request("GET", f"{API}/health", "health")

    async def __aenter__(self) -> "RemoteBackend":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- plumbing -------------------------------------------------------------------------------
    @staticmethod
    def _trainable(model: Model) -> TrainableModel:
        if not isinstance(model, TrainableModel):
            raise ConfigError(f"model {model.name!r} is not a TrainableModel; only those are trained and served")
        return model

    @staticmethod
    def _path(model: TrainableModel, action: str) -> str:
        return f"{API}/models/{model.project}/{model.name}/{action}"

    def _http(self) -> httpx.AsyncClient:
        """One client per event loop (an ``AsyncClient`` cannot move between loops)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            self._client = httpx.AsyncClient(base_url=self.url, headers=headers)
            self._client_loop = loop
        return self._client

    async def _request(
        self,
        method: str,
        path: str,
        what: str,
        body: dict[str, Any] | None = None,
        *,
        timeout: float | None | str = "default",
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """Send one request; translate transport failures and error answers into tracerl errors."""
        seconds = self.timeout if timeout == "default" else timeout
        where = f"tracerl serve at {self.url}"
        content = dumps_body(body) if body is not None else None
        if content is not None and self._max_body_bytes is not None and len(content) > self._max_body_bytes:
            # the server would answer 413 unread and reset the connection: say so before sending it
            raise RemoteBackendError(
                f"{where}: the {what} request is {len(content)} bytes, over the server's limit of {self._max_body_bytes} "
                "bytes (tracerl serve --max-body-mb): send fewer or smaller groups per call",
                status=413,
                error_type="BodyTooLargeError",
            )
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if idempotency_key is not None:
            headers[IDEMPOTENCY_HEADER] = idempotency_key
        try:
            response = await self._http().request(
                method, path, content=content, headers=headers, timeout=httpx.Timeout(seconds, connect=min(self.timeout, 30.0))
            )
        except (httpx.ConnectError, httpx.ConnectTimeout) as error:
            raise RemoteConnectionError(
                f"cannot reach {where} ({what}): {type(error).__name__}: {error}. Is `tracerl serve` running there?"
            ) from error
        except httpx.TimeoutException as error:
            raise RemoteTimeoutError(f"{where}: {what} timed out after {seconds} s") from error
        except httpx.HTTPError as error:  # the server died or the connection dropped mid-request
            raise _ConnectionLost(f"lost the connection to {where} during {what}: {type(error).__name__}: {error}") from error
        if response.status_code >= 400:
            raise _error_from_response(response, where, what)
        try:
            answer = response.json()
        except ValueError as error:
            raise RemoteBackendError(f"{where}: {what} answered non-JSON: {response.text[:500]!r}") from error
        if not isinstance(answer, dict):
            raise RemoteBackendError(f"{where}: {what} answered {type(answer).__name__}, expected a JSON object")
        return answer


class _ConnectionLost(RemoteConnectionError):
    """The connection broke after the request was sent: the server may have acted on it."""


def _error_from_response(response: httpx.Response, where: str, what: str) -> Exception:
    """The server's ``{"error": {"type", "message"}}`` as the matching exception."""
    try:
        error = response.json().get("error") or {}
        error_type, message = str(error.get("type") or "HTTPError"), str(error.get("message") or "")
    except (ValueError, AttributeError):
        error_type, message = "HTTPError", response.text[:500]
    status = response.status_code
    if error_type == "TypeError":
        return TypeError(message)
    if error_type in _SAME_CLASS:
        return _SAME_CLASS[error_type](f"{where}: {what} failed: {message}")
    if status == 401:
        message = f"{message} (pass token=... or set ${TOKEN_ENV})"
    return RemoteBackendError(f"{where}: {what} failed ({status} {error_type}): {message}", status=status, error_type=error_type)
