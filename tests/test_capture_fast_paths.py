"""Capture's per-call shortcuts give the answers of the general code they skip.

Each shortcut exists because it runs on every model call or at every rollout end
(``bench/capture_instructions.py`` counts them); each is checked here against the slow path on
inputs that do and do not take it.
"""

from __future__ import annotations

import random

from openai.types.chat import ChatCompletion

from tracerl import SamplingParams
from tracerl import redact as r
from tracerl.integrations import completions, input_delta


def _completion(extra_choice: dict | None = None, extra_top: dict | None = None, logprobs: object = None) -> ChatCompletion:
    choice = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Paris"}, "logprobs": logprobs}
    choice.update(extra_choice or {})
    body = {"id": "c1", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice], **(extra_top or {})}
    return ChatCompletion.model_validate(body)


def _slow_token_ids(completion: object, first: object) -> object:
    """``completions.token_ids`` without its shortcut: the extras, fields and logprobs read one by one."""
    ids = completions.extra_field(first, "token_ids")
    prompt_ids = completions.extra_field(completion, "prompt_token_ids") or completions.extra_field(first, "prompt_token_ids")
    logprobs = completions.logprob_values(completions.field(first, "logprobs"))
    if ids is None and prompt_ids is None and logprobs is None:
        return None
    sampling = SamplingParams.from_field(completions.extra_field(first, "sampling"))
    return (list(prompt_ids) if prompt_ids is not None else None, completions.ints(ids), logprobs, sampling)


def test_token_ids_shortcut_answers_as_the_extras_would() -> None:
    logprobs = {"content": [{"token": "Paris", "logprob": -0.5, "bytes": None, "top_logprobs": []}]}
    cases = [
        _completion(),  # a plain response: the shortcut
        _completion(extra_choice={"token_ids": [5, 6]}),
        _completion(extra_top={"prompt_token_ids": [1, 2, 3]}),
        _completion(extra_choice={"prompt_token_ids": [1, 2]}),
        _completion(extra_choice={"provider_specific_fields": {"token_ids": [9]}}),
        _completion(logprobs=logprobs),
        _completion(extra_choice={"token_ids": [5], "sampling": {"temperature": 0.7, "top_p": 1.0, "top_k": 0}}),
        _completion(extra_choice={"token_ids": [5]}, extra_top={"prompt_token_ids": [1]}, logprobs=logprobs),
    ]
    for completion in cases:
        first = completion.choices[0]
        assert completions.token_ids(completion, first) == _slow_token_ids(completion, first)
    assert completions.token_ids(cases[0], cases[0].choices[0]) is None
    assert completions.token_ids(cases[-2], cases[-2].choices[0]) == (None, [5], None, SamplingParams(temperature=0.7))
    assert completions.token_ids(cases[-1], cases[-1].choices[0]) == ([1], [5], [-0.5], None)
    as_dict = cases[-1].model_dump()  # dicts never take the shortcut
    assert completions.token_ids(as_dict, as_dict["choices"][0]) == ([1], [5], [-0.5], None)


def test_short_texts_find_the_triggers_the_loop_finds() -> None:
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789_-. "
    for _ in range(3000):
        length = rng.randrange(0, 2 * r._SHORT_TEXT)
        text = "".join(rng.choice(alphabet) for _ in range(length))
        if rng.random() < 0.5:
            at = rng.randrange(len(text) + 1)
            text = text[:at] + rng.choice(r._ALL_TRIGGERS) + text[at:]
        loop = any(trigger in text for trigger in r._ALL_TRIGGERS)
        assert r._has_trigger(text) is loop, text


def test_common_prefix_shortcut_counts_as_the_loop() -> None:
    rng = random.Random(1)
    pool = [{"role": "user", "content": str(i)} for i in range(4)]
    for _ in range(2000):
        snapshot = [dict(rng.choice(pool)) for _ in range(rng.randrange(0, 6))]
        messages = [dict(m) if rng.random() < 0.5 else m for m in snapshot[: rng.randrange(0, len(snapshot) + 1)]]
        messages += [rng.choice(pool) for _ in range(rng.randrange(0, 4))]
        expected = 0
        for old, new in zip(snapshot, messages):
            if old != new:
                break
            expected += 1
        assert input_delta._common_prefix(snapshot, messages) == expected


