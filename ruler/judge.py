"""RULER's judging loop: render once, show the group in shuffled order(s), parse, re-ask once.

:func:`judge_candidates` is the engine behind :func:`ruler` (message lists) and
:class:`tracerl.ruler.RulerJudge` (trajectory groups).  Per group: identical
trajectories are collapsed, the rest rendered once, shown to the judge in
``num_orders`` seeded orders (concurrently), each answer validated, a bad answer
corrected once, and the scores mapped back to the input order and averaged.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from tracerl.errors import ConfigError, JudgeError
from tracerl.types import History, Trajectory

from .cache import RulerCache, cache_key, resolve_cache
from .client import JudgeTarget, complete, resolve_judge
from .orders import judge_orders
from .parse import AnswerProblem, ParsedScore, parse_answer, response_format
from .render import Candidate, candidate_key, render_group, user_prompt
from .rubric import DEFAULT_RUBRIC, rubric_version, system_prompt
from .types import RulerScores, TrajectoryScore

CORRECTIVE_PROMPT = (
    "Your answer could not be used: {problem}. Answer again with only the JSON object "
    '{{"scores": [...]}} holding exactly {n} entries, one for each trajectory id {ids}, '
    "each with a score between 0 and 1."
)


@dataclass
class _Stats:
    requests: int = 0
    cache_hits: int = 0
    retries: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    cost_known: bool = True

    def add_call(self, completion: Any) -> None:
        self.requests += 1
        self.prompt_tokens += completion.prompt_tokens
        self.completion_tokens += completion.completion_tokens
        if completion.cost_usd is None:
            self.cost_known = False
        else:
            self.cost_usd += completion.cost_usd


def candidate_from(item: Any) -> Candidate:
    """A message list (dicts, sampled choices, SDK messages) or a Trajectory → Candidate."""
    if isinstance(item, Trajectory):
        return Candidate(
            messages=item.messages(),
            additional_histories=[h.messages() for h in item.additional_histories],
            tools=item.tools,
        )
    return Candidate(messages=History(messages_and_choices=list(item)).messages())


def describe_group(candidates: Sequence[Candidate], name: str | None) -> str:
    """A name for errors: the given one, else a content hash and the task.

    The task is the last user message the trajectories share (worked examples shown before the
    real task come earlier), or the first user message when they share none."""
    if name:
        return f"group {name!r}"
    digest = hashlib.sha256(json.dumps([c.messages for c in candidates], default=str).encode()).hexdigest()[:8]
    shared = _shared_prefix([c.messages for c in candidates])
    users = [m for m in shared if m.get("role") == "user"] or [
        m for c in candidates[:1] for m in c.messages if m.get("role") == "user"
    ][:1]
    task = str(users[-1].get("content", ""))[:60] if users else ""
    return f"group {digest} ({len(candidates)} trajectories" + (f", task {task!r})" if task else ")")


def _shared_prefix(message_lists: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    shared: list[dict[str, Any]] = []
    for messages in zip(*message_lists):
        if any(m != messages[0] for m in messages[1:]):
            break
        shared.append(messages[0])
    return shared


def _corrective(problem: AnswerProblem, ids: list[str]) -> str:
    return CORRECTIVE_PROMPT.format(problem=problem, n=len(ids), ids=", ".join(f'"{i}"' for i in ids))


def _parse(completion: Any, ids: list[str]) -> dict[str, ParsedScore]:
    try:
        return parse_answer(completion.content, ids)
    except AnswerProblem as problem:
        if completion.finish_reason == "length":  # say so: the fix is a larger max_tokens, not a better judge
            raise AnswerProblem(f"{problem} (the answer was cut off at max_tokens)") from problem
        raise


async def _call(
    target: JudgeTarget, messages: list[dict[str, Any]], schema: dict[str, Any], stats: _Stats, group: str
) -> Any:
    try:
        completion = await complete(target, messages, schema)
    except JudgeError as error:  # same type (a JudgeTimeoutError stays a TimeoutError), naming the group
        raise type(error)(f"RULER could not score {group}: {error}") from error.__cause__ or error
    stats.add_call(completion)
    return completion


def _from_cache(entry: dict[str, Any] | None, ids: list[str]) -> dict[str, ParsedScore] | None:
    """A cached answer, re-validated (a damaged or foreign entry is a miss, not an error)."""
    if entry is None:
        return None
    try:
        return parse_answer(json.dumps({"scores": entry["scores"]}), ids)
    except (AnswerProblem, KeyError, TypeError):
        return None


async def _judge_once(
    target: JudgeTarget,
    messages: list[dict[str, Any]],
    ids: list[str],
    *,
    cache: RulerCache | None,
    occurrence: int,
    stats: _Stats,
    group: str,
    debug: bool,
) -> dict[str, ParsedScore]:
    """Scores by position id for one order: from the cache, or the judge plus one re-ask."""
    shape: dict[str, Any] = {"structured": target.structured}
    if target.max_explanation_chars is not None:  # another schema, another answer (hosted judges' keys unchanged)
        shape["max_explanation_chars"] = target.max_explanation_chars
    if target.positional_ids:
        shape["positional_ids"] = True
    key = cache_key(target.label, messages, {**target.params, **shape}, occurrence)
    if cache is not None and (hit := _from_cache(cache.get(key), ids)) is not None:
        stats.cache_hits += 1
        return hit
    schema = response_format(ids, target.max_explanation_chars, target.positional_ids)
    first = await _call(target, messages, schema, stats, group)
    if debug:
        prompt = messages[-1]["content"]
        print(f"[ruler] {group}\n--- prompt ---\n{prompt}\n--- answer ---\n{first.content}", file=sys.stderr)
    try:
        scores = _parse(first, ids)
    except AnswerProblem as problem:
        stats.retries += 1
        retry = [
            *messages,
            {"role": "assistant", "content": first.content or ""},
            {"role": "user", "content": _corrective(problem, ids)},
        ]
        second = await _call(target, retry, schema, stats, group)
        if debug:
            print(f"[ruler] corrective answer ({problem}):\n{second.content}", file=sys.stderr)
        try:
            scores = _parse(second, ids)
        except AnswerProblem as again:
            raise JudgeError(
                f"RULER judge {target.label} gave no valid scores for {group} after one corrective retry: "
                f"{again} (first answer: {problem}); last answer starts with {(second.content or '')[:200]!r}"
            ) from again
    if cache is not None:
        cache.put(key, {"scores": [vars(s) for s in scores.values()]})
    return scores


async def judge_candidates(
    candidates: Sequence[Candidate],
    ids: Sequence[str],
    judge_model: Any,
    *,
    rubric: str = DEFAULT_RUBRIC,
    tools: list[dict[str, Any]] | None = None,
    extra_litellm_params: dict[str, Any] | None = None,
    debug: bool = False,
    num_orders: int = 1,
    cache: Any = True,
    seed: int | None = None,
    group_name: str | None = None,
) -> RulerScores:
    """Score ``candidates`` relative to each other; one :class:`TrajectoryScore` each, ids from ``ids``."""
    if not isinstance(num_orders, int) or num_orders < 1:
        raise ConfigError(f"num_orders must be an int >= 1, got {num_orders!r}")
    if not candidates:
        return RulerScores([], {})
    group = describe_group(candidates, group_name)
    keys = [candidate_key(c) for c in candidates]
    unique_keys = list(dict.fromkeys(keys))  # identical trajectories are judged once
    unique = [candidates[keys.index(k)] for k in unique_keys]
    rendered = render_group(unique, tools)
    target = resolve_judge(judge_model, extra_litellm_params)
    system = system_prompt(rubric)
    # orders derive from the content (and seed): an identical call shows identical orders, so it hits the cache
    content = json.dumps([system, rendered.context, rendered.tools, rendered.bodies, seed])
    orders = judge_orders(len(unique), num_orders, int(hashlib.sha256(content.encode()).hexdigest()[:16], 16))
    stats = _Stats()
    store = resolve_cache(cache)
    position_ids = [str(p) for p in range(1, len(unique) + 1)]
    seen: dict[tuple[int, ...], int] = {}
    tasks = []
    for order in orders:
        occurrence = seen.get(tuple(order), 0)  # a repeated order is another sample, not a cache hit
        seen[tuple(order)] = occurrence + 1
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user_prompt(rendered, order)}]
        call = _judge_once(target, messages, position_ids, cache=store, occurrence=occurrence, stats=stats, group=group,
                           debug=debug)
        tasks.append(asyncio.ensure_future(call))
    try:
        answers = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:  # one order failed: stop paying for the others
            task.cancel()
        raise
    per_unique: list[list[ParsedScore]] = [[] for _ in unique]
    for order, answer in zip(orders, answers):
        for position, index in enumerate(order, start=1):
            per_unique[index].append(answer[str(position)])
    out = [_score(str(tid), per_unique[unique_keys.index(key)], rubric, target.label) for tid, key in zip(ids, keys)]
    return RulerScores(out, _metrics(stats, out, num_orders, len(unique)))


def _score(trajectory_id: str, verdicts: list[ParsedScore], rubric: str, judge: str) -> TrajectoryScore:
    values = tuple(v.score for v in verdicts)
    return TrajectoryScore(
        trajectory_id=trajectory_id,
        score=statistics.fmean(values),
        explanation=verdicts[0].explanation,
        rubric_version=rubric_version(rubric),
        judge=judge,
        scores_by_order=values,
    )


def _metrics(stats: _Stats, scores: list[TrajectoryScore], num_orders: int, n_unique: int) -> dict[str, float]:
    spreads = [s.order_spread for s in scores]
    metrics = {
        "ruler_judge_requests": float(stats.requests),
        "ruler_cache_hits": float(stats.cache_hits),
        "ruler_corrective_retries": float(stats.retries),
        "ruler_judge_prompt_tokens": float(stats.prompt_tokens),
        "ruler_judge_completion_tokens": float(stats.completion_tokens),
        "ruler_num_orders": float(num_orders),
        "ruler_unique_trajectories": float(n_unique),
        "ruler_order_spread": statistics.fmean(spreads),
        "ruler_order_spread_max": max(spreads),
    }
    if stats.cost_known:
        metrics["ruler_judge_cost_usd"] = stats.cost_usd
    return metrics


async def ruler(
    message_lists: Sequence[Sequence[Any] | Trajectory],
    judge_model: Any,
    *,
    rubric: str = DEFAULT_RUBRIC,
    tools: list[dict[str, Any]] | None = None,
    extra_litellm_params: dict[str, Any] | None = None,
    debug: bool = False,
    num_orders: int = 1,
    cache: RulerCache | str | bool | None = True,
    seed: int | None = None,
    group_name: str | None = None,
) -> RulerScores:
    """Score N conversations of the same task relative to each other, in one judge call per order.

    ``message_lists``: one message list per trajectory (OpenAI message dicts, sampled
    choices allowed) or :class:`tracerl.Trajectory` objects (additional histories and
    tools included).  ``judge_model``: a LiteLLM model string, a
    :class:`~tracerl.ruler.JudgeEndpoint` or a ``tracerl.Model``.  ``extra_litellm_params``:
    passed to ``litellm.acompletion`` (``api_base``, ``temperature``, ``max_tokens``,
    ``timeout``…; ``response_format=None`` stops RULER asking for a JSON schema).  ``tools``: the tools on
    offer (shown once).  ``num_orders``: how many orders to show the group in and
    average over (position-bias cancelling).  ``cache``: ``True`` (default directory),
    a directory or :class:`RulerCache`, or ``False``.  ``seed`` varies the orders (by
    default they derive from the content, so an identical call hits the cache).

    Returns a :class:`RulerScores` list of :class:`TrajectoryScore` with ids ``"1"``…``"N"``
    in input order; its ``metrics`` hold judge tokens, cost, cache hits and order spread.
    Raises :class:`tracerl.JudgeError` when the judge's answer stays invalid after one
    corrective retry, or the judge cannot be reached.
    """
    candidates = [candidate_from(item) for item in message_lists]
    return await judge_candidates(
        candidates,
        [str(i) for i in range(1, len(candidates) + 1)],
        judge_model,
        rubric=rubric,
        tools=tools,
        extra_litellm_params=extra_litellm_params,
        debug=debug,
        num_orders=num_orders,
        cache=cache,
        seed=seed,
        group_name=group_name,
    )
