"""Trajectories → training sequences, token-in/token-out.

Every sampled turn (a :class:`~tracerl.types.Choice`) contributes its exact completion
token ids with weight 1 and its sampler logprobs; prompt, context and tool-result tokens
get weight 0.  Multi-turn histories are built **append-only**: a turn's prompt ids must
extend the sequence built so far.  When they do not (a chat template that rewrites
history, re-renders tool calls, drops reasoning...), the current sequence is closed, a new
one starts, and the break is counted by cause.  Turns without token ids are retokenized
with the chat template only when the caller allows it, and that is counted too.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from ..inference.chat_template import template_messages
from ..errors import TrajectoryError
from ..types import Choice, History, Message, Tool, Trajectory

NAN = float("nan")


class ChatTokenizer(Protocol):
    """The part of a Hugging Face tokenizer we use."""

    eos_token_id: int | None

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def __call__(self, text: str, **kwargs: Any) -> Any: ...


UNFILTERED = (1.0, 0, 1.0)
"""``(temperature, top_k, top_p)`` of the model's own distribution."""


@dataclass
class TrainingSequence:
    """One row of training data: token ids with per-token weight and sampler logprob.

    ``weights[i] == 1`` means token ``i`` was sampled by the policy and is trained on.
    """

    token_ids: list[int]
    weights: list[float]
    old_logprobs: list[float]
    trajectory_index: int
    group_index: int
    advantage: float = 0.0
    token_advantages: list[float] | None = None
    """Per-token advantages added to ``advantage`` (on-policy distillation), 0 on context tokens; None: none."""
    policy_lags: list[int] | None = None
    """Per token, how many steps older than the trained checkpoint its sampling policy was (0 on
    context tokens); None: every turn sampled by the trained checkpoint (``grpo.policy_loss``)."""
    sampling: list[tuple[float, int, float]] | None = None
    """Per token, its turn's sampling ``(temperature, top_k, top_p)`` (``(1, 0, 1)`` on context tokens); None: all that."""
    label: str = ""
    """Which trajectory this row comes from, as errors name it (``"group 0 (task ...), trajectory 1 (id ...)"``)."""

    @property
    def num_trainable(self) -> int:
        return int(sum(1 for w in self.weights if w > 0))


@dataclass
class TokenizeStats:
    """What tokenization had to do; reported in the step metrics."""

    breaks: Counter[str] = field(default_factory=Counter)
    """Sequence breaks (a turn's prompt does not extend the sequence so far), by cause (:func:`_break_cause`)."""
    sampled_tokens: int = 0
    """Completion tokens of the sampled turns seen; each is trained unless counted in ``dropped_tokens``."""
    dropped_tokens: Counter[str] = field(default_factory=Counter)
    """Sampled tokens left untrained, by cause (``truncated``: past ``max_seq_len``)."""
    retokenized_turns: int = 0
    rendered_prompts: int = 0
    logprob_length_mismatches: int = 0
    truncated_sequences: int = 0
    turns_without_sampling: int = 0
    """Sampled turns whose sampling parameters are unknown (trained as sampled at temperature 1)."""

    def metrics(self) -> dict[str, float]:
        out = {f"sequence_breaks/{cause}": float(n) for cause, n in sorted(self.breaks.items())}
        out["sequence_breaks/total"] = float(sum(self.breaks.values()))
        out["sampled_tokens"] = float(self.sampled_tokens)
        out.update({f"dropped_tokens/{cause}": float(n) for cause, n in sorted(self.dropped_tokens.items())})
        out["dropped_tokens/total"] = float(sum(self.dropped_tokens.values()))
        out["retokenized_turns"] = float(self.retokenized_turns)
        out["rendered_prompts"] = float(self.rendered_prompts)
        out["logprob_length_mismatches"] = float(self.logprob_length_mismatches)
        out["truncated_sequences"] = float(self.truncated_sequences)
        out["turns_without_sampling"] = float(self.turns_without_sampling)
        return out


