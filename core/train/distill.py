"""On-policy distillation: a teacher scores the tokens the student sampled, GRPO's machinery trains on it.

The student samples as in any tracerl rollout (its sampled turns carry exact token ids and
sampler logprobs).  A teacher then scores those very tokens: for every completion token ``x_t``
it returns ``log π_teacher(x_t | context)``.  The per-token sample of the reverse KL,
``log π_student(x_t) − log π_teacher(x_t)``, becomes a per-token advantage
``A_t = −kl_coef · (log π_student − log π_teacher)`` written on the turn
(:attr:`tracerl.Choice.token_advantages`), and ``backend.train`` trains it through the usual
policy-gradient loss (CISPO or PPO; each token's advantage is added to its group's reward
advantage, and a group with equal rewards is trained on its token advantages alone).  This is
the on-policy distillation of tinker-cookbook and SkyRL (the Thinking Machines recipe): the
student learns where *its own* samples disagree with the teacher, mode-seeking.

Teachers (:class:`Teacher`, one method):

* :class:`CompletionsTeacher`: any OpenAI-compatible ``/v1/completions`` endpoint that returns
  logprobs of the prompt tokens: vLLM's ``prompt_logprobs`` (default) or OpenAI's ``echo`` with
  ``logprobs``.  The teacher must share the student's tokenizer (it scores token ids).
* :func:`served_teacher`: a model tracerl serves (vLLM or the transformers server), by default
  the **base** model of a trainable one.  Given ``context=`` (for instance
  :func:`with_worked_examples`) the teacher sees a different conversation than the student did
  (**context distillation**: the same model with worked examples prepended teaches a student
  that sees none); the teacher's prompt is then rendered with the chat template, so it needs
  the tokenizer.

Faults: every teacher call has a timeout (``timeout=``, default 120 s); a call that fails, times
out or answers something that does not score exactly the sampled tokens raises
:class:`TeacherError` (:class:`TeacherTimeoutError`).  Nothing is written on any trajectory
unless every turn was scored: a teacher failure is never a zero-KL trajectory.

    teacher = tracerl.served_teacher(model, context=tracerl.with_worked_examples(EXAMPLES), tokenizer=tok)
    metrics = await tracerl.add_teacher_advantages(groups, teacher, kl_coef=1.0)
    result = await backend.train(model, groups, learning_rate=1e-4)
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Protocol, Sequence

from ..errors import ConfigError, TeacherError, TeacherTimeoutError, TrajectoryError
from ..model import Model, TrainableModel
from ..redact import register_secret
from ..timeouts import check_timeout, within
from ..types import Choice, Message, Tool, Trajectory, TrajectoryGroup
from .tokenization import ChatTokenizer, render_ids

DEFAULT_TEACHER_TIMEOUT = 120.0
"""Seconds per teacher call: one forward pass over a prompt, far shorter than a generation."""
REVERSE_KL_METRIC = "teacher_reverse_kl"
"""Per-trajectory metric: mean over its sampled tokens of ``log π_student − log π_teacher``."""

Context = Callable[[list[Message]], list[Message]]
"""Rewrites the conversation a sampled turn was generated from into the one the teacher sees."""


@dataclass(frozen=True)
class TeacherQuery:
    """One sampled turn to score: what the student saw and the tokens it sampled."""

    messages: list[Message]
    """The conversation before the turn (context messages and earlier turns as messages)."""
    tools: list[Tool] | None
    prompt_token_ids: list[int] | None
    """The exact prompt the student's sampler saw (None when it was not recorded)."""
    completion_token_ids: list[int]


class Teacher(Protocol):
    """Scores a student's sampled tokens: ``log π_teacher`` of each completion token, in order."""

    async def score(self, query: TeacherQuery) -> list[float]: ...


