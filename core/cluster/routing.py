"""Where a request goes: the router's headers and a request's affinity key.

Apart from :mod:`tracerl.cluster.router` so that its HTTP app (:mod:`tracerl.cluster.app`) and a
light agent process (``Model`` sets :data:`GROUP_HEADER`) read them without the router.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

GROUP_HEADER = "x-tracerl-group"
"""Request header naming the rollout group; requests with the same value share a replica."""
REPLICA_HEADER = "x-tracerl-replica"
"""Response header naming the replica that answered (for logs and tests)."""
HOP_BY_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
              "proxy-authorization", "proxy-connection", "accept-encoding", "content-encoding"}
"""Headers of one connection, and those the relay recomputes: never copied across the router."""


def group_key(headers: Any, body: Any) -> str | None:
    """The affinity key of a request: its group header, its ``user``, or its shared prompt's hash."""
    explicit = headers.get(GROUP_HEADER)
    if explicit:
        return f"group:{explicit}"
    if not isinstance(body, dict):
        return None
    user = body.get("user")
    if isinstance(user, str) and user:
        return f"user:{user}"
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        head = []
        for message in messages:
            head.append(message)
            if isinstance(message, dict) and message.get("role") == "user":
                break
        shared: Any = [body.get("model"), head]
    elif isinstance(body.get("prompt"), str):
        shared = [body.get("model"), body["prompt"][:1024]]
    else:
        return None
    digest = hashlib.sha1(json.dumps(shared, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"prompt:{digest}"
