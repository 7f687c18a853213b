"""Beyond one inference server: a router over N replicas, and the replicas as Ray actors (``tracerl.cluster.ray_replicas``, needs ``tracerl[ray]``).

Light to import (httpx only); the router's FastAPI app loads when it starts.
"""

from __future__ import annotations

from .pool import Replica, ReplicaPool
from .router import GROUP_HEADER, REPLICA_HEADER, Router, group_key

__all__ = ["GROUP_HEADER", "REPLICA_HEADER", "Replica", "ReplicaPool", "Router", "group_key"]