def test_an_older_call_that_shares_more_is_still_the_base() -> None:
    """Recent calls shorter than the prefix found are skipped; a longer, older one is still compared."""
    history = input_delta.InputHistory()
    long = [{"role": "user", "content": str(i)} for i in range(6)]
    history.open("openai", long, 1)
    history.open("openai", long[:2], 2)  # another conversation, newer and shorter
    tail, base = history.open("openai", [*long, {"role": "user", "content": "more"}], 3)
    assert base == (1, 6) and tail == [{"role": "user", "content": "more"}]
    tail, base = history.open("openai", [*long[:2], {"role": "user", "content": "x"}], 4)
    assert base == (3, 2)  # the newest call of those that share the most


def test_a_prompt_repeated_across_histories_is_redacted_in_each() -> None:
    """The memo of clean messages across a trajectory's histories never lets a credential through."""
    from tracerl.integrations.outbound import redact_trajectory
    from tracerl.types import Choice, History, Trajectory

    key = "sk-proj-" + "Zq9" * 12
    clean = {"role": "system", "content": "be brief and precise"}
    dirty = {"role": "user", "content": f"my key is {key}"}
    parts = [{"role": "user", "content": [{"type": "text", "text": f"again {key}"}]}]  # unhashable content
    answer = Choice(message={"role": "assistant", "content": "ok"})
    histories = [History(messages_and_choices=[dict(clean), dict(dirty), *parts, answer]) for _ in range(3)]
    trajectory = Trajectory(
        messages_and_choices=histories[0].messages_and_choices, additional_histories=histories[1:]
    )
    redact_trajectory(trajectory)
    for history in trajectory.histories():
        messages = history.messages()
        assert messages[0] == clean
        assert key not in str(messages) and r.REDACTED in messages[1]["content"]
        assert r.REDACTED in messages[2]["content"][0]["text"]


def test_logprobs_and_ids_read_from_objects_dicts_or_both() -> None:
    """The same values whatever the entries are; an entry without a logprob is an error, never a silent 0."""
    from types import SimpleNamespace

    import pytest

    objects = SimpleNamespace(content=[SimpleNamespace(logprob=-0.25), SimpleNamespace(logprob=-1)])
    dicts = {"content": [{"logprob": -0.25}, {"logprob": -1}]}
    mixed = {"content": [{"logprob": -0.25}, SimpleNamespace(logprob=-1)]}
    for logprobs in (objects, dicts, mixed):
        values = completions.logprob_values(logprobs)
        assert values == [-0.25, -1.0] and all(type(v) is float for v in values)
    assert completions.logprob_values({"content": []}) is None
    with pytest.raises(TypeError):
        completions.logprob_values({"content": [{"logprob": -1}, {"token": "x"}]})
    assert completions.ints((1, True, 3)) == [1, 1, 3] and completions.ints(None) is None


def test_deltas_resolve_alike_in_any_order() -> None:
    """Calls in call order take one lookup each; shuffled, the chain walk gives the same inputs."""
    from tracerl.integrations import convert
    from tracerl.integrations.messages import canonical

    def calls() -> list:
        out = []
        for index in range(6):
            tail = [{"role": "user", "content": f"turn {index}"}]
            base = (index, index) if index else None  # each call continues the previous one's whole input
            out.append(convert.ModelCall(
                span_id=index + 1, start=index, end=index, layer="openai", priority=0, inputs=tail,
                output={"role": "assistant", "content": "ok"}, keys=[canonical(m) for m in tail], base=base,
            ))  # fmt: skip
        return out

    in_order = calls()
    convert._resolve_deltas(in_order, convert._ErrorTally())
    assert [m["content"] for m in in_order[-1].inputs] == [f"turn {i}" for i in range(6)]
    for seed in range(5):
        shuffled = calls()
        random.Random(seed).shuffle(shuffled)
        tally = convert._ErrorTally()
        convert._resolve_deltas(shuffled, tally)
        assert tally.count == 0
        assert sorted((c.span_id, c.inputs, c.keys) for c in shuffled) == sorted((c.span_id, c.inputs, c.keys) for c in in_order)
    orphan = calls()[3:]  # their first base is gone
    tally = convert._ErrorTally()
    convert._resolve_deltas(orphan, tally)
    assert tally.count == 3 and all(c.base is None for c in orphan)  # each one's base input is short of its prefix
