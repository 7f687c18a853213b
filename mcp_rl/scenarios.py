"""Practice tasks for an MCP agent, written by an LLM from the server's tool list.

``await generate_scenarios(tools, n, generator_model)`` asks the generator (any LiteLLM
model string, a :class:`~tracerl.ruler.JudgeEndpoint` for an OpenAI-compatible
``base_url``, or a served ``tracerl.Model``; the same client path as RULER) for ``n``
diverse tasks as strict JSON ``{"scenarios": [{"task": str, "difficulty": 1-5}]}``.  It
asks for a JSON schema where the provider supports one, parses tolerantly, drops
duplicates, re-asks once naming what was wrong, then raises :class:`ScenarioError`.
Validated answers are cached on disk by a content hash (``$TRACERL_CACHE/mcp_rl``), and
:func:`save_scenarios` / :func:`load_scenarios` keep a run's scenarios as JSONL.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from tracerl.errors import JudgeError, JudgeTimeoutError, TracerlError
from tracerl.ruler.cache import RulerCache, cache_key, resolve_cache
from tracerl.ruler.client import complete, resolve_judge
from tracerl.ruler.parse import AnswerProblem, extract_json
from tracerl.runs.storage import atomic_write_text
from tracerl.timeouts import within

from .server import McpResource, McpTool

logger = logging.getLogger("tracerl.mcp_rl")

PROMPT_VERSION = "tracerl-mcp-scenarios-v1"


class ScenarioError(TracerlError, ValueError):
    """The generator's answer could not be turned into the requested scenarios."""


@dataclass(frozen=True)
class Scenario:
    """One practice task: what to ask the agent, and how hard the generator thinks it is (1-5).

    ``metadata``: anything a verifier needs (e.g. ``{"answer": "82"}`` for
    :class:`~tracerl.mcp_rl.ExpectedAnswerJudge`); saved with the scenario and copied into
    each attempt's ``trajectory.metadata["scenario_metadata"]``.
    """

    task: str
    difficulty: int = 3
    split: str = "train"
    metadata: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def id(self) -> str:
        return hashlib.sha256(self.task.encode()).hexdigest()[:12]

    def to_json(self) -> dict[str, Any]:
        row = {"id": self.id, "task": self.task, "difficulty": self.difficulty, "split": self.split}
        return {**row, "metadata": dict(self.metadata)} if self.metadata else row

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> "Scenario":
        """The inverse of :meth:`to_json` (``difficulty``, ``split`` and ``metadata`` optional)."""
        metadata = row.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise TypeError(f"metadata must be an object, got {type(metadata).__name__}")
        return cls(
            task=str(row["task"]), difficulty=int(row.get("difficulty", 3)), split=str(row.get("split", "train")), metadata=dict(metadata)
        )

    @classmethod
    def coerce(cls, item: "Scenario | str | dict[str, Any]") -> "Scenario":
        """A :class:`Scenario` from itself, a task string (a train scenario) or a JSON row."""
        if isinstance(item, Scenario):
            return item
        if isinstance(item, str):
            return cls(task=item)
        if isinstance(item, dict):
            return cls.from_json(item)
        raise TypeError(f"a scenario is a Scenario, a task string or a dict, got {type(item).__name__}")


# -- the request -------------------------------------------------------------------------------
SYSTEM_PROMPT = """You write practice tasks for an AI agent that can only act through the tools of one MCP server.

Rules for every task:
- It can be completed with the tools listed below (and the resources, if any); it needs at least one tool call.
- It is written as a user's request, self-contained, with every concrete value the agent needs.
- It does not name the tools or say which tool to call.
- It asks for a short final answer or summary that shows the task was done.
Make the tasks diverse (different tools, inputs and goals) and spread their difficulty from 1 (one obvious call) to 5 (several dependent calls)."""


def response_format(n: int) -> dict[str, Any]:
    """OpenAI-style structured-output request for exactly ``n`` scenarios."""
    item = {
        "type": "object",
        "properties": {"task": {"type": "string"}, "difficulty": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["task", "difficulty"],
        "additionalProperties": False,
    }
    schema = {
        "type": "object",
        "properties": {"scenarios": {"type": "array", "items": item, "minItems": n, "maxItems": n}},
        "required": ["scenarios"],
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": "mcp_scenarios", "strict": True, "schema": schema}}


def build_messages(
    tools: Sequence[McpTool],
    n: int,
    *,
    resources: Sequence[McpResource] = (),
    custom_instructions: str | None = None,
) -> list[dict[str, Any]]:
    listing = json.dumps([t.to_json() for t in tools], indent=1, ensure_ascii=False)
    parts = [f"The server's tools:\n{listing}"]
    if resources:
        parts.append("Its resources:\n" + json.dumps([r.to_json() for r in resources], indent=1, ensure_ascii=False))
    if custom_instructions:
        parts.append(f"Additional instructions:\n{custom_instructions}")
    parts.append(
        f"Write exactly {n} distinct tasks. Answer with JSON only, in this form:\n"
        '{"scenarios": [{"task": "...", "difficulty": 1}, ...]}'
    )
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "\n\n".join(parts)}]


# -- parsing ---------------------------------------------------------------------------------------
def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().casefold()


def dedupe(scenarios: Iterable[Scenario]) -> list[Scenario]:
    """Keep the first of scenarios whose tasks differ only in case and spacing."""
    seen: set[str] = set()
    out = []
    for scenario in scenarios:
        key = _normal(scenario.task)
        if key not in seen:
            seen.add(key)
            out.append(scenario)
    return out


def _difficulty(raw: Any) -> int | None:
    if isinstance(raw, bool):
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None
    return min(5, max(1, round(value))) if value == value else None


