"""The core RL types, in one short module.

What gets trained is decided by *provenance*, not by role: a plain message dict in
``Trajectory.messages_and_choices`` is context (weight 0), a :class:`Choice` is a turn
sampled by the policy and carries the exact token ids and logprobs the sampler produced
(weight 1).  OpenAI ``Choice`` objects (from ``openai``'s SDK) are accepted as they are
and converted, so ART-style rollout code works unchanged.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import traceback as traceback_module
import uuid
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Iterable, Sequence, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_serializer, field_validator

from .errors import TrajectoryError
from .redact import redact_text
from .validation import (
    check_logprobs,
    check_metrics,
    check_token_advantages,
    check_token_ids,
    describe_group,
    describe_trajectory,
    finite_reward,
    is_number,
)

Message = dict[str, Any]
"""An OpenAI-style chat message (``role``, ``content``, optional ``tool_calls`` / ``tool_call_id``)."""

Tool = dict[str, Any]
"""An OpenAI-style tool schema (``{"type": "function", "function": {...}}``)."""


def _checked_metrics(value: dict[str, float | int | bool]) -> dict[str, float | int | bool]:
    check_metrics(value)
    return value


Metrics = Annotated[dict[str, Union[float, int, bool]], AfterValidator(_checked_metrics)]
"""Named numbers (bools, ints, finite floats: a NaN would poison the averages ``model.log`` writes)."""


def _validation_message(error: ValidationError) -> str:
    """pydantic's errors as one line each: ``Trajectory.reward: reward must be a finite number, got nan``."""
    parts = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"])
        message = str(item["msg"]).removeprefix("Value error, ")
        parts.append(f"{error.title}.{where}: {message}" if where else message)  # no loc: our own error, already named
    return "; ".join(parts)


class _Checked(BaseModel):
    """Fields validated at construction *and* assignment (``t.reward = nan`` raises), with
    :class:`TrajectoryError` instead of pydantic's ``ValidationError`` (both are ``ValueError``)."""

    model_config = ConfigDict(validate_assignment=True)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise TrajectoryError(_validation_message(error)) from error

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as error:
            raise TrajectoryError(_validation_message(error)) from error


GREEDY_BELOW = 1e-5
"""A temperature below this samples greedily (vLLM's ``_SAMPLING_EPS``; tracerl's servers use the same)."""


