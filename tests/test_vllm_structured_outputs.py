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
from pathlib import Path

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


def test_the_installed_vllm_accepts_the_flag(tmp_path: Path) -> None:
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
    # an existing local folder: vLLM resolves any other name as a hub repo id (no network here)
    argv = ["--model", str(tmp_path), "--structured-outputs-config", json.dumps(COMPACT_STRUCTURED_OUTPUTS)]
    done = subprocess.run([str(python), "-c", script, *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == COMPACT_STRUCTURED_OUTPUTS


def test_the_installed_grammar_engine_holds_a_small_judge_to_ruler_s_schema() -> None:
    """RULER's schema for a self-hosted judge, compiled by the runtime's xgrammar the way vLLM does
    with tracerl's flag: the right answer passes; the answers a 135M judge gave without it (free
    whitespace, one id twice and one missing, an explanation past the bound) cannot be decoded."""
    python = vllm_python()
    if python is None:
        pytest.skip("the vLLM runtime venv is not installed")
    from tracerl.ruler.client import EXPLANATION_CHARS
    from tracerl.ruler.parse import response_format

    schema = response_format(["1", "2", "3"], EXPLANATION_CHARS, positional=True)["json_schema"]["schema"]
    good = {"scores": [{"trajectory_id": i, "explanation": "fine", "score": 0.5} for i in ("1", "2", "3")]}
    duplicate = {"scores": [{**good["scores"][0]}, {**good["scores"][0]}, good["scores"][1]]}
    long = {"scores": [{**good["scores"][0], "explanation": "x" * (EXPLANATION_CHARS + 1)}, *good["scores"][1:]]}
    compact = {"separators": (",", ":")}
    answers = {
        "good": json.dumps(good, **compact), "spaced": json.dumps(good, indent=2), "duplicate": json.dumps(duplicate, **compact),
        "long": json.dumps(long, **compact),
    }  # fmt: skip
    script = (
        "import json, sys\n"
        "import xgrammar\n"
        "from xgrammar.testing import _is_grammar_accept_string\n"
        "schema, answers, config = json.loads(sys.stdin.read())\n"
        "separators = (',', ':') if config['disable_any_whitespace'] else None\n"  # as vLLM's xgrammar backend does
        "grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=not config['disable_any_whitespace'], separators=separators)\n"
        "print(json.dumps({name: _is_grammar_accept_string(grammar, text) for name, text in answers.items()}))\n"
    )
    done = subprocess.run(
        [str(python), "-c", script], input=json.dumps([schema, answers, COMPACT_STRUCTURED_OUTPUTS]),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"good": True, "spaced": False, "duplicate": False, "long": False}
