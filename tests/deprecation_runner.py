"""Run one example as ``__main__`` with deprecation warnings turned into errors, the way a
user running it on current LangGraph / LangChain would want to hear about them.

    python tests/deprecation_runner.py examples/langgraph_agent.py --base-url URL

Errors: a ``DeprecationWarning`` / ``PendingDeprecationWarning`` attributed to the example or to
tracerl's own modules (a deprecated API *we* call), and LangChain's and LangGraph's own
deprecation classes (``LangChainDeprecationWarning``, ``LangGraphDeprecationWarning`` and its
``LangGraphDeprecatedSinceV10``...) wherever they are raised.  Third-party libraries' other
deprecation warnings about their own internals are theirs, and stay warnings.  ``--help``
(argparse's ``SystemExit(0)``) counts as success: it imports the example and its modules.
"""

from __future__ import annotations

import runpy
import sys
import warnings
from pathlib import Path

OUR_MODULES = r"(__main__|tracerl(\..*)?|langgraph_learns(_graph)?)$"


def error_on_deprecations() -> None:
    warnings.simplefilter("default")
    for category in (DeprecationWarning, PendingDeprecationWarning):
        warnings.filterwarnings("error", category=category, module=OUR_MODULES)
    try:
        from langchain_core._api.deprecation import LangChainDeprecationWarning, LangChainPendingDeprecationWarning

        warnings.filterwarnings("error", category=LangChainDeprecationWarning)
        warnings.filterwarnings("error", category=LangChainPendingDeprecationWarning)
    except ImportError:
        pass
    try:
        from langgraph.warnings import LangGraphDeprecationWarning

        warnings.filterwarnings("error", category=LangGraphDeprecationWarning)
    except ImportError:
        pass


def main() -> None:
    path = Path(sys.argv[1]).resolve()
    sys.argv = [str(path), *sys.argv[2:]]
    sys.path.insert(0, str(path.parent))
    error_on_deprecations()
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as done:
        if done.code not in (0, None):
            raise


if __name__ == "__main__":
    main()
