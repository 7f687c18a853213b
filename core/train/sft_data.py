"""SFT data: examples as :class:`Trajectory` objects, and their training sequences.

Every source becomes the same thing, a ``Trajectory`` whose trained assistant turns are
:class:`Choice` objects and whose other messages are context, so SFT and GRPO share one
tokenizer path (:func:`tracerl.train.tokenization.tokenize_trajectory`: the model's own chat
template, tools included, append-only sequences, breaks counted):

* captured trajectories (``tracerl.rollout``, ``gather_trajectory_groups``): sampled turns
  keep their exact token ids; plain assistant messages (context turns, worked examples)
  are trained too, rendered by the template;
* OpenAI chat fine-tuning JSONL (``{"messages": [...], "tools": [...]}``, per-message
  ``"weight": 0|1`` on assistant messages): a weight-0 assistant message is context;
* Trajectory JSONL (what ``tracerl import otlp|langfuse`` and ``trajectories/*.jsonl`` hold).

An assistant message that carries ``"weight": 0`` is context whatever its source.  A bad
record raises :class:`TrajectoryError` naming the file and line.  The module imports no
torch: the client side (``RemoteBackend``, the CLI) loads and checks files before sending.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Literal, Sequence

from ..errors import TrajectoryError
from ..types import Choice, History, Trajectory, TrajectoryGroup
from .tokenization import ChatTokenizer, TokenizeStats, TrainingSequence, tokenize_trajectory

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
SFTItem = Trajectory | TrajectoryGroup | dict[str, Any]
"""What ``train_sft`` takes: trajectories, groups of them, OpenAI chat examples or stored trajectory dicts."""


# -- OpenAI chat fine-tuning format ---------------------------------------------------------------
def _text_content(content: Any, where: str) -> str | None:
    """A message's content as the template wants it: a string (text parts joined) or None."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise TrajectoryError(f"{where}: 'content' must be a string, null or a list of text parts, got {_short(content)}")


def _check_tool_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list) or not calls:
        raise TrajectoryError(f"{where}: 'tool_calls' must be a non-empty list")
    for index, call in enumerate(calls):
        at = f"{where}, tool_calls[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise TrajectoryError(f"{at}: needs 'function': {{'name': ..., 'arguments': ...}}")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                json.loads(arguments)
            except ValueError as error:
                raise TrajectoryError(f"{at}: 'arguments' is not valid JSON ({error})") from None
        elif not isinstance(arguments, dict):
            raise TrajectoryError(f"{at}: 'arguments' must be a JSON string or an object, got {_short(arguments)}")


def _check_tools(tools: Any, where: str) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise TrajectoryError(f"{where}: 'tools' must be a list of tool schemas")
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise TrajectoryError(f"{where}: tools[{index}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")