class SamplingParams(_Checked):
    """The sampling parameters a tracerl server applied to one sampled turn (``Choice.sampling``).

    The logprobs a tracerl server returns, and a :class:`Choice` records, are those of this
    distribution: ``log_softmax`` of the logits divided by ``temperature``, with the tokens
    outside the ``top_k`` most likely and outside the ``top_p`` nucleus at ``-inf`` and the rest
    renormalised (vLLM's ``processed_logprobs``).  A greedy turn (``temperature`` 0) records the
    untempered (temperature 1) logprobs, with ``top_p`` 1 and ``top_k`` 0: its distribution is
    a point mass, which the trainer does not treat as a policy sample.
    """

    model_config = ConfigDict(frozen=True)

    temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    """The logits are divided by it; 0 is greedy."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    """Nucleus: the smallest set of most likely tokens whose probability reaches ``top_p`` (1: off)."""
    top_k: int = Field(default=0, ge=0)
    """Only the ``top_k`` most likely tokens (0: off)."""

    @field_validator("temperature", "top_p", "top_k", mode="before")
    @classmethod
    def _a_number(cls, value: Any) -> Any:
        if not is_number(value):
            raise ValueError(f"must be a number, got {value!r}")
        return value

    @property
    def greedy(self) -> bool:
        """Sampled greedily (``temperature`` below :data:`GREEDY_BELOW`)."""
        return self.temperature < GREEDY_BELOW

    @classmethod
    def from_field(cls, value: Any) -> "SamplingParams | None":
        """The per-choice ``sampling`` field a tracerl server sends (a dict, or this type), else None.

        Capture reads it with this: a missing or malformed field is unknown (None), never guessed."""
        if isinstance(value, SamplingParams) or value is None:
            return value
        if hasattr(value, "model_dump"):  # an SDK's object for the field
            value = value.model_dump()
        if not isinstance(value, dict):
            return None
        try:
            return cls(**{key: value[key] for key in ("temperature", "top_p", "top_k") if value.get(key) is not None})
        except (TrajectoryError, TypeError):
            return None


class Choice(_Checked):
    """One assistant turn sampled by the policy: the trainable unit of a trajectory."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    message: Message
    """The assistant message (``role="assistant"``, ``content``, optional ``tool_calls``)."""
    token_ids: list[int] | None = None
    """Exact completion token ids as sampled (stop token included when the server returns it)."""
    prompt_token_ids: list[int] | None = None
    """Exact prompt token ids the server rendered for this call."""
    logprobs: list[float] | None = None
    """Sampler logprob of each completion token (same length as ``token_ids``)."""
    finish_reason: str | None = None
    index: int = 0
    response_id: str | None = None
    """Id of the chat-completion response, used to join capture spans with token data."""
    model: str | None = None
    """The model that sampled this turn, as the server named it in its response: for a policy
    tracerl serves, ``name@step``, the policy version (``TrainableModel.policy_step``).
    ``backend.train`` corrects turns sampled by an older policy off-policy."""
    token_advantages: list[float] | None = None
    """Per-token advantage of each completion token, *added* to the group's reward advantage by
    ``backend.train`` (same length as ``token_ids``).  On-policy distillation writes
    ``−kl_coef · (logπ_student − logπ_teacher)`` here (:func:`tracerl.train.distill.add_teacher_advantages`)."""
    sampling: SamplingParams | None = None
    """The sampling parameters the server applied to this turn (tracerl's servers send them with
    every choice), so ``logprobs`` are known to be those of that tempered, filtered distribution.
    None: unknown (a hand-built ``Choice``, another provider's server); read as temperature 1."""

    @field_validator("message", mode="before")
    @classmethod
    def _message_as_dict(cls, value: Any) -> Any:
        if hasattr(value, "model_dump"):
            value = value.model_dump(exclude_none=True)
        return value

    @field_validator("token_ids", "prompt_token_ids")
    @classmethod
    def _ids_in_range(cls, value: list[int] | None) -> list[int] | None:
        check_token_ids(value)  # the upper bound (the model's vocabulary) is checked by train
        return value

    @field_validator("logprobs")
    @classmethod
    def _finite_logprobs(cls, value: list[float] | None) -> list[float] | None:
        check_logprobs(value)
        return value

    @field_validator("token_advantages")
    @classmethod
    def _finite_advantages(cls, value: list[float] | None) -> list[float] | None:
        check_token_advantages(value, None)
        return value

    @classmethod
    def from_openai(cls, choice: Any, completion: Any | None = None) -> "Choice":
        """Build from an OpenAI SDK ``Choice`` (and, if given, its ``ChatCompletion``).

        vLLM and tracerl's servers put ``token_ids`` on the choice and
        ``prompt_token_ids`` on the response; OpenAI logprobs live in
        ``choice.logprobs.content[i].logprob``; tracerl's servers add the choice's ``sampling``.
        """
        extra = dict(getattr(choice, "model_extra", None) or {})
        message = choice.message.model_dump(exclude_none=True)
        message.setdefault("role", "assistant")
        for key in ("refusal", "audio", "function_call", "annotations"):
            if message.get(key) in (None, [], {}):
                message.pop(key, None)
        logprobs = None
        content = getattr(getattr(choice, "logprobs", None), "content", None)
        if content:
            logprobs = [float(entry.logprob) for entry in content]
        prompt_ids = extra.get("prompt_token_ids")
        response_id = served_by = None
        if completion is not None:
            completion_extra = getattr(completion, "model_extra", None) or {}
            prompt_ids = prompt_ids or completion_extra.get("prompt_token_ids")
            response_id = getattr(completion, "id", None)
            served_by = getattr(completion, "model", None)
        return cls(
            message=message,
            token_ids=extra.get("token_ids"),
            prompt_token_ids=prompt_ids,
            logprobs=logprobs,
            sampling=SamplingParams.from_field(extra.get("sampling")),
            finish_reason=getattr(choice, "finish_reason", None),
            index=getattr(choice, "index", 0),
            response_id=response_id,
            model=served_by if isinstance(served_by, str) else None,
        )


