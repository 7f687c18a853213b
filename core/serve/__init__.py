"""Remote training: ``tracerl serve`` (a ``LocalBackend`` behind HTTP) and ``RemoteBackend``, its client.

``server`` builds the app; ``auth``, ``policy``, ``idempotency`` and ``middleware`` are its
safe defaults (a token, limits on what a caller may train, retried calls answered once,
a body cap and an access log).
"""
