"""tracerl's vLLM servers decode structured outputs as compact JSON (no free whitespace).

Why: under vLLM's default grammar a small model may emit whitespace between JSON tokens until
``max_tokens`` (seen with SmolLM2-135M as a RULER judge: newlines after ``"score":``, the answer
never closes).  The flag is checked here against the installed vLLM's own argument parser and
config validation (skipped where the runtime venv is absent); ``bench/ruler_agreement.py`` measures
its effect on real judge answers.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tracerl.inference.vllm_server import COMPACT_STRUCTURED_OUTPUTS, VLLMServer, vllm_python


def flag_value(command: list[str]) -> dict[str, object]:
    return json.loads(command[command.index("--structured-outputs-config") + 1])


def test_servers_ask_vllm_for_compact_json() -> None:
    command = VLLMServer("/models/m", python="/usr/bin/python3").command(8000)
    assert flag_value(command) == {"backend": "xgrammar", "disable_any_whitespace": True}


def test_extra_args_that_configure_structured_outputs_win() -> None:
    mine = ("--structured-outputs-config", '{"backend": "guidance"}')
    command = VLLMServer("/models/m", python="/usr/bin/python3", extra_args=mine).command(8000)
    assert command.count("--structured-outputs-config") == 1 and flag_value(command) == {"backend": "guidance"}
    dotted = VLLMServer("/models/m", python="/usr/bin/python3", extra_args=("--structured-outputs-config.backend=guidance",))
    assert "--structured-outputs-config" not in dotted.command(8000)


def test_the_installed_vllm_accepts_the_flag() -> None:
    python = vllm_python()
    if python is None:
        pytest.skip("the vLLM runtime venv is not installed")
    script = (
        "import json, sys\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "from vllm.engine.arg_utils import AsyncEngineArgs\n"
        "args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])\n"
        "config = AsyncEngineArgs.from_cli_args(args).structured_outputs_config\n"
        "print(json.dumps({'backend': config.backend, 'disable_any_whitespace': config.disable_any_whitespace}))\n"
    )
    argv = ["--model", "/models/m", "--structured-outputs-config", json.dumps(COMPACT_STRUCTURED_OUTPUTS)]
    done = subprocess.run([str(python), "-c", script, *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == COMPACT_STRUCTURED_OUTPUTS