class CompletionsTeacher:
    """A teacher behind an OpenAI-compatible ``/v1/completions`` endpoint that returns prompt logprobs.

    The request is ``prompt = teacher prompt ids + the student's completion ids``, ``max_tokens=1``,
    ``temperature=0``, and either ``prompt_logprobs=0`` (vLLM's extension: each entry maps the
    token id to its logprob, so the answer is checked to score exactly our tokens) or
    ``echo=true, logprobs=0`` (OpenAI's legacy form: checked by length).  The teacher prompt is
    the student's own prompt ids, or, with ``context``, ``context(messages)`` rendered with
    ``tokenizer``'s chat template (the tools included) and a generation prompt.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        context: Context | None = None,
        tokenizer: ChatTokenizer | None = None,
        protocol: Literal["prompt_logprobs", "echo"] = "prompt_logprobs",
        timeout: float | None = DEFAULT_TEACHER_TIMEOUT,
        headers: dict[str, str] | None = None,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"base_url must be an http(s) URL (e.g. http://host:8000/v1), got {base_url!r}")
        if not isinstance(model, str) or not model:
            raise ConfigError(f"model must be a non-empty model name, got {model!r}")
        if protocol not in ("prompt_logprobs", "echo"):
            raise ConfigError(f"protocol must be 'prompt_logprobs' or 'echo', got {protocol!r}")
        if context is not None and tokenizer is None:
            raise ConfigError("a teacher with a different context renders its prompt with the chat template: pass tokenizer=")
        self.url = base_url.rstrip("/") + "/completions"
        self.model = model
        self.context = context
        self.tokenizer = tokenizer
        self.protocol = protocol
        self.timeout = check_timeout(timeout, "timeout")
        self.headers = dict(headers or {})
        if api_key:
            register_secret(api_key)
            self.headers["Authorization"] = f"Bearer {api_key}"

    def teacher_prompt(self, query: TeacherQuery) -> list[int]:
        """The prompt ids the teacher scores the completion after."""
        if self.context is None and query.prompt_token_ids is not None:
            return list(query.prompt_token_ids)
        if self.tokenizer is None:
            raise TrajectoryError("the sampled turn has no prompt_token_ids: pass tokenizer= so the teacher can render its prompt")
        messages = self.context(list(query.messages)) if self.context is not None else list(query.messages)
        return render_ids(self.tokenizer, messages, query.tools, add_generation_prompt=True)

    async def score(self, query: TeacherQuery) -> list[float]:
        import httpx

        prompt = self.teacher_prompt(query)
        completion = list(query.completion_token_ids)
        body: dict[str, Any] = {"model": self.model, "prompt": prompt + completion, "max_tokens": 1, "temperature": 0.0}
        if self.protocol == "prompt_logprobs":
            body["prompt_logprobs"] = 0
        else:
            body.update(echo=True, logprobs=0)
        try:
            async with httpx.AsyncClient(timeout=self.timeout) as client:
                response = await client.post(self.url, json=body, headers=self.headers)
        except httpx.TimeoutException as error:
            raise TeacherTimeoutError(f"teacher {self.model!r} at {self.url} did not answer {within(self.timeout)}") from error
        except httpx.HTTPError as error:
            raise TeacherError(f"teacher {self.model!r} at {self.url} could not be reached: {type(error).__name__}: {error}") from error
        if response.status_code != 200:
            raise TeacherError(f"teacher {self.model!r} at {self.url} answered {response.status_code}: {response.text[:500]}")
        try:
            choice = response.json()["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError) as error:
            raise TeacherError(f"teacher {self.model!r} at {self.url} answered without choices: {response.text[:300]}") from error
        if self.protocol == "prompt_logprobs":
            return _from_prompt_logprobs(choice, len(prompt), completion, self.model)
        return _from_echo(choice, len(prompt), completion, self.model)


def _from_prompt_logprobs(choice: Any, start: int, completion: list[int], name: str) -> list[float]:
    """vLLM's ``prompt_logprobs``: ``[None, {"<id>": {"logprob": ...}}, ...]``, one per prompt token."""
    entries = choice.get("prompt_logprobs") if isinstance(choice, dict) else None
    if not isinstance(entries, list) or len(entries) < start + len(completion):
        got = len(entries) if isinstance(entries, list) else "no"
        raise TeacherError(f"teacher {name!r} returned {got} prompt logprobs for {start + len(completion)} prompt tokens")
    out = []
    for offset, token in enumerate(completion):
        entry = entries[start + offset]
        value = entry.get(str(token)) if isinstance(entry, dict) else None
        logprob = value.get("logprob") if isinstance(value, dict) else None
        if not _finite_logprob(logprob):
            raise TeacherError(f"teacher {name!r} did not score sampled token {token} at completion position {offset}")
        out.append(float(logprob))
    return out


def _from_echo(choice: Any, start: int, completion: list[int], name: str) -> list[float]:
    """OpenAI's ``echo`` + ``logprobs``: ``logprobs.token_logprobs`` over the prompt, then the completion."""
    logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
    values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    if not isinstance(values, list) or len(values) < start + len(completion):
        got = len(values) if isinstance(values, list) else "no"
        raise TeacherError(f"teacher {name!r} echoed {got} token logprobs for {start + len(completion)} prompt tokens")
    out = values[start : start + len(completion)]
    for offset, logprob in enumerate(out):
        if not _finite_logprob(logprob):
            raise TeacherError(f"teacher {name!r} returned logprob {logprob!r} for the sampled token at completion position {offset}")
    return [float(v) for v in out]