def render_ids(
    tokenizer: ChatTokenizer, messages: Sequence[Message], tools: list[Tool] | None, *, add_generation_prompt: bool
) -> list[int]:
    """Render ``messages`` with the model's own chat template and tokenize the text."""
    text = tokenizer.apply_chat_template(
        template_messages(tokenizer, list(messages)), tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _break_cause(sequence: list[int], weights: list[float], prompt: list[int]) -> str:
    if len(prompt) < len(sequence) and prompt == sequence[: len(prompt)]:
        return "prompt_shorter_than_history"
    limit = min(len(sequence), len(prompt))
    first_diff = next((i for i in range(limit) if sequence[i] != prompt[i]), limit)
    if first_diff < len(sequence) and weights[first_diff] > 0:
        return "sampled_tokens_rerendered"
    return "context_rewritten"


class _SequenceBuilder:
    """Builds the append-only sequences of one history."""

    def __init__(self, trajectory_index: int, group_index: int, stats: TokenizeStats) -> None:
        self.ids: list[int] = []
        self.weights: list[float] = []
        self.logprobs: list[float] = []
        self.advantages: list[float] = []
        self.has_advantages = False
        self.lags: list[int] = []
        self.sampling: list[tuple[float, int, float]] = []
        self.done: list[TrainingSequence] = []
        self.trajectory_index = trajectory_index
        self.group_index = group_index
        self.stats = stats

    def add_turn(
        self,
        prompt: list[int],
        completion: list[int],
        logprobs: list[float] | None,
        advantages: list[float] | None = None,
        lag: int = 0,
        sampling: tuple[float, int, float] = UNFILTERED,
    ) -> None:
        """One sampled turn; a greedy one (temperature 0) joins the sequence as context, untrained."""
        if self.ids and prompt[: len(self.ids)] != self.ids:
            self.stats.breaks[_break_cause(self.ids, self.weights, prompt)] += 1
            self.close()
        start = len(self.ids)
        self.ids.extend(prompt[start:])
        self.weights.extend([0.0] * (len(prompt) - start))
        self.logprobs.extend([NAN] * (len(prompt) - start))
        self.advantages.extend([0.0] * (len(prompt) - start))
        self.lags.extend([0] * (len(prompt) - start))
        self.sampling.extend([UNFILTERED] * (len(prompt) - start))
        if logprobs is not None and len(logprobs) != len(completion):
            self.stats.logprob_length_mismatches += 1
            logprobs = None
        self.stats.sampled_tokens += len(completion)
        greedy = sampling[0] == 0.0
        if greedy:
            self.stats.dropped_tokens["greedy"] += len(completion)
        self.ids.extend(completion)
        self.weights.extend([0.0 if greedy else 1.0] * len(completion))
        self.logprobs.extend(logprobs if logprobs is not None else [NAN] * len(completion))
        self.advantages.extend(advantages if advantages is not None else [0.0] * len(completion))
        self.has_advantages = self.has_advantages or advantages is not None
        self.lags.extend([lag] * len(completion))
        self.sampling.extend([sampling] * len(completion))

    def close(self) -> None:
        if any(w > 0 for w in self.weights):
            self.done.append(
                TrainingSequence(
                    self.ids,
                    self.weights,
                    self.logprobs,
                    self.trajectory_index,
                    self.group_index,
                    token_advantages=self.advantages if self.has_advantages else None,
                    policy_lags=self.lags if any(self.lags) else None,
                    sampling=self.sampling if any(s != UNFILTERED for s in self.sampling) else None,
                )
            )
        self.ids, self.weights, self.logprobs, self.advantages, self.has_advantages, self.lags = [], [], [], [], False, []
        self.sampling = []


def _completion_ids(
    tokenizer: ChatTokenizer,
    choice: Choice,
    context: list[Message],
    tools: list[Tool] | None,
    prompt: list[int],
    where: str,
    allow_retokenize: bool,
    stats: TokenizeStats,
) -> tuple[list[int], list[float] | None]:
    if choice.token_ids is not None:
        return list(choice.token_ids), choice.logprobs
    if not allow_retokenize:
        raise TrajectoryError(
            f"{where}: a sampled assistant turn carries no token ids. Sample from a tracerl-served model "
            "(token ids are requested automatically), or pass allow_retokenize=True to rebuild them from "
            "the chat template (an approximation; it is reported in the step metrics)."
        )
    full = render_ids(tokenizer, [*context, choice.message], tools, add_generation_prompt=False)
    if full[: len(prompt)] != prompt:
        raise TrajectoryError(f"{where}: the chat template renders this turn's prompt differently when retokenizing")
    completion = full[len(prompt) :]
    eos = tokenizer.eos_token_id
    if eos is not None and eos in completion:  # keep the stop token, drop the separator after it
        completion = completion[: len(completion) - completion[::-1].index(eos)]
    stats.retokenized_turns += 1
    return completion, None


def _sampling(choice: Choice, stats: TokenizeStats) -> tuple[float, int, float]:
    """The turn's recorded sampling parameters; unknown ones (another server, a hand-built turn) count
    and train as temperature 1.  Greedy turns (temperature 0) are kept as context and not trained:
    their logprobs belong to no distribution the trainer can compute a ratio against."""
    params = getattr(choice, "sampling", None)
    if params is None:
        stats.turns_without_sampling += 1
        return UNFILTERED
    return (0.0 if params.greedy else float(params.temperature), int(params.top_k), float(params.top_p))


def tokenize_history(
    history: History,
    tokenizer: ChatTokenizer,
    *,
    trajectory_index: int = 0,
    group_index: int = 0,
    allow_retokenize: bool = False,
    stats: TokenizeStats | None = None,
    where: str = "trajectory",
    policy_lag: Callable[[Choice], int] | None = None,
) -> list[TrainingSequence]:
    """Append-only sequences of one history (a new sequence at each prefix break).

    ``policy_lag`` says how many steps old the policy that sampled a turn is (default: 0)."""
    stats = stats if stats is not None else TokenizeStats()
    builder = _SequenceBuilder(trajectory_index, group_index, stats)
    context: list[Message] = []
    for turn, item in enumerate(history.messages_and_choices):
        if not isinstance(item, Choice):
            context.append(item)
            continue
        turn_where = f"{where}, item {turn}"
        prompt = item.prompt_token_ids
        if prompt is None:
            prompt = render_ids(tokenizer, context, history.tools, add_generation_prompt=True)
            stats.rendered_prompts += 1
        completion, logprobs = _completion_ids(
            tokenizer, item, context, history.tools, list(prompt), turn_where, allow_retokenize, stats
        )
        advantages = item.token_advantages
        if advantages is not None and len(advantages) != len(completion):
            raise TrajectoryError(
                f"{turn_where}: {len(advantages)} token advantages for {len(completion)} completion tokens; they must match"
            )
        builder.add_turn(list(prompt), completion, logprobs, advantages, policy_lag(item) if policy_lag else 0, _sampling(item, stats))
        context.append(item.message)
    builder.close()
    return builder.done


def tokenize_trajectory(
    trajectory: Trajectory,
    tokenizer: ChatTokenizer,
    *,
    trajectory_index: int = 0,
    group_index: int = 0,
    allow_retokenize: bool = False,
    stats: TokenizeStats | None = None,
    max_seq_len: int | None = None,
    label: str | None = None,
    policy_lag: Callable[[Choice], int] | None = None,
) -> list[TrainingSequence]:
    """All sequences of a trajectory: its main history and every additional history.

    ``label`` names the trajectory in errors and on each sequence (default: by its indices and id).
    """
    stats = stats if stats is not None else TokenizeStats()
    label = label or f"group {group_index}, trajectory {trajectory_index} ({trajectory.id})"
    sequences: list[TrainingSequence] = []
    for h, history in enumerate(trajectory.histories()):
        where = f"{label}, history {h}"
        sequences += tokenize_history(
            history,
            tokenizer,
            trajectory_index=trajectory_index,
            group_index=group_index,
            allow_retokenize=allow_retokenize,
            stats=stats,
            where=where,
            policy_lag=policy_lag,
        )
    for seq in sequences:
        seq.label = label
    if max_seq_len is not None:
        for seq in sequences:
            if len(seq.token_ids) > max_seq_len:
                stats.truncated_sequences += 1
                stats.dropped_tokens["truncated"] += int(sum(1 for w in seq.weights[max_seq_len:] if w > 0))
                seq.token_ids, seq.weights = seq.token_ids[:max_seq_len], seq.weights[:max_seq_len]
                seq.old_logprobs = seq.old_logprobs[:max_seq_len]
                if seq.token_advantages is not None:
                    seq.token_advantages = seq.token_advantages[:max_seq_len]
                if seq.policy_lags is not None:
                    seq.policy_lags = seq.policy_lags[:max_seq_len]
                if seq.sampling is not None:
                    seq.sampling = seq.sampling[:max_seq_len]
        sequences = [s for s in sequences if s.num_trainable > 0]
    return sequences


