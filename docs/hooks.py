"""mkdocs hook: let mkdocstrings read tracerl's source from this checkout, without importing it.

The import package ``tracerl`` is put together from four folders by setuptools' ``package-dir``
(``core/`` is ``tracerl``, ``integrations/`` is ``tracerl.integrations``, ``ruler/`` and
``mcp_rl/`` likewise), so no folder of the repository is named ``tracerl`` for griffe to find,
and griffe's support for editable installs expects one.  When a build starts this hook lays out
``.docs-src/tracerl/`` (git-ignored) as symlinks into those folders, taking the mapping from
``pyproject.toml``, and ``mkdocs.yml`` points mkdocstrings' ``paths`` there.  So the API
reference is always this checkout's source, read statically: no torch, no installed tracerl.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / ".docs-src"
SKIP = {"__pycache__"}
SPHINX_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|exc|data|obj|const):<code>~?")
"""Docstrings name things with Sphinx roles (``:class:`Choice```); Markdown renders the role as text."""


def package_dirs() -> dict[str, str]:
    """``{"tracerl": "core", "tracerl.integrations": "integrations", ...}`` from pyproject.toml."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["setuptools"]["package-dir"]


def link(target: Path, at: Path) -> None:
    """Point ``at`` to ``target``, replacing what is there in one rename (two builds at once both succeed)."""
    if at.is_symlink() and Path(os.readlink(at)) == target:
        return
    temporary = at.with_name(f".{at.name}.{os.getpid()}")
    temporary.unlink(missing_ok=True)
    temporary.symlink_to(target)
    os.replace(temporary, at)


def lay_out_source_tree() -> Path:
    """Build ``.docs-src/tracerl/``: the top package's folder entry by entry, each subpackage folder whole."""
    mapping = package_dirs()
    (top,) = [name for name in mapping if "." not in name]
    package = TREE / top
    package.mkdir(parents=True, exist_ok=True)
    wanted: dict[str, Path] = {}
    for entry in (ROOT / mapping[top]).iterdir():
        if entry.name not in SKIP:
            wanted[entry.name] = entry
    for name, folder in mapping.items():
        if name == top:
            continue
        parts = name.split(".")[1:]
        if len(parts) != 1 or parts[0] in wanted:
            raise RuntimeError(f"docs/hooks.py cannot map {name!r} -> {folder!r}: extend it for nested package-dirs")
        wanted[parts[0]] = ROOT / folder
    for name, target in wanted.items():
        link(target, package / name)
    for stale in package.iterdir():
        if stale.name not in wanted and not stale.name.startswith("."):
            stale.unlink()
    return TREE


@event_priority(100)  # before mkdocstrings': its handler drops a `paths` entry that does not exist yet
def on_config(config):  # noqa: ANN001, ANN201 - mkdocs' hook signature
    lay_out_source_tree()
    return config


def on_page_content(html: str, **_) -> str:
    """Show ``:class:`~tracerl.X``` of a docstring as the code ``tracerl.X``, without the role."""
    return SPHINX_ROLE.sub("<code>", html)