def parse_scenarios(text: str | None) -> tuple[list[Scenario], list[str]]:
    """Tolerant parse: the valid, de-duplicated scenarios, and a list of problems seen.

    Accepts code fences, prose around the JSON, a bare list, difficulty as a string or a
    float (rounded and clamped to 1-5), and ``"description"``/``"prompt"`` for ``task``.
    Raises :class:`ScenarioError` when there is no scenario list at all.
    """
    try:
        value = extract_json(text)
    except AnswerProblem as error:
        raise ScenarioError(str(error)) from None
    if isinstance(value, dict):
        value = value.get("scenarios", value.get("tasks"))
    if not isinstance(value, list):
        raise ScenarioError('the answer has no "scenarios" list')
    problems: list[str] = []
    scenarios: list[Scenario] = []
    for index, item in enumerate(value):
        if isinstance(item, str):
            item = {"task": item}
        if not isinstance(item, dict):
            problems.append(f"item {index} is not an object")
            continue
        task = item.get("task", item.get("description", item.get("prompt")))
        if not isinstance(task, str) or not task.strip():
            problems.append(f'item {index} has no "task" text')
            continue
        difficulty = _difficulty(item.get("difficulty", 3))
        if difficulty is None:
            problems.append(f'item {index} has a difficulty that is not a number 1-5: {item.get("difficulty")!r}')
            difficulty = 3
        scenarios.append(Scenario(task=task.strip(), difficulty=difficulty))
    unique = dedupe(scenarios)
    if len(unique) < len(scenarios):
        problems.append(f"{len(scenarios) - len(unique)} tasks were duplicates")
    return unique, problems


# -- the call ----------------------------------------------------------------------------------------
def default_cache_dir() -> Path:
    return Path(os.environ.get("TRACERL_CACHE", Path.home() / ".cache" / "tracerl")) / "mcp_rl"


async def generate_scenarios(
    tools: Sequence[McpTool],
    n: int,
    generator_model: Any,
    *,
    resources: Sequence[McpResource] = (),
    custom_instructions: str | None = None,
    extra_litellm_params: dict[str, Any] | None = None,
    cache: RulerCache | str | os.PathLike[str] | bool | None = True,
) -> list[Scenario]:
    """``n`` distinct scenarios for an agent with ``tools`` (one call, one corrective re-ask at most).

    ``cache``: ``True`` uses ``$TRACERL_CACHE/mcp_rl``, a path another directory,
    ``False`` none.  Raises :class:`ScenarioError` naming the problem when the generator
    does not deliver ``n`` valid distinct tasks, or when the call itself fails.
    """
    if n < 1:
        raise ScenarioError(f"n must be >= 1, got {n}")
    if not tools:
        raise ScenarioError("the MCP server offers no tools: there is nothing to practise")
    target = resolve_judge(generator_model, extra_litellm_params)
    messages = build_messages(tools, n, resources=resources, custom_instructions=custom_instructions)
    store = resolve_cache(cache if cache is not True else RulerCache(default_cache_dir()))
    key = cache_key(target.label, messages, {**target.params, "n": n, "prompt": PROMPT_VERSION})
    if store is not None:
        hit = store.get(key)
        if hit is not None:
            return [Scenario(task=s["task"], difficulty=int(s["difficulty"])) for s in hit["scenarios"]]
    scenarios = await _ask(target, messages, n)
    if store is not None:
        store.put(key, {"generator": target.label, "scenarios": [{"task": s.task, "difficulty": s.difficulty} for s in scenarios]})
    return scenarios


async def _ask(target: Any, messages: list[dict[str, Any]], n: int) -> list[Scenario]:
    collected: list[Scenario] = []
    problem = ""
    for attempt in range(2):
        try:
            answer = await complete(target, messages, response_format(n))
        except JudgeTimeoutError as error:  # a TimeoutError stays one, worded for the generator
            raise JudgeTimeoutError(
                f"the scenario generator {target.label} did not answer {within(target.timeout)} (knob: "
                'generate_scenarios(..., extra_litellm_params={"timeout": seconds}), generator_params= in MCP•RL)'
            ) from error.__cause__
        except JudgeError as error:  # RULER's client names it a judge; here it is the generator
            raise ScenarioError(f"the scenario generator {target.label} failed: {error.__cause__ or error}") from error
        try:
            found, problems = parse_scenarios(answer.content)
        except ScenarioError as error:
            found, problems = [], [str(error)]
        if answer.finish_reason == "length":
            problems.append("the answer was cut off (max_tokens reached)")
        collected = dedupe([*collected, *found])
        if len(collected) >= n:
            return collected[:n]
        problem = f"got {len(collected)} valid distinct tasks, need {n}" + (f" ({'; '.join(problems)})" if problems else "")
        if attempt == 0:
            logger.info("scenario generator %s: %s; asking again", target.label, problem)
            messages = [
                *messages,
                {"role": "assistant", "content": answer.content or ""},
                {
                    "role": "user",
                    "content": f"That answer was not usable: {problem}. Reply again with JSON only, "
                    f'{{"scenarios": [...]}} holding exactly {n} distinct tasks, each with "task" and "difficulty" (1-5).',
                },
            ]
    raise ScenarioError(f"the scenario generator {target.label} did not deliver {n} scenarios after one corrective re-ask: {problem}")


# -- on disk ------------------------------------------------------------------------------------------
def save_scenarios(path: str | os.PathLike[str], scenarios: Iterable[Scenario]) -> Path:
    """Write one JSON object per line (atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(json.dumps(s.to_json(), ensure_ascii=False) + "\n" for s in scenarios))
    return path


def load_scenarios(path: str | os.PathLike[str]) -> list[Scenario]:
    out = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(Scenario.from_json(json.loads(line)))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ScenarioError(f"{path}:{number}: not a scenario row ({error})") from error
    return out
