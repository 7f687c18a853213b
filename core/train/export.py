"""A trained policy out of its run directory: a merged Hugging Face folder and a GGUF file.

``tracerl export NAME --project P --out DIR`` (:func:`export_policy`) reads checkpoint ``step``
(default: the newest) of ``{base_path}/{project}/models/{name}/``, folds its LoRA into the base
model's weights (read file by file, never loaded whole) and writes:

- ``DIR/hf/``: the merged policy, ``W + scale · B @ A`` folded into every adapted weight by
  :func:`tracerl.train.merged_weights.write_merged_model` (the same merge ``serve_merged`` hands to
  vLLM), streamed tensor by tensor (no base weight is loaded into memory) into the base model's
  own safetensors layout (its shards and index, tensor names and dtypes), with its ``config.json``,
  ``generation_config.json`` and tokenizer files (the chat template included): a plain model
  folder for ``transformers``, vLLM or any other reader of Hugging Face folders;
- ``DIR/{name}-step{NNNN}-{type}.gguf``: that folder converted by llama.cpp's own converter
  (``convert_hf_to_gguf.py`` with its ``gguf-py``), ``f16`` unless asked otherwise, for
  llama.cpp and Ollama.

The converter is llama.cpp's, not tracerl's: it ships in the source distribution of the PyPI
package ``llama-cpp-python`` (``vendor/llama.cpp/``), which :func:`install_converter`
(``make install-gguf-converter``, ``python -m tracerl.train.export install-converter``)
downloads once, at the pinned :data:`LLAMA_CPP_PYTHON` version, and unpacks into the cache
(``$TRACERL_CACHE`` or ``~/.cache/tracerl``).  It runs in a subprocess of this Python, where
its own ``gguf-py`` comes first on ``sys.path``, so the PyPI ``gguf`` that tracerl imports is
never mixed with it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..base_models import cache_dir, resolve_base_model
from ..errors import CheckpointError, ConfigError
from ..runs.durable import filled_once
from ..runs.storage import RunDir

__all__ = [
    "CONVERTER_MAKE_TARGET",
    "GGUF_TYPES",
    "LLAMA_CPP_PYTHON",
    "ExportResult",
    "converter_script",
    "export_policy",
    "install_converter",
]

LLAMA_CPP_PYTHON = "0.3.36"
"""The ``llama-cpp-python`` sdist whose vendored ``llama.cpp/convert_hf_to_gguf.py`` converts (pinned)."""
SENTENCEPIECE = "sentencepiece>=0.1.98,<0.3"
"""What llama.cpp's converter asks for (``requirements-convert_legacy_llama.txt``)."""
CONVERTER_MAKE_TARGET = "make install-gguf-converter"
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
"""``--outtype`` values of the converter offered here: lossless f32, the usual f16 and bf16, 8-bit q8_0."""
HF_DIR = "hf"
_VENDOR = "vendor/llama.cpp/"
_CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
)  # fmt: skip
CONVERT_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_policy` wrote (``None`` for a format not asked for)."""

    step: int
    base_model: Path
    hf_folder: Path | None
    gguf_file: Path | None


# -- the converter -------------------------------------------------------------------------------
def converter_dir() -> Path:
    return cache_dir() / "gguf-converter" / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"


def converter_script() -> Path | None:
    """llama.cpp's ``convert_hf_to_gguf.py`` in the cache, or None before :func:`install_converter`
    (which also installs the one module it imports that tracerl does not need: ``sentencepiece``)."""
    folder = converter_dir()
    ready = (folder / ".complete").exists() and importlib.util.find_spec("sentencepiece") is not None
    return folder / "convert_hf_to_gguf.py" if ready else None


PIP_TIMEOUT_S = 600.0


def install_converter() -> Path:
    """Download the ``llama-cpp-python`` sdist with pip and unpack llama.cpp's converter into the cache (once).

    The converter imports ``sentencepiece`` for every Llama-family model (before it looks for a
    ``tokenizer.model``), so that is pip-installed into this environment when missing."""
    if importlib.util.find_spec("sentencepiece") is None:
        _pip("install", "--quiet", SENTENCEPIECE, what=f"install {SENTENCEPIECE} (llama.cpp's converter imports it)")
    def fill(tmp: Path) -> str:
        with tempfile.TemporaryDirectory(dir=tmp.parent, prefix=".download-") as download:
            _unpack_converter(_download_sdist(Path(download)), tmp)
        return f"llama-cpp-python=={LLAMA_CPP_PYTHON}\n"

    return filled_once(converter_dir(), fill) / "convert_hf_to_gguf.py"


def _download_sdist(folder: Path) -> Path:
    what = f"download llama-cpp-python=={LLAMA_CPP_PYTHON}'s source distribution (it holds llama.cpp's GGUF converter)"
    sdist = f"llama-cpp-python=={LLAMA_CPP_PYTHON}"
    # `--no-binary :all:` would also build pip's build tools from source (minutes); the sdist is the same
    _pip("download", "--quiet", "--no-deps", "--no-binary", "llama-cpp-python", sdist, "--dest", str(folder), what=what)
    sdists = sorted(folder.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        raise ConfigError(f"could not {what}: pip wrote no llama_cpp_python-*.tar.gz into {folder}")
    return sdists[0]


def _pip(*args: str, what: str) -> None:
    try:
        done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=False, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"could not {what} with pip: no answer within {PIP_TIMEOUT_S:.0f} s (is PyPI reachable?)") from None
    if done.returncode != 0:
        raise ConfigError(f"could not {what} with pip (is PyPI reachable?): exit {done.returncode}: {_tail(done.stderr or done.stdout)}")


def _unpack_converter(sdist: Path, target: Path) -> None:
    """Extract ``vendor/llama.cpp/``'s converter, its ``conversion`` package, ``gguf-py`` and licence."""
    with tarfile.open(sdist) as archive:
        members = []
        for member in archive.getmembers():
            _, _, inside = member.name.partition("/")  # llama_cpp_python-X.Y.Z/...
            if not inside.startswith(_VENDOR):
                continue
            relative = inside[len(_VENDOR) :]
            if any(relative == name or (name.endswith("/") and relative.startswith(name)) for name in _CONVERTER_FILES):
                member.name = relative
                members.append(member)
        archive.extractall(target, members=members, filter="data")
    if not (target / "convert_hf_to_gguf.py").exists() or not (target / "gguf-py" / "gguf").is_dir():
        raise ConfigError(f"{sdist.name} has no vendor/llama.cpp/convert_hf_to_gguf.py with its gguf-py: a changed layout?")


def convert_to_gguf(hf_folder: Path, gguf_file: Path, gguf_type: str = "f16", *, model_name: str | None = None) -> Path:
    """Run llama.cpp's converter on ``hf_folder``; write ``gguf_file`` of ``gguf_type`` (one of :data:`GGUF_TYPES`)."""
    if gguf_type not in GGUF_TYPES:
        raise ConfigError(f"GGUF type {gguf_type!r} is not one of {', '.join(GGUF_TYPES)}")
    script = _require_converter()
    command = [sys.executable, str(script), str(hf_folder), "--outfile", str(gguf_file), "--outtype", gguf_type]
    if model_name:
        command += ["--model-name", model_name]
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # its own gguf-py, never the PyPI gguf
    env["HF_HUB_OFFLINE"] = "1"  # a local folder: nothing to fetch
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=CONVERT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as error:
        raise ConfigError(f"llama.cpp's converter ran past {CONVERT_TIMEOUT_S:.0f} s on {hf_folder}") from error
    if done.returncode != 0 or not gguf_file.exists():
        raise ConfigError(f"llama.cpp's converter failed on {hf_folder} (exit {done.returncode}): {_tail(done.stderr or done.stdout)}")
    return gguf_file


def _require_converter() -> Path:
    script = converter_script()
    if script is None:
        raise ConfigError(
            f"llama.cpp's GGUF converter is not installed: run `{CONVERTER_MAKE_TARGET}` (or `python -m tracerl.train.export "
            f"install-converter`), which downloads llama-cpp-python=={LLAMA_CPP_PYTHON}'s source distribution from PyPI once"
        )
    return script


