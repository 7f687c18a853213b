"""Which inference replica answers a request: least-loaded, a group's requests kept together.

Pure bookkeeping, no I/O (the router does the HTTP): each replica's requests in flight and
health, and an affinity table from a group key to the replica that served the group first.

Why affinity: the N rollouts of one GRPO group share their prompt (system message, tools, task),
and every turn of one rollout extends its previous turn.  Kept on one replica, vLLM's prefix
cache (or any KV reuse) computes that prefix once instead of once per replica.  Why not
always: a group pinned to a replica that is far busier than the idlest one waits for nothing,
so past ``max_imbalance`` requests of difference the request goes to the least-loaded replica
(the group stays bound where it was, for its next turns).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable

from ..errors import ConfigError, NoHealthyReplicaError


@dataclass
class Replica:
    """One OpenAI-compatible server (``url`` without ``/v1``) and what the router knows of it."""

    url: str
    in_flight: int = 0
    healthy: bool = True
    served: int = 0
    failures: int = 0
    last_error: str | None = None
    groups: set[str] = field(default_factory=set, repr=False)

    def state(self) -> dict[str, object]:
        return {"url": self.url, "in_flight": self.in_flight, "healthy": self.healthy, "served": self.served,
                "failures": self.failures, "last_error": self.last_error, "groups": len(self.groups)}


class ReplicaPool:
    """The replicas behind one router, and the policy that picks one per request."""

    def __init__(self, urls: Iterable[str], *, max_imbalance: int = 32, max_groups: int = 100_000) -> None:
        self.replicas = [Replica(url.rstrip("/").removesuffix("/v1")) for url in urls]
        if not self.replicas:
            raise ConfigError("a router needs at least one replica URL")
        if len({r.url for r in self.replicas}) != len(self.replicas):
            raise ConfigError(f"replica URLs repeat: {[r.url for r in self.replicas]}")
        if max_imbalance < 0 or max_groups < 1:
            raise ConfigError(f"max_imbalance must be >= 0 and max_groups >= 1, got {max_imbalance}, {max_groups}")
        self.max_imbalance = max_imbalance
        self.max_groups = max_groups
        self._affinity: OrderedDict[str, Replica] = OrderedDict()  # least recently used first

    def acquire(self, key: str | None, *, exclude: Iterable[str] = ()) -> Replica:
        """The replica for a request of group ``key`` (``None``: no group), counted in flight.

        Raises :class:`NoHealthyReplicaError` naming every replica and why it was passed over.
        """
        skipped = set(exclude)
        candidates = [r for r in self.replicas if r.healthy and r.url not in skipped]
        if not candidates:
            raise NoHealthyReplicaError(
                f"no healthy inference replica left of {len(self.replicas)}: "
                + "; ".join(f"{r.url}: {self._why(r, skipped)}" for r in self.replicas),
                replicas={r.url: self._why(r, skipped) for r in self.replicas},
            )
        idlest = min(candidates, key=lambda r: (r.in_flight, r.served))
        chosen = idlest
        if key is not None:
            bound = self._affinity.get(key)
            if bound is not None and bound in candidates:
                self._affinity.move_to_end(key)
                if bound.in_flight - idlest.in_flight <= self.max_imbalance:
                    chosen = bound
            else:
                self._bind(key, idlest)
        chosen.in_flight += 1
        chosen.served += 1
        return chosen

    def release(self, replica: Replica, *, error: str | None = None) -> None:
        """The request on ``replica`` ended; ``error``: the replica failed it (marked unhealthy until a health check passes)."""
        replica.in_flight = max(replica.in_flight - 1, 0)
        if error is not None:
            self.mark(replica, healthy=False, error=error)

    def mark(self, replica: Replica, *, healthy: bool, error: str | None = None) -> None:
        if not healthy:
            replica.failures += 1
            replica.last_error = error
        replica.healthy = healthy

    def replica(self, url: str) -> Replica:
        return next(r for r in self.replicas if r.url == url)

    @property
    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    def _bind(self, key: str, replica: Replica) -> None:
        old = self._affinity.pop(key, None)
        if old is not None:
            old.groups.discard(key)
        self._affinity[key] = replica
        replica.groups.add(key)
        while len(self._affinity) > self.max_groups:  # forget the least recently used group
            evicted, holder = self._affinity.popitem(last=False)
            holder.groups.discard(evicted)

    @staticmethod
    def _why(replica: Replica, skipped: set[str]) -> str:
        if not replica.healthy:
            return f"unhealthy ({replica.last_error or 'failed its health check'})"
        return "already failed this request" if replica.url in skipped else "available"
