"""HTTP plumbing shared by tracerl's servers and clients.

``http_server``: OpenAI-style errors, bearer auth and an in-process uvicorn thread;
``untraced``: apps that never trace themselves into the user's OpenTelemetry provider;
``http_pool``: connection pools that stay cheap at a thousand concurrent requests.
"""