def _tail(text: str, lines: int = 8) -> str:
    return " | ".join(line for line in text.strip().splitlines()[-lines:]) or "(no output)"


# -- the merged folder ---------------------------------------------------------------------------
def checkpoint_to_export(run_dir: RunDir, step: int | None) -> tuple[int, Path]:
    """The step and folder of the checkpoint to export; unknown runs and steps are a ``CheckpointError``."""
    if not run_dir.root.is_dir():
        raise CheckpointError(f"no model {run_dir.project}/{run_dir.name}: {run_dir.root} does not exist (`tracerl models` lists them)")
    steps = run_dir.checkpoint_steps()
    if not steps:
        raise CheckpointError(f"model {run_dir.project}/{run_dir.name} has no checkpoint in {run_dir.checkpoints}: nothing to export")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise CheckpointError(f"model {run_dir.project}/{run_dir.name} has no checkpoint of step {step}; its steps: {_steps_text(steps)}")
    return step, run_dir.checkpoint_path(step)


def _steps_text(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 12 else f"{', '.join(map(str, steps[:5]))}, ..., {', '.join(map(str, steps[-5:]))}"


def write_hf_folder(checkpoint: Path, model_path: Path, target: Path) -> Path:
    """The base model at ``model_path`` with the LoRA of ``checkpoint`` folded in, as a model folder at ``target``.

    No base weight is loaded: the model is built on the meta device (its module names, as
    transformers loads them, and the adapter's layout), the adapter's factors are read from
    ``checkpoint``, and :func:`write_merged_model` streams the base's own files."""
    import torch
    from peft import PeftModel
    from peft.utils import load_peft_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from .merged_weights import write_merged_model

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    policy = PeftModel.from_pretrained(base, str(checkpoint), low_cpu_mem_usage=True).eval()
    write_merged_model(policy, model_path, target, adapter_weights=load_peft_weights(str(checkpoint), device="cpu"))
    for name in _TOKENIZER_FILES:
        if (model_path / name).is_file():
            shutil.copy2(model_path / name, target / name)
    return target


# -- both ----------------------------------------------------------------------------------------
def export_policy(
    base_path: str | os.PathLike[str],
    project: str,
    name: str,
    out: str | os.PathLike[str],
    *,
    step: int | None = None,
    hf: bool = True,
    gguf: bool = True,
    gguf_type: str = "f16",
    force: bool = False,
) -> ExportResult:
    """Write checkpoint ``step`` (default: the newest) of ``project/name`` as ``out/hf/`` and/or a GGUF in ``out``.

    What exists already is refused (``ConfigError``) unless ``force``, which replaces those
    paths only.  The GGUF needs the converter (:func:`install_converter`); it is checked before
    anything is loaded."""
    if not (hf or gguf):
        raise ConfigError("nothing to export: ask for the Hugging Face folder, the GGUF file or both")
    if gguf_type not in GGUF_TYPES:
        raise ConfigError(f"GGUF type {gguf_type!r} is not one of {', '.join(GGUF_TYPES)}")
    run_dir = RunDir(base_path, project, name)
    step, checkpoint = checkpoint_to_export(run_dir, step)
    out = Path(out)
    hf_folder = out / HF_DIR if hf else None
    gguf_file = out / f"{name}-step{step:04d}-{gguf_type}.gguf" if gguf else None
    existing = [p for p in (hf_folder, gguf_file) if p is not None and (p.exists() or p.is_symlink())]
    if existing and not force:
        raise ConfigError(f"{', '.join(map(str, existing))} already exist{'s' if len(existing) == 1 else ''}: pass --force to replace")
    if gguf:
        _require_converter()  # before any model is loaded
    info = run_dir.read_model_info() or {}
    if "base_model" not in info:
        raise CheckpointError(f"{run_dir.model_info_path} is missing or names no base_model: which model was trained is unknown")
    model_path = resolve_base_model(info["base_model"])
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".export-") as work:
        merged = write_hf_folder(checkpoint, model_path, Path(work) / HF_DIR)
        if gguf_file is not None:
            partial = Path(work) / gguf_file.name
            convert_to_gguf(merged, partial, gguf_type, model_name=f"{name}-step{step:04d}")
            _replace(partial, gguf_file)
        if hf_folder is not None:
            _replace(merged, hf_folder)
    return ExportResult(step=step, base_model=model_path, hf_folder=hf_folder, gguf_file=gguf_file)


def _replace(source: Path, target: Path) -> None:
    """Move ``source`` onto ``target``, replacing what is there (``source`` lies under ``target``'s folder: a rename)."""
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
    else:
        with contextlib.suppress(FileNotFoundError):
            target.unlink()
    os.replace(source, target)


def main(argv: list[str] | None = None) -> int:
    """``python -m tracerl.train.export install-converter``: what ``make install-gguf-converter`` runs."""
    args = sys.argv[1:] if argv is None else argv
    if args != ["install-converter"]:
        print("usage: python -m tracerl.train.export install-converter", file=sys.stderr)
        return 2
    try:
        print(install_converter())
    except ConfigError as error:
        print(f"tracerl: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
