"""``python -m tracerl.cluster --replica URL [--replica URL ...]``: run the router standalone."""

from .router import main

main()
