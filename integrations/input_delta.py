"""Chat inputs as deltas: each model call's span stores only what is new since an earlier call.

Why: an agent resends its whole history on every call, so a ``chat`` span that held its full
input (``gen_ai.input.messages``) made a rollout's capture memory grow with the square of its
turns (100 turns of 1 KB messages: ~5 MB of JSON instead of ~100 KB).  Inside a rollout a
call's input is compared with the inputs of the last few calls of the same hook layer; when it
starts with ``p`` messages of one of them (the usual case: the previous call's input, then the
assistant's answer and the tool results), the span keeps only the tail and points at that call:

- ``gen_ai.input.messages``: the messages after the first ``p`` (JSON, semconv parts);
- ``tracerl.input.base_span_id``: the span id (16 hex digits) of the earlier call;
- ``tracerl.input.prefix_length``: ``p``.

Two readers undo it: the converter (``convert.py``) rebuilds each call's full input from the
rollout's spans, exactly as before; :class:`InputExpander` rebuilds it on the export thread, so
OTLP backends and Langfuse still get each generation's full input (see ``outbound.py``).
Outside a rollout every call holds its full input.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Callable

from . import semconv as sc

RECENT_CALLS = 4
"""Earlier calls (per hook layer, per rollout) a new call's input is compared with."""
EXPANDER_ENTRIES = 2048
"""Chat spans whose full input the exporter remembers, to expand the spans that point at them."""


class InputHistory:
    """The recent inputs of one rollout's model calls (kept as references: O(turns) memory)."""

    def __init__(self) -> None:
        self._recent: dict[str, list[tuple[int, list[Any]]]] = {}
        self._lock = threading.Lock()

    def open(self, layer: str, messages: Any, span_id: int) -> tuple[list[Any], tuple[int, int] | None]:
        """Snapshot ``messages`` for the call whose span will have ``span_id``: its new messages
        (``tail``) and ``(base_span_id, p)`` of the earlier call they continue, or None.

        The snapshot copies only the new messages (the agent appends to its list and may reuse
        dicts); the shared prefix is the earlier call's snapshot, compared item by item.  The
        caller opens the span with this id (no callback: this runs on every model call).
        """
        messages = list(messages)
        with self._lock:
            recent = self._recent.setdefault(layer, [])
            base_id, prefix, base = None, 0, None
            for earlier_id, snapshot in reversed(recent):  # newest first: usually the whole input but one turn
                if len(snapshot) <= prefix:
                    continue  # cannot share more than the prefix found already
                length = _common_prefix(snapshot, messages)
                if length > prefix:
                    base_id, prefix, base = earlier_id, length, snapshot
                    if length == len(messages):
                        break  # nothing can share more
            tail = [dict(m) if type(m) is dict else m for m in messages[prefix:]]
            recent.append((span_id, base[:prefix] + tail if base is not None else tail))
            if len(recent) > RECENT_CALLS:
                del recent[0]
        return tail, (base_id, prefix) if base_id is not None else None


def _common_prefix(snapshot: list[Any], messages: list[Any]) -> int:
    if len(snapshot) <= len(messages) and messages[: len(snapshot)] == snapshot:
        return len(snapshot)  # the usual case, compared in C (identity first, as below)
    length = 0
    for old, new in zip(snapshot, messages):
        if old is not new and old != new:
            break
        length += 1
    return length


def delta_attributes(base: tuple[int, int] | None) -> dict[str, Any]:
    """The attributes that mark a span's input as a delta of ``base`` = (span id, prefix length)."""
    return {} if base is None else {sc.INPUT_BASE_SPAN_ID: f"{base[0]:016x}", sc.INPUT_PREFIX_LENGTH: int(base[1])}


def base_of(attributes: Any) -> tuple[int, int] | None:
    """(base span id, prefix length) of a delta span, else None."""
    base = attributes.get(sc.INPUT_BASE_SPAN_ID)
    return None if base is None else (int(base, 16), int(attributes.get(sc.INPUT_PREFIX_LENGTH) or 0))


class InputExpander:
    """Rebuilds full ``gen_ai.input.messages`` for export; remembers the last :data:`EXPANDER_ENTRIES`
    chat spans' inputs as tuples of per-message JSON strings (shared between the spans of a chain).

    ``clean`` is applied once to each message's JSON (redaction) before it is remembered.
    A rollout emits its calls with each call's base first (``processor.bases_first``); when a
    base was not seen (evicted, or the exporter was attached mid-rollout) the span leaves as a
    delta and ``missing`` counts it.
    """

    def __init__(self, clean: Callable[[str], str], max_entries: int = EXPANDER_ENTRIES) -> None:
        self.clean = clean
        self.max_entries = max_entries
        self.missing = 0
        self._inputs: OrderedDict[tuple[int, int], tuple[str, ...]] = OrderedDict()

    def full_input(self, trace_id: int, span_id: int, attributes: Any) -> str | None:
        """The span's full input as JSON (None when it cannot be rebuilt); remembers it."""
        value = attributes.get(sc.INPUT_MESSAGES)
        if not isinstance(value, str):
            return None
        parts = tuple(self.clean(json.dumps(m, ensure_ascii=False, default=str)) for m in json.loads(value))
        base = base_of(attributes)
        if base is not None:
            known = self._inputs.get((trace_id, base[0]))
            if known is None:
                self.missing += 1
                return None
            self._inputs.move_to_end((trace_id, base[0]))
            parts = known[: base[1]] + parts
        self._inputs[(trace_id, span_id)] = parts
        while len(self._inputs) > self.max_entries:
            self._inputs.popitem(last=False)
        return "[" + ", ".join(parts) + "]"  # what json.dumps(list) writes