def openai_example_to_trajectory(record: Any, where: str = "example") -> Trajectory:
    """One OpenAI chat fine-tuning record as a Trajectory (trained assistant turns as ``Choice``).

    Checked: ``messages`` is a non-empty list of messages with known roles; ``weight`` appears
    only on assistant messages and is 0 or 1; an assistant message has content or tool calls,
    whose arguments are valid JSON; ``tools`` are function schemas; at least one assistant
    message is trained.
    """
    if not isinstance(record, dict):
        raise TrajectoryError(f"{where}: expected a JSON object with 'messages', got {type(record).__name__}")
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise TrajectoryError(f"{where}: 'messages' must be a non-empty list of chat messages")
    tools = record.get("tools")
    _check_tools(tools, where)
    items: list[Any] = []
    trained = 0
    for index, message in enumerate(messages):
        at = f"{where}, message {index}"
        if not isinstance(message, dict):
            raise TrajectoryError(f"{at}: expected an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise TrajectoryError(f"{at}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        message = {**message, "content": _text_content(message.get("content"), at)}
        if "weight" in message:
            if role != "assistant":
                raise TrajectoryError(f"{at}: 'weight' is only allowed on assistant messages (role is {role!r})")
            if message["weight"] not in (0, 1) or isinstance(message["weight"], bool):
                raise TrajectoryError(f"{at}: 'weight' must be 0 or 1, got {message['weight']!r}")
        if role == "assistant":
            if message.get("tool_calls") is not None:
                _check_tool_calls(message["tool_calls"], at)
            elif not message.get("content"):
                raise TrajectoryError(f"{at}: an assistant message needs 'content' or 'tool_calls'")
            if message.get("weight", 1) == 1:
                message.pop("weight", None)
                items.append(Choice(message=message))
                trained += 1
                continue
        items.append(message)
    if not trained:
        raise TrajectoryError(f"{where}: no assistant message to train (every one has weight 0, or there is none)")
    try:
        return Trajectory(messages_and_choices=items, tools=tools, metadata={"source": where})
    except TrajectoryError as error:
        raise TrajectoryError(f"{where}: {error}") from error


# -- files ----------------------------------------------------------------------------------------
def record_to_trajectory(record: Any, where: str) -> Trajectory:
    """An OpenAI chat record (``messages``) or a stored Trajectory (``messages_and_choices``)."""
    if isinstance(record, dict) and "messages_and_choices" in record:
        try:
            return Trajectory.from_json_dict(record)
        except TrajectoryError as error:
            raise TrajectoryError(f"{where}: {error}") from error
    return openai_example_to_trajectory(record, where)


def load_sft_file(path: str | os.PathLike[str], *, min_reward: float | None = None) -> list[Trajectory]:
    """Every record of a JSONL file (OpenAI chat examples and/or Trajectory rows) as a Trajectory.

    A line that is not JSON, or a record that cannot be trained, raises :class:`TrajectoryError`
    naming ``path`` and the line number; blank lines are skipped.  ``min_reward`` keeps only
    trajectories whose reward is at least that (:func:`filter_by_reward`).
    """
    path = Path(path)
    trajectories: list[Trajectory] = []
    try:
        handle = open(path, encoding="utf-8")
    except OSError as error:
        raise TrajectoryError(f"cannot read SFT data {path}: {error}") from error
    with handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                record = json.loads(line)
            except ValueError as error:
                raise TrajectoryError(f"{where}: not valid JSON ({error})") from None
            trajectory = record_to_trajectory(record, where)
            trajectory.metadata.setdefault("source", where)
            trajectories.append(trajectory)
    if not trajectories:
        raise TrajectoryError(f"{path} holds no examples")
    return filter_by_reward(trajectories, min_reward) if min_reward is not None else trajectories


def filter_by_reward(items: Iterable[Trajectory | TrajectoryGroup], min_reward: float) -> list[Trajectory]:
    """The trajectories (of groups too) whose reward is ``>= min_reward``: rejection sampling from RL groups."""
    from ..validation import finite_reward

    threshold = finite_reward(min_reward, "min_reward")
    return [t for t in _flatten(items) if t.reward >= threshold]


def _flatten(items: Iterable[Any]) -> list[Any]:
    if isinstance(items, (Trajectory, TrajectoryGroup, dict)):
        items = [items]
    out: list[Any] = []
    for item in items:
        out.extend(item.trajectories if isinstance(item, TrajectoryGroup) else [item])
    return out


def as_sft_examples(items: Iterable[SFTItem] | SFTItem | str | os.PathLike[str]) -> list[Trajectory]:
    """``train_sft``'s input as a list of Trajectories (a path is read with :func:`load_sft_file`)."""
    if isinstance(items, (str, os.PathLike)):
        return load_sft_file(items)
    examples = []
    for index, item in enumerate(_flatten(items)):
        if isinstance(item, Trajectory):
            examples.append(item)
        elif isinstance(item, dict):
            examples.append(record_to_trajectory(item, f"example {index}"))
        else:
            raise TrajectoryError(
                f"example {index}: train_sft takes Trajectories, TrajectoryGroups or OpenAI chat examples, got {type(item).__name__}"
            )
    if not examples:
        raise TrajectoryError("train_sft got no examples")
    return examples


# -- what is trained ------------------------------------------------------------------------------
def _is_trained_context(item: Any) -> bool:
    return isinstance(item, dict) and item.get("role") == "assistant" and item.get("weight", 1) != 0


def _sft_items(items: Sequence[Any], assistant_turns: Literal["all", "last"]) -> list[Any]:
    """Assistant turns to train as Choices (sampled ones keep their token ids), the rest as context."""
    trained = [i for i, item in enumerate(items) if isinstance(item, Choice) or _is_trained_context(item)]
    keep = set(trained[-1:] if assistant_turns == "last" else trained)
    out: list[Any] = []
    for i, item in enumerate(items):
        if i in keep:
            out.append(item if isinstance(item, Choice) else Choice(message={k: v for k, v in item.items() if k != "weight"}))
        else:
            out.append(item.message if isinstance(item, Choice) else item)
    return out


def sft_trajectory(trajectory: Trajectory, assistant_turns: Literal["all", "last"] = "all") -> Trajectory:
    """``trajectory`` with every trained assistant turn a :class:`Choice` (weight-0 ones and,
    with ``assistant_turns="last"``, all but each history's last stay context)."""
    histories = [
        History(messages_and_choices=_sft_items(h.messages_and_choices, assistant_turns), tools=h.tools)
        for h in trajectory.additional_histories
    ]
    return Trajectory(
        messages_and_choices=_sft_items(trajectory.messages_and_choices, assistant_turns),
        tools=trajectory.tools,
        additional_histories=histories,
        reward=trajectory.reward,
        metadata=dict(trajectory.metadata),
        id=trajectory.id,
    )


def describe_example(index: int, trajectory: Trajectory) -> str:
    """How errors name an example: its file line when it came from a file, else its index and id."""
    source = trajectory.metadata.get("source") if isinstance(trajectory.metadata, dict) else None
    return f"example {index} ({source})" if isinstance(source, str) else f"example {index} (id {trajectory.id})"


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def tokenize_examples(
    examples: Sequence[Trajectory],
    tokenizer: ChatTokenizer,
    *,
    assistant_turns: Literal["all", "last"] = "all",
    max_seq_len: int | None = None,
    stats: TokenizeStats | None = None,
    first_index: int = 0,
) -> list[list[TrainingSequence]]:
    """The training sequences of each example, through GRPO's tokenizer path.

    Turns without token ids are rendered by the chat template (``allow_retokenize``: for SFT
    that is the data, not an approximation); sequence ``trajectory_index`` is the example's
    index (``first_index + i``), so normalisation can weigh examples.
    """
    stats = stats if stats is not None else TokenizeStats()
    out = []
    for offset, trajectory in enumerate(examples):
        index = first_index + offset
        out.append(
            tokenize_trajectory(
                sft_trajectory(trajectory, assistant_turns),
                tokenizer,
                trajectory_index=index,
                group_index=0,
                allow_retokenize=True,
                stats=stats,
                max_seq_len=max_seq_len,
                label=describe_example(index, trajectory),
            )
        )
    return out
