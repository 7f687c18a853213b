"""The converter's indexed dedupe and conversation chains give what the plain scans gave.

The scans below are the converter's earlier code, kept as the reference: on thousands of random
rollouts (shared and missing response ids, overlapping times, repeated outputs and inputs, mixed
layers) the indexed versions must keep the same calls, merge the same twins and build the same
chains, in the same order.
"""

from __future__ import annotations

import copy
import random

from tracerl.integrations.convert import ModelCall, _chains, _dedupe, _same_call


def _reference_dedupe(calls):
    kept, duplicates = [], 0
    for call in sorted(calls, key=lambda c: c.priority):
        twin = next((k for k in kept if _same_call(k, call)), None)
        if twin is None:
            kept.append(call)
            continue
        duplicates += 1
        twin.duplicates += 1
        twin.tools = twin.tools or call.tools
        twin.response_id = twin.response_id or call.response_id
        twin.finish_reason = twin.finish_reason or call.finish_reason
        twin.alias_span_ids.append(call.span_id)
    return kept, duplicates


def _reference_chains(calls):
    chains, expected_of = [], []
    for call in calls:
        best, best_length = -1, -1
        for index, expected in enumerate(expected_of):
            if len(expected) > best_length and call.keys[: len(expected)] == expected:
                best, best_length = index, len(expected)
        if best < 0:
            chains.append([call])
            expected_of.append(call.expected())
        else:
            chains[best].append(call)
            expected_of[best] = call.expected()
    return chains


def _random_calls(rng: random.Random) -> list[ModelCall]:
    texts = ["a", "b", "c"]
    calls = []
    for span_id in range(1, rng.randint(1, 14)):
        inputs = [{"role": rng.choice(["user", "assistant", "tool"]), "content": rng.choice(texts), "tool_call_id": "t"}
                  for _ in range(rng.randint(0, 3))]  # fmt: skip
        if calls and rng.random() < 0.6:  # a continuation of an earlier call, as an agent sends it
            earlier = rng.choice(calls)
            inputs = [*earlier.inputs, earlier.output, *inputs[:1]]
        output = {"role": "assistant", "content": rng.choice(texts)}
        start = rng.randint(0, 20)
        call = ModelCall(
            span_id=span_id, start=start, end=start + rng.randint(0, 6), layer="x", priority=rng.randint(0, 3),
            inputs=inputs, output=output, finish_reason=rng.choice([None, "stop"]),
            tools=rng.choice([None, [{"n": span_id}]]), response_id=rng.choice([None, None, "r1", "r2", "r3"]),
        )  # fmt: skip
        from tracerl.integrations.messages import canonical

        call.keys = [canonical(m) for m in inputs]
        calls.append(call)
    return calls


def _summary(kept, duplicates):
    return duplicates, [(c.span_id, c.duplicates, c.response_id, c.finish_reason, c.tools, c.alias_span_ids) for c in kept]


def test_indexed_dedupe_and_chains_match_the_scans():
    rng = random.Random(7)
    merged = joined = 0
    for _ in range(3000):
        calls = _random_calls(rng)
        twin = copy.deepcopy(calls)
        kept, duplicates = _dedupe(calls)
        expected = _reference_dedupe(twin)
        assert _summary(kept, duplicates) == _summary(*expected)
        merged += duplicates
        ordered = sorted(kept, key=lambda c: (c.start, c.end))
        reference = sorted(expected[0], key=lambda c: (c.start, c.end))
        chains = [[c.span_id for c in chain] for chain in _chains(ordered)]
        assert chains == [[c.span_id for c in chain] for chain in _reference_chains(reference)]
        joined += sum(len(chain) - 1 for chain in chains)
    assert merged > 1000 and joined > 1000  # the random rollouts do exercise the twin and chain rules