MessageOrChoice = Union[Message, Choice]
"""An item of ``messages_and_choices``: a message, or a sampled turn (ART's ``art.MessageOrChoice``)."""
Messages = list[Message]
"""A conversation (ART's ``art.Messages``)."""
MessagesAndChoices = list[MessageOrChoice]
"""A trajectory's turns: messages, and the sampled choices among them (ART's ``art.MessagesAndChoices``)."""
Tools = list[Tool]
"""Tool schemas as the OpenAI SDK takes them (ART's ``art.Tools``)."""


def _coerce_item(item: Any) -> MessageOrChoice:
    if isinstance(item, (dict, Choice)):
        return item
    if hasattr(item, "message") and hasattr(item, "finish_reason"):
        return Choice.from_openai(item)
    if hasattr(item, "model_dump"):  # e.g. an OpenAI ChatCompletionMessage used as context
        return item.model_dump(exclude_none=True)
    raise TrajectoryError(
        f"messages_and_choices items must be message dicts or sampled choices, got {type(item).__name__}"
    )


class History(_Checked):
    """An extra sequence of the same trajectory (a sub-agent, a branch, a compacted context)."""

    messages_and_choices: list[Any]
    tools: list[Tool] | None = None

    @field_validator("messages_and_choices", mode="before")
    @classmethod
    def _coerce(cls, value: Any) -> list[MessageOrChoice]:
        return [_coerce_item(item) for item in value]

    @field_serializer("messages_and_choices", mode="wrap")
    def _dump_coerced(self, items: list[Any], handler: Any) -> Any:
        return handler(self.checked_items())  # stored as a Choice, so it is read back as one

    def checked_items(self) -> list[MessageOrChoice]:
        """``messages_and_choices`` checked: an OpenAI SDK ``Choice`` appended as it came (ART's
        idiom; ``append`` skips validation) is read as the :class:`Choice` it stands for."""
        return [item if isinstance(item, (dict, Choice)) else _coerce_item(item) for item in self.messages_and_choices]

    def messages(self) -> list[Message]:
        """The conversation as plain message dicts (sampled choices rendered back)."""
        return [item.message if isinstance(item, Choice) else item for item in self.checked_items()]


