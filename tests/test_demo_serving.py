"""The demo picks its serving path: the merged policy whenever vLLM serves it, else the LoRA."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"


@pytest.fixture(scope="module")
def demo():
    spec = importlib.util.spec_from_file_location("tracerl_demo_serving", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("installed", [True, False])
def test_auto_serves_merged_exactly_when_vllm_is_there(demo, monkeypatch, installed):
    import tracerl.inference.vllm_server as vllm_server

    monkeypatch.setattr(vllm_server, "vllm_python", lambda: Path("/usr/bin/python3") if installed else None)
    assert demo.serves_merged("auto", "auto") is installed
    assert demo.serves_merged("vllm", "auto") is installed
    assert demo.serves_merged("transformers", "auto") is False  # merged serving reloads weights in vLLM only
    assert demo.serves_merged("auto", "lora") is False
    assert demo.serves_merged("vllm", "merged") is True


def test_the_backend_follows_the_choice(demo, monkeypatch, tmp_path):
    import tracerl.inference.vllm_server as vllm_server

    monkeypatch.setattr(vllm_server, "vllm_python", lambda: Path("/usr/bin/python3"))
    monkeypatch.setattr("sys.argv", ["demo.py", "--data", str(tmp_path)])
    assert demo.make_backend(demo.parse_args()).serve_merged is True
    monkeypatch.setattr("sys.argv", ["demo.py", "--data", str(tmp_path), "--serving", "lora"])
    assert demo.make_backend(demo.parse_args()).serve_merged is False
