"""Turn the judge's answer into exactly one score in [0, 1] per trajectory id.

The answer is requested as a JSON schema (``response_format``) where the provider
supports it; either way it is parsed tolerantly (code fences, leading prose, reasoning
blocks, a bare list, numeric strings) and then validated strictly.  Every problem found
is described in one :class:`AnswerProblem` message, which the judge loop sends back as
its corrective re-ask and, if that fails too, puts in the ``JudgeError``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Sequence


class AnswerProblem(ValueError):
    """The judge's answer cannot be turned into valid scores (message says why)."""


@dataclass(frozen=True)
class ParsedScore:
    trajectory_id: str
    score: float
    explanation: str


def response_format(ids: Sequence[str], max_explanation_chars: int | None = None, positional: bool = False) -> dict[str, Any]:
    """OpenAI-style structured-output request for exactly ``len(ids)`` scores (explanations at most
    ``max_explanation_chars`` long when given).

    ``positional``: entry k must carry the k-th id (JSON Schema's ``prefixItems``), so guided
    decoding cannot repeat one id and leave another out — a 135M judge did both under the plain
    ``enum``.  For self-hosted endpoints (vLLM's xgrammar enforces ``prefixItems``); hosted
    providers' strict modes may refuse the keyword, so they get the ``enum`` form."""
    explanation: dict[str, Any] = {"type": "string"}
    if max_explanation_chars is not None:
        explanation["maxLength"] = max_explanation_chars

    def entry(allowed: list[str]) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {
                "trajectory_id": {"type": "string", "enum": allowed},
                "explanation": explanation,
                "score": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["trajectory_id", "explanation", "score"],
            "additionalProperties": False,
        }

    scores: dict[str, Any] = {"type": "array", "minItems": len(ids), "maxItems": len(ids)}
    if positional:
        scores.update(prefixItems=[entry([i]) for i in ids], items=False)
    else:
        scores["items"] = entry(list(ids))
    schema = {
        "type": "object",
        "properties": {"scores": scores},
        "required": ["scores"],
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": "ruler_scores", "strict": True, "schema": schema}}


_FENCE_RE = re.compile(r"```(?:json|JSON)?\s*\n?(.*?)```", re.S)
_THINK_RE = re.compile(r"<think>.*?</think>", re.S | re.I)


def extract_json(text: str | None) -> Any:
    """The first JSON value in ``text`` that looks like an answer (raises AnswerProblem)."""
    if text is None or not text.strip():
        raise AnswerProblem("the answer is empty")
    text = _THINK_RE.sub("", text).strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    found: list[Any] = []
    for block in _FENCE_RE.findall(text):
        try:
            found.append(json.loads(block))
        except json.JSONDecodeError:
            continue
    decoder = json.JSONDecoder()
    for match in re.finditer(r"[\[{]", text):
        try:
            value, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        found.append(value)
    for value in found:
        if (isinstance(value, dict) and "scores" in value) or isinstance(value, list):
            return value
    if found:
        return found[0]
    raise AnswerProblem("the answer is not JSON")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _entries(value: Any) -> list[Any]:
    if isinstance(value, dict) and "scores" in value:
        value = value["scores"]
    elif isinstance(value, dict) and value and all(_is_number(v) for v in value.values()):
        value = [{"trajectory_id": k, "score": v} for k, v in value.items()]  # {"1": 0.3, "2": 0.9}
    if not isinstance(value, list):
        raise AnswerProblem('the answer has no "scores" list')
    return value


def _normalise_id(raw: Any) -> str | None:
    if isinstance(raw, bool) or raw is None:
        return None
    if isinstance(raw, float) and raw.is_integer():
        raw = int(raw)
    text = str(raw).strip()
    text = re.sub(r"^(trajectory[ _-]?)", "", text, flags=re.I)
    return text or None


def _number(raw: Any) -> float | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, (int, float)):
        return float(raw)
    if isinstance(raw, str):
        try:
            return float(raw.strip())
        except ValueError:
            return None
    return None


def parse_answer(text: str | None, ids: Sequence[str]) -> dict[str, ParsedScore]:
    """Validated scores by id; raises :class:`AnswerProblem` listing everything wrong."""
    entries = _entries(extract_json(text))
    problems: list[str] = []
    if len(entries) != len(ids):
        problems.append(f"expected {len(ids)} scores, got {len(entries)}")
    scores: dict[str, ParsedScore] = {}
    unknown: list[str] = []
    duplicate: list[str] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            problems.append(f"entry {i + 1} is not an object")
            continue
        tid = _normalise_id(entry.get("trajectory_id", entry.get("id", entry.get("trajectory"))))
        score = _number(entry.get("score"))
        if tid is None:
            problems.append(f"entry {i + 1} has no trajectory_id")
            continue
        if tid not in ids:
            unknown.append(tid)
            continue
        if tid in scores:
            duplicate.append(tid)
            continue
        if score is None:
            problems.append(f"the score for id {tid} is not a number ({entry.get('score')!r})")
            continue
        if not math.isfinite(score) or not 0.0 <= score <= 1.0:
            problems.append(f"the score for id {tid} is {score}, outside [0, 1]")
            continue
        scores[tid] = ParsedScore(tid, score, str(entry.get("explanation") or entry.get("reason") or ""))
    if unknown:
        problems.append(f"unknown ids {sorted(set(unknown))} (valid ids: {list(ids)})")
    if duplicate:
        problems.append(f"duplicate ids {sorted(set(duplicate))}")
    answered = set(scores) | set(duplicate)
    missing = [tid for tid in ids if tid not in answered and not any(f"id {tid} " in p for p in problems)]
    if missing:
        problems.append(f"missing ids {missing}")
    if problems:
        raise AnswerProblem("; ".join(problems))
    return scores
