"""Which of a model's policies its inference server keeps serving, and for whom.

After each step the server serves the new policy ``name@step`` and keeps the previous one for
stragglers: a request that asked ``get_inference_name()`` just before the hot-load.  Older
policies are retired (the adapter unloaded, the merged-serving alias dropped) unless a lease
holds them.  A lease is for a group of rollouts that pinned its policy's name when it started
(a LangGraph agent builds its chat model once): its last turn must still find that policy,
however many steps trained meanwhile.  ``PipelineTrainer`` holds one per group it runs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class ServedPolicies:
    """The steps served now and the leases on them; the backend does the loading and unloading."""

    steps: set[int] = field(default_factory=set)
    leases: Counter[int] = field(default_factory=Counter)

    def serve(self, step: int) -> None:
        self.steps.add(step)

    def hold(self, step: int) -> None:
        self.leases[step] += 1

    def release(self, step: int) -> None:
        self.leases[step] -= 1
        if self.leases[step] <= 0:
            del self.leases[step]

    def next_to_retire(self) -> int | None:
        """The oldest served step older than the newest one's predecessor that no lease holds (None: nothing to retire)."""
        if not self.steps:
            return None
        newest = max(self.steps)
        return min((step for step in self.steps if step < newest - 1 and not self.leases[step]), default=None)

    def retire(self, step: int) -> None:
        self.steps.discard(step)