class Trajectory(History):
    """One attempt at a task: what the agent saw and did, and how well it went."""

    model_config = ConfigDict(arbitrary_types_allowed=True, validate_assignment=True)

    additional_histories: list[History] = Field(default_factory=list)
    reward: float = 0.0
    metrics: Metrics = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    trace_id: str | None = None
    id: str = Field(default_factory=lambda: uuid.uuid4().hex[:12])

    @field_validator("reward", mode="before")
    @classmethod
    def _finite_reward(cls, value: Any) -> float:
        return finite_reward(value)


    def log(self, message: str) -> None:
        self.logs.append(message)

    def histories(self) -> list[History]:
        """The main history followed by the additional ones."""
        return [History(messages_and_choices=self.messages_and_choices, tools=self.tools), *self.additional_histories]

    def sampled_turns(self) -> list[Choice]:
        return [item for h in self.histories() for item in h.messages_and_choices if isinstance(item, Choice)]

    def to_json_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what ``trajectories/{split}/{step}.jsonl`` stores).

        Values JSON cannot represent (a task object in ``metadata``, say) are written as
        ``str(value)`` rather than failing: a log step must never be lost to one odd value.
        """
        return self.model_dump(mode="json", fallback=str)

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> "Trajectory":
        """The inverse of :meth:`to_json_dict`: sampled turns come back as :class:`Choice`.

        ``to_json_dict`` writes a ``Choice`` as ``{"message": ..., "token_ids": ...}``, which a plain
        ``model_validate`` would keep as a context dict (weight 0): provenance would be lost.  Keys
        that are not fields (``"group"`` in stored rows) are ignored.  Malformed data raises
        :class:`TrajectoryError`.
        """
        if not isinstance(data, dict):
            raise TrajectoryError(f"a stored trajectory must be a JSON object, got {type(data).__name__}")
        try:
            data = _with_choices(dict(data))
            if isinstance(data.get("additional_histories"), list):
                data["additional_histories"] = [_with_choices(h) for h in data["additional_histories"]]
            return cls.model_validate(data)
        except TrajectoryError:
            raise
        except ValidationError as error:
            raise TrajectoryError(f"malformed trajectory{_id_of(data)}: {_validation_message(error)}") from error
        except (TypeError, ValueError, AttributeError) as error:
            raise TrajectoryError(f"malformed trajectory{_id_of(data)}: {error}") from error


def _id_of(data: Any) -> str:
    """`` (id 3f2a...)`` when a stored trajectory carries its id, for error messages."""
    return f" (id {data['id']})" if isinstance(data, dict) and isinstance(data.get("id"), str) else ""


def _with_choices(history: Any) -> Any:
    """A copy of a stored history dict whose sampled turns (``message`` but no ``role``) are ``Choice`` again."""
    if not isinstance(history, dict) or not isinstance(history.get("messages_and_choices"), list):
        return history  # anything else is left for validation to reject
    items = [
        Choice.model_validate(item) if isinstance(item, dict) and "message" in item and "role" not in item else item
        for item in history["messages_and_choices"]
    ]
    return {**history, "messages_and_choices": items}


@dataclass(frozen=True)
class ExceptionRecord:
    """A failed rollout, kept as a value so nothing is lost."""

    type: str
    message: str
    traceback: str

    @classmethod
    def from_exception(cls, error: BaseException) -> "ExceptionRecord":
        """The record of ``error``, credentials redacted (an error body may echo the request's key;
        records travel to ``tracerl serve`` and into files)."""
        return cls(
            type=type(error).__name__,
            message=redact_text(str(error)),
            traceback=redact_text("".join(traceback_module.format_exception(type(error), error, error.__traceback__))),
        )


_group_scope: ContextVar[str | None] = ContextVar("tracerl_group", default=None)


def current_group_id() -> str | None:
    """The id of the group whose rollouts run here (set while a group gathers its rollouts).

    A rollout started without ``group=`` takes it, so the N attempts at one task share one
    id (a Langfuse session) however the user builds the group.
    """
    return _group_scope.get()


def group_scope(group_id: str | None = None) -> Any:
    """Run what follows (and the tasks it creates) as the rollouts of one group; returns the token."""
    return _group_scope.set(group_id or uuid.uuid4().hex[:8])


class TrajectoryGroup(_Checked):
    """All attempts at one task; GRPO compares their rewards with each other."""

    model_config = ConfigDict(arbitrary_types_allowed=True, validate_assignment=True)

    trajectories: list[Trajectory]
    exceptions: list[ExceptionRecord] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)
    metrics: Metrics = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)

    def __init__(
        self,
        trajectories: Iterable[Trajectory | BaseException] = (),
        exceptions: Iterable[ExceptionRecord | BaseException] = (),
        **kwargs: Any,
    ) -> None:
        kept: list[Trajectory] = []
        records: list[ExceptionRecord] = []
        pending: list[Any] = []
        for item in list(trajectories) + list(exceptions):
            if inspect.isawaitable(item):
                pending.append(item)
            elif isinstance(item, BaseException):
                records.append(ExceptionRecord.from_exception(item))
            elif isinstance(item, ExceptionRecord):
                records.append(item)
            elif isinstance(item, dict) and "message" in item and "traceback" in item:
                records.append(ExceptionRecord(**item))
            else:
                kept.append(item if isinstance(item, Trajectory) else Trajectory.from_json_dict(item))
        super().__init__(trajectories=kept, exceptions=records, **kwargs)
        self._pending = pending

    _pending: list[Any] = PrivateAttr(default_factory=list)

    async def resolve(self) -> "TrajectoryGroup":
        """Await the rollouts this group was built from (ART style: ``TrajectoryGroup(rollout() for ...)``).

        A rollout that raises becomes an :class:`ExceptionRecord`; nothing is lost.
        """
        pending, self._pending = self._pending, []
        token = group_scope(current_group_id())  # the tasks gather creates copy this context
        try:
            results = await asyncio.gather(*pending, return_exceptions=True)
        finally:
            _group_scope.reset(token)
        for result in results:
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):  # KeyboardInterrupt, CancelledError...
                    raise result
                self.exceptions.append(ExceptionRecord.from_exception(result))
            elif isinstance(result, Trajectory):
                self.trajectories.append(result)
            else:
                self.exceptions.append(
                    ExceptionRecord("TypeError", f"rollout returned {type(result).__name__}, not a Trajectory", "")
                )
        return self

    def __await__(self):
        return self.resolve().__await__()

    def __iter__(self):  # type: ignore[override]
        return iter(self.trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    def to_json_dict(self) -> dict[str, Any]:
        """A dict for ``json.dumps`` (with ``default=str``, as storage writes): trajectories as
        :meth:`Trajectory.to_json_dict`, exceptions as ``{type, message, traceback}``."""
        return {
            "trajectories": [t.to_json_dict() for t in self.trajectories],
            "exceptions": [asdict(e) for e in self.exceptions],
            "metadata": dict(self.metadata),
            "metrics": dict(self.metrics),
            "logs": list(self.logs),
        }

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> "TrajectoryGroup":
        """The inverse of :meth:`to_json_dict` (malformed data raises :class:`TrajectoryError`)."""
        if not isinstance(data, dict):
            raise TrajectoryError(f"a stored trajectory group must be a JSON object, got {type(data).__name__}")
        try:
            trajectories = []
            for i, item in enumerate(data.get("trajectories") or []):
                try:
                    trajectories.append(Trajectory.from_json_dict(item))
                except TrajectoryError as error:
                    raise TrajectoryError(f"trajectory {i}: {error}") from error
            return cls(
                trajectories,
                exceptions=[ExceptionRecord(**e) for e in data.get("exceptions") or []],
                metadata=data.get("metadata") or {},
                metrics=data.get("metrics") or {},
                logs=data.get("logs") or [],
            )
        except TrajectoryError:
            raise
        except (TypeError, ValueError, AttributeError) as error:
            raise TrajectoryError(f"malformed trajectory group: {error}") from error


@dataclass(frozen=True)
class TrainResult:
    """What one ``backend.train`` call did."""

    step: int
    """The model's step after this call (the new checkpoint number)."""
    metrics: dict[str, float] = field(default_factory=dict)
    checkpoint_path: str | None = None


