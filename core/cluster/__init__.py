"""Beyond one machine: a router over N replicas; with ``tracerl[ray]`` the replicas as Ray actors
(``ray_replicas``), rollouts as Ray tasks (``ray_rollouts``) and the trainer as a Ray actor
(``ray_backend``); data-parallel steps over torch.distributed ranks kept for the run (``data_parallel``, ``rank_pool``).

Light to import (httpx only); the router's FastAPI app loads when it starts.
"""

from __future__ import annotations

from .pool import Replica, ReplicaPool
from .router import Router
from .routing import GROUP_HEADER, REPLICA_HEADER, group_key

__all__ = ["GROUP_HEADER", "REPLICA_HEADER", "Replica", "ReplicaPool", "Router", "group_key"]