def _first(group: BaseExceptionGroup) -> BaseException:
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def _finite_logprob(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and value <= 0.0 and value > float("-inf")


def served_teacher(
    model: Model,
    *,
    model_name: str | None = None,
    context: Context | None = None,
    tokenizer: ChatTokenizer | None = None,
    timeout: float | None = DEFAULT_TEACHER_TIMEOUT,
) -> CompletionsTeacher:
    """A teacher served at ``model``'s endpoint: by default the base model of a trainable one.

    ``model_name``: another served name (``model.get_inference_name(step)`` for a checkpoint).
    With ``context`` this is context distillation (:func:`with_worked_examples`).
    """
    if model.inference_base_url is None:
        raise ConfigError(f"model {model.name!r} has no inference endpoint yet: `await model.register(backend)` first")
    if model_name is None:
        model_name = model.name if isinstance(model, TrainableModel) else model.get_inference_name()
    return CompletionsTeacher(
        model.inference_base_url, model_name, api_key=model.inference_api_key, context=context, tokenizer=tokenizer, timeout=timeout
    )


def with_worked_examples(examples: Sequence[Message]) -> Context:
    """A context that inserts ``examples`` (solved tasks as messages) after the leading system messages."""
    shown = [dict(m) for m in examples]

    def context(messages: list[Message]) -> list[Message]:
        head = 0
        while head < len(messages) and messages[head].get("role") in ("system", "developer"):
            head += 1
        return [*messages[:head], *[dict(m) for m in shown], *messages[head:]]

    return context


def _queries(trajectory: Trajectory, where: str) -> list[tuple[Choice, TeacherQuery]]:
    out = []
    for h, history in enumerate(trajectory.histories()):
        context: list[Message] = []
        for turn, item in enumerate(history.messages_and_choices):
            if not isinstance(item, Choice):
                context.append(item)
                continue
            at = f"{where}, history {h}, turn {turn}"
            if not item.token_ids:
                raise TrajectoryError(f"{at}: a sampled turn without token ids cannot be scored by a teacher (sample from a tracerl-served model)")
            if item.logprobs is None or len(item.logprobs) != len(item.token_ids):
                raise TrajectoryError(f"{at}: the reverse KL needs the student's sampler logprob of every sampled token (request logprobs)")
            query = TeacherQuery(list(context), history.tools, item.prompt_token_ids, list(item.token_ids))
            out.append((item, query))
            context.append(item.message)
    return out


async def add_teacher_advantages(
    groups: Iterable[TrajectoryGroup | Trajectory],
    teacher: Teacher,
    *,
    kl_coef: float = 1.0,
    max_concurrency: int = 8,
) -> dict[str, float]:
    """Score every sampled turn with ``teacher``; write ``A_t = −kl_coef·(logπ_student − logπ_teacher)`` on it.

    The student's logprob is the sampler's (``Choice.logprobs``: on-policy, as tinker-cookbook).
    Each trajectory gets ``metrics["teacher_reverse_kl"]`` (its mean per-token reverse KL).
    Returns ``{"teacher_reverse_kl", "teacher_scored_tokens", "teacher_seconds"}`` over all of
    them.  Any failed call raises (the others are cancelled) and leaves every trajectory as it was.
    """
    if isinstance(kl_coef, bool) or not isinstance(kl_coef, (int, float)) or not kl_coef > 0 or kl_coef == float("inf"):
        raise ConfigError(f"kl_coef must be a positive finite number, got {kl_coef!r}")
    if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
        raise ConfigError(f"max_concurrency must be a positive integer, got {max_concurrency!r}")
    trajectories: list[tuple[str, Trajectory]] = []
    for g, item in enumerate(groups):
        members = item.trajectories if isinstance(item, TrajectoryGroup) else [item]
        for i, trajectory in enumerate(members):
            if not isinstance(trajectory, Trajectory):
                raise TrajectoryError(f"item {g}: expected a TrajectoryGroup or Trajectory, got {type(trajectory).__name__}")
            trajectories.append((f"group {g}, trajectory {i} ({trajectory.id})", trajectory))
    work = [(t, choice, query) for where, t in trajectories for choice, query in _queries(t, where)]
    started = time.monotonic()
    limit = asyncio.Semaphore(max_concurrency)

    async def one(query: TeacherQuery) -> list[float]:
        async with limit:
            scores = await teacher.score(query)
        if len(scores) != len(query.completion_token_ids):
            raise TeacherError(f"the teacher returned {len(scores)} logprobs for {len(query.completion_token_ids)} sampled tokens")
        return scores

    try:
        async with asyncio.TaskGroup() as tasks:  # the first failure cancels the rest
            running = [tasks.create_task(one(query)) for _, _, query in work]
    except BaseExceptionGroup as failures:  # raise the teacher's own error, not a group of them
        raise _first(failures) from None
    teacher_logprobs = [task.result() for task in running]
    per_trajectory: dict[str, list[float]] = {}
    for (trajectory, choice, _), teacher_lp in zip(work, teacher_logprobs):  # every call succeeded: now write
        kl = [s - t for s, t in zip(choice.logprobs or [], teacher_lp)]
        choice.token_advantages = [-kl_coef * value for value in kl]
        per_trajectory.setdefault(trajectory.id, []).extend(kl)
    for _, trajectory in trajectories:
        values = per_trajectory.get(trajectory.id)
        if values:
            trajectory.metrics[REVERSE_KL_METRIC] = sum(values) / len(values)
    every = [v for values in per_trajectory.values() for v in values]
    return {
        REVERSE_KL_METRIC: sum(every) / len(every) if every else 0.0,
        "teacher_scored_tokens": float(len(every)),
        "teacher_seconds": time.monotonic() - started,
    }
