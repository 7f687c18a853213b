"""Regenerate ``docs/phoenix_trace.png``: a captured LangGraph rollout as Phoenix shows it.

    .venv/bin/python docs/phoenix_screenshot.py [--out docs/phoenix_trace.png]

Starts a real Phoenix (``tests/phoenix_server.py``; install with ``pip install -e
'.[phoenix]'``) and the scripted model server of the tests on loopback, runs a ReAct
agent inside a rollout with capture and ``export_to_otlp`` on, then takes one
headless-Chromium screenshot of the trace page (Debian's ``chromium``:
``apt-get install chromium``).  Nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
]  # fmt: skip


async def rollout_in(phoenix_url: str) -> str:
    """One captured ReAct rollout exported to Phoenix; returns its trace id."""
    from capture_fake_server import FakeOpenAIServer
    from test_import_otlp import react_agent, script

    import tracerl.integrations as ti

    ti.instrument("openai", "langchain")
    with FakeOpenAIServer(script) as model:
        exporter = ti.export_to_otlp(phoenix_url + "/v1/traces")
        async with ti.rollout(task="add two and three", group="docs") as r:
            await react_agent(model).ainvoke({"messages": [("user", "What is two plus three?")]})
        exporter.force_flush()
        exporter.shutdown()
    assert r.trajectory is not None and r.trajectory.trace_id
    return r.trajectory.trace_id


def screenshot(url: str, out: Path, *, width: int = 1600, height: int = 1280, budget_ms: int = 20_000) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium not found: apt-get install chromium")
    with tempfile.TemporaryDirectory(prefix="tracerl-chromium-") as profile:
        subprocess.run(
            [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
             f"--virtual-time-budget={budget_ms}", f"--screenshot={out}", url],
            check=True, timeout=180, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "phoenix_trace.png")
    args = parser.parse_args()
    from phoenix_server import PhoenixServer

    with PhoenixServer() as phoenix:
        trace_id = asyncio.run(rollout_in(phoenix.url))
        phoenix.spans(trace_id, expected=15)
        screenshot(f"{phoenix.url}/redirects/traces/{trace_id}", args.out.resolve())
    print(args.out)


if __name__ == "__main__":
    main()