@dataclass(frozen=True)
class DatasetBatch:
    """One batch from :func:`tracerl.iterate_dataset`."""

    items: list[Any]
    step: int
    epoch: int
    epoch_step: int


def check_groups(groups: Sequence[Any], *, vocab_size: int | None = None) -> None:
    """Every reward, metric, sampler logprob and token id of ``groups``, again.

    The types checked them when they were set; this catches what was changed in place since
    (``t.metrics["x"] = nan``, ``choice.token_ids[0] = -1``).  ``vocab_size`` (the model's
    embedding rows) bounds the token ids.  The error names the group, the trajectory, the
    history and the turn.
    """
    for g, group in enumerate(groups):
        if not isinstance(group, TrajectoryGroup):
            raise TrajectoryError(f"group {g}: expected a TrajectoryGroup, got {type(group).__name__}")
        check_metrics(group.metrics, f"{describe_group(g, group)}: metrics")
        for i, trajectory in enumerate(group.trajectories):
            if not isinstance(trajectory, Trajectory):
                raise TrajectoryError(f"{describe_group(g, group)}, trajectory {i}: expected a Trajectory, got {type(trajectory).__name__}")
            where = describe_trajectory(g, group, i, trajectory)
            if not is_number(trajectory.reward) or not math.isfinite(trajectory.reward):
                raise TrajectoryError(f"{where}: reward is {trajectory.reward!r}; rewards must be finite numbers")
            check_metrics(trajectory.metrics, f"{where}: metrics")
            for h, history in enumerate(trajectory.histories()):
                for turn, item in enumerate(history.messages_and_choices):
                    if isinstance(item, Choice):
                        at = f"{where}, history {h}, turn {turn}"
                        check_logprobs(item.logprobs, at)
                        check_token_ids(item.prompt_token_ids, f"{at}, prompt", vocab_size)
                        check_token_ids(item.token_ids, f"{at}, completion", vocab_size)
                        check_token_advantages(item.token_advantages, item.token_ids, at)
