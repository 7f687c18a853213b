"""How a server reads its model's sampled turns into OpenAI messages, in the model family's format.

Both servers sample token ids; what a client gets is a message: ``content``, ``tool_calls`` and,
where the family reasons, ``reasoning_content``.  :class:`TurnReader` is that step, once per served
model.  Its settings default to what the model's chat template renders (the same probes the
trainer's rendering uses, :mod:`.chat_template`), so Qwen3, Llama 3, Mistral and gpt-oss need no
setting; a user can still name them (``TrainableModel(tool_call_parser=..., reasoning_parser=...)``).

- ``tool_call_parser``: ``"auto"``, one of :data:`~.tool_formats.FORMATS`, or ``None`` (tool calls
  stay text).  ``"auto"`` falls back to ``"hermes"`` for a template that renders no tool calls,
  which is what tracerl's servers always parsed.
- ``reasoning_parser``: ``"auto"`` (split ``<think>`` off where the template writes reasoning back),
  ``"think"`` or ``None``.  gpt-oss's harmony format carries its reasoning in its own channel, so it is
  always split there.

A reply with neither tool calls nor reasoning keeps its text exactly as sampled (special tokens
skipped), so a model without either (the embedded SmolLM2) answers as it always did.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..errors import ConfigError
from .chat_template import renders_reasoning
from .tool_formats import FORMATS, THINK_BLOCK, Format, detect_format, parse_turn

ReasoningParser = Literal["think"]


def check_parsers(tool_call_parser: Any, reasoning_parser: Any) -> None:
    """A ``ConfigError`` naming the values allowed, for a parser setting that is none of them."""
    if tool_call_parser not in ("auto", None, *FORMATS):
        raise ConfigError(f"tool_call_parser must be 'auto', None or one of {', '.join(FORMATS)}; got {tool_call_parser!r}")
    if reasoning_parser not in ("auto", "think", None):
        raise ConfigError(f"reasoning_parser must be 'auto', 'think' or None; got {reasoning_parser!r}")


@dataclass(frozen=True)
class TurnReader:
    """A served model's sampled turns as OpenAI messages (see the module docstring)."""

    tokenizer: Any
    tool_call_format: Format | None
    reasoning: bool
    end_ids: frozenset[int] = frozenset()
    """Tokens that end a turn (the model's eos ids): dropped before a turn is read."""

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: Any,
        *,
        tool_call_parser: Format | Literal["auto"] | None = "auto",
        reasoning_parser: ReasoningParser | Literal["auto"] | None = "auto",
        end_ids: set[int] | frozenset[int] = frozenset(),
    ) -> TurnReader:
        """The reader for ``tokenizer``'s template; a parser the template contradicts is a ``ConfigError``."""
        check_parsers(tool_call_parser, reasoning_parser)
        rendered = detect_format(tokenizer)
        if tool_call_parser == "auto":
            tool_call_parser = rendered or "hermes"
        elif tool_call_parser is not None and rendered is not None and rendered != tool_call_parser:
            raise ConfigError(
                f"tool_call_parser={tool_call_parser!r}, but this model's chat template writes tool calls as "
                f"{rendered!r}: the model would be trained on calls it is never shown as it wrote them. Use "
                f"tool_call_parser={rendered!r} (the default 'auto' picks it), or a chat_template that renders {tool_call_parser!r}"
            )
        if reasoning_parser == "auto":
            reasoning = tool_call_parser == "harmony" or renders_reasoning(tokenizer)
        else:
            reasoning = reasoning_parser == "think" or tool_call_parser == "harmony"
        return cls(tokenizer, tool_call_parser, reasoning, frozenset(end_ids))

    @classmethod
    def for_model(cls, folder: str | Path, **parsers: Any) -> TurnReader:
        """The reader for the model folder ``folder`` (its tokenizer; its eos ids from its configs)."""
        from transformers import AutoTokenizer, GenerationConfig

        tokenizer = AutoTokenizer.from_pretrained(folder)
        end_ids = {tokenizer.eos_token_id}
        try:
            eos = GenerationConfig.from_pretrained(folder).eos_token_id
        except OSError:  # no generation_config.json: the tokenizer's eos only
            eos = None
        end_ids.update(eos if isinstance(eos, list) else [eos])
        return cls.for_tokenizer(tokenizer, end_ids={int(t) for t in end_ids if t is not None}, **parsers)

    @property
    def settings(self) -> dict[str, Any]:
        """What this reader does, for logs and ``/v1/models``-style reports."""
        return {"tool_call_parser": self.tool_call_format, "reasoning": self.reasoning}

    def message(self, token_ids: list[int], text: str, *, parse_tools: bool) -> dict[str, Any]:
        """The assistant message of a turn that sampled ``token_ids`` (``text``: them decoded without
        special tokens, as the client saw them until now); whether it called tools, in ``tool_calls``."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        fmt = self.tool_call_format
        if fmt == "harmony" or (parse_tools and fmt in ("llama3", "mistral")):
            ids = list(token_ids)
            while ids and ids[-1] in self.end_ids:
                ids.pop()
            turn = parse_turn(self.tokenizer.decode(ids, skip_special_tokens=False), fmt, reasoning=self.reasoning)
            if fmt == "harmony":
                message["content"] = turn.content if (turn.content or turn.reasoning_content or turn.tool_calls) else text
        elif parse_tools and fmt == "hermes":
            turn = parse_turn(text, "hermes", reasoning=self.reasoning)  # hermes' markers survive decoding: the text is the turn
        else:
            think = THINK_BLOCK.match(text) if self.reasoning else None
            if think:
                message["content"] = text[think.end() :] or None
                message["reasoning_content"] = think.group(1).strip()
            return message
        if turn.reasoning_content is not None:
            message["reasoning_content"] = turn.reasoning_content
            message["content"] = turn.content
        if parse_tools and turn.tool_calls:
            message["content"] = turn.content
            message["tool_calls"] = turn.tool_calls
        return message
