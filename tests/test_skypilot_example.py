"""``examples/skypilot/``: the task file parses with SkyPilot's own parser; the laptop script trains through serve.

SkyPilot pins ``click<8.2`` while ``huggingface-hub`` (transformers) needs ``click>=8.4``, so it
cannot share tracerl's backend environment: the parse runs in whichever interpreter has
``sky`` (this one, ``$TRACERL_SKYPILOT_PYTHON``, or ``.venv-skypilot/`` from ``make install-skypilot``)
and is skipped only where none has it.  The laptop script runs against the real ``tracerl serve``
app over loopback HTTP, with a token, a stand-in backend and the scripted OpenAI server.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from capture_fake_server import FakeOpenAIServer, Reply
from test_remote_backend import TOKEN, RecordingBackend, _serve

import tracerl.integrations as ti

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "examples" / "skypilot" / "tracerl-serve.yaml"
sys.path.insert(0, str(ROOT / "examples" / "skypilot"))

PARSE = """
import json, sys
import sky, yaml
task = sky.Task.from_yaml(sys.argv[1])
# what `sky launch --secret TRACERL_SERVE_TOKEN` does with the value from the laptop's environment
with open(sys.argv[1]) as f:
    launched = sky.Task.from_yaml_config(yaml.safe_load(f), secrets_overrides=[("TRACERL_SERVE_TOKEN", "tok")])
resources = sorted(task.resources, key=str)
print(json.dumps({
    "name": task.name, "run": task.run, "setup": task.setup, "workdir": str(task.workdir), "envs": dict(task.envs),
    "secret_refs": [ref.name for ref in task.managed_secret_refs],
    "launched_secrets": sorted(launched.secrets), "launched_envs": sorted(launched.envs),
    "accelerators": sorted(name for r in resources for name in (r.accelerators or {})),
    "ports": sorted({str(p) for r in resources for p in (r.ports or [])}),
}))
"""


def _skypilot_python() -> str | None:
    if importlib.util.find_spec("sky") is not None:
        return sys.executable
    for candidate in (os.environ.get("TRACERL_SKYPILOT_PYTHON"), str(ROOT / ".venv-skypilot" / "bin" / "python")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def test_the_task_file_parses_with_skypilots_own_parser(tmp_path):
    python = _skypilot_python()
    if python is None:
        pytest.skip("skypilot is not installed (make install-skypilot)")
    env = {**os.environ, "HOME": str(tmp_path), "SKYPILOT_DISABLE_USAGE_COLLECTION": "1"}  # no state in the real home
    proc = subprocess.run([python, "-c", PARSE, str(TASK)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    task = json.loads(proc.stdout.strip().splitlines()[-1])
    assert task["name"] == "tracerl-serve"
    assert set(task["accelerators"]) == {"L4", "A10G", "A100", "H100"}
    assert task["ports"] == ["8000"]
    # a secret, not a plain env (hidden from logs); required: resolved from `sky launch --secret`
    assert task["secret_refs"] == ["TRACERL_SERVE_TOKEN"] and "TRACERL_SERVE_TOKEN" not in task["envs"]
    assert task["launched_secrets"] == ["TRACERL_SERVE_TOKEN"] and "TRACERL_SERVE_TOKEN" not in task["launched_envs"]
    assert task["workdir"] == "."
    assert task["envs"]["TRACERL_PORT"] == "8000"
    assert 'pip install -e ".[backend]"' in task["setup"] and "tracerl install-vllm" in task["setup"]
    assert "tracerl serve --host 0.0.0.0" in task["run"] and '--port "$TRACERL_PORT"' in task["run"]


def _answer_some(body: dict) -> Reply:
    """Right for about half of the questions, so groups have reward variance."""
    question = body["messages"][-1]["content"]
    a, b = (int(x) for x in question.removeprefix("What is ").split("?")[0].split(" + "))
    return Reply(content=str(a + b) if (a + b + len(body["messages"])) % 2 else "I do not know")


async def test_the_laptop_script_trains_through_serve_with_the_token():
    import train_remote

    ti.instrument("openai")
    with FakeOpenAIServer(_answer_some) as upstream:
        backend = RecordingBackend(upstream.base_url)
        http, url = _serve(backend, TOKEN)
        try:
            results = await train_remote.train(url, steps=2, group_size=3, groups_per_step=2, token=TOKEN)
        finally:
            http.stop()
    assert [r.step for r in results] == [1, 2]
    assert [len(groups) for groups in backend.trained] == [2, 2]
    for groups in backend.trained:
        for group in groups:
            assert len(group.trajectories) == 3 and not group.exceptions
            for trajectory in group.trajectories:
                [turn] = trajectory.sampled_turns()
                assert turn.token_ids  # token truth came back through serve's /v1 proxy
    assert backend.closed is False  # the laptop's close() ends its client, never the server's backend
