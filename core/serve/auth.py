"""Who may call ``tracerl serve``: a server reachable from the network needs a bearer token.

Binding a non-loopback interface without a token refuses to start (:func:`check_bind`); the
opt-out, ``--insecure-no-auth``, says what it does, and ``--generate-token`` makes a random
token (printed once to stderr) instead.  On loopback a token stays optional: only local
users can connect there.
"""

from __future__ import annotations

import ipaddress
import secrets

from ..errors import ConfigError


class InsecureBindError(ConfigError):
    """``tracerl serve`` was asked to listen beyond loopback without a token (and without the opt-out)."""


def is_loopback(host: str) -> bool:
    """True only for addresses that other machines cannot reach (``127.0.0.0/8``, ``::1``, ``localhost``).

    A host name other than ``localhost`` counts as reachable: it may resolve to any interface.
    """
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None, *, insecure_no_auth: bool = False) -> None:
    """Raise :class:`InsecureBindError` when ``host`` is reachable from the network and nothing guards it."""
    if token or insecure_no_auth or is_loopback(host):
        return
    raise InsecureBindError(
        f"refusing to serve on {host} without a token: anyone who can reach this port could register models, "
        "train, delete checkpoints and use the /v1 proxy. Set TRACERL_SERVE_TOKEN or pass --token, or "
        "--generate-token for a random one (printed once), or --insecure-no-auth if the network is trusted."
    )


def generate_token() -> str:
    """A random bearer token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)
