"""The docs site builds strictly, its API reference names every public name, its code is honest.

``make docs`` builds ``docs/`` with ``mkdocs build --strict`` (a broken link or anchor, a page
left out of the navigation, or an API reference that does not resolve fails it), so the suite
builds it too.  Every fenced Python block of the site's pages and of ``README.md`` either runs
here as it is written, in a fresh interpreter, or is marked ``<!-- not run: REASON -->`` on the
line just before its fence, and then must still compile: a reader can tell which examples are
executed, and why the others are not.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import tracerl

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_LIMIT = 15_000
"""Bytes: the README is the front page; everything longer lives on a site page."""
NOT_RUN = re.compile(r"^\s*<!-- not run: (?P<reason>\S.*?) -->\s*$")
OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*\{?\s*\.?(?P<lang>[\w+-]*)")
PYTHON = {"python", "py", "python3"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    """1-based line of the opening fence."""
    code: str
    reason: str | None
    """Why the block is not run; ``None``: the suite runs it."""

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def fenced_blocks(path: Path) -> list[tuple[int, str, str, str | None]]:
    """``(line, language, code, the not-run marker's reason)`` for every fenced block of ``path``."""
    lines = path.read_text().splitlines()
    blocks = []
    index = 0
    while index < len(lines):
        opened = OPEN.match(lines[index])
        if not opened:
            index += 1
            continue
        indent, fence = opened["indent"], opened["fence"]
        close = next(
            (j for j in range(index + 1, len(lines)) if lines[j].strip().startswith(fence) and not lines[j].strip().strip(fence[0])),
            None,
        )
        assert close is not None, f"{path.relative_to(ROOT)}:{index + 1}: a fence that never closes"
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[index + 1 : close]]
        marker = NOT_RUN.match(lines[index - 1]) if index else None
        blocks.append((index + 1, opened["lang"].lower(), "\n".join(body) + "\n", marker["reason"] if marker else None))
        index = close + 1
    return blocks


def python_blocks() -> list[Block]:
    return [
        Block(path, line, code, reason)
        for path in markdown_files()
        for line, lang, code, reason in fenced_blocks(path)
        if lang in PYTHON
    ]


BLOCKS = python_blocks()
RUN = [block for block in BLOCKS if block.reason is None]


def test_readme_is_a_front_page():
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md is {size:,} bytes; move sections to docs/ pages"


def test_readme_links_into_the_repository_resolve():
    """GitHub renders README's relative links; mkdocs never sees them, so they are checked here."""
    targets = re.findall(r"\]\((?!https?://|#)([^)#\s]+)", README.read_text())
    assert targets, "README links into the docs"
    assert [t for t in targets if not (ROOT / t).exists()] == []


def test_every_public_name_of_tracerl_is_in_the_api_reference():
    """Each name of ``tracerl.__all__`` has a ``::: module.Name`` directive: rendered with its docstring."""
    text = "\n".join(page.read_text() for page in sorted((DOCS / "api").glob("*.md")))
    documented = {path.rsplit(".", 1)[-1] for path in re.findall(r"^::: (tracerl(?:\.\w+)+)\s*$", text, flags=re.M)}
    assert sorted(set(tracerl.__all__) - documented) == []


@pytest.mark.parametrize("package, page", [("tracerl.integrations", "integrations.md"), ("tracerl.ruler", "ruler.md"), ("tracerl.mcp_rl", "mcp_rl.md")])
def test_every_public_name_of_the_other_packages_is_on_its_page(package, page):
    """Rendered there, or named there with a link to where it is rendered (``rollout`` lives under ``tracerl``)."""
    text = (DOCS / "api" / page).read_text()
    rendered = {path.rsplit(".", 1)[-1] for path in re.findall(r"^::: (tracerl(?:\.\w+)+)\s*$", text, flags=re.M)}
    named = set(re.findall(r"`(\w+)`", text))
    assert sorted(set(importlib.import_module(package).__all__) - rendered - named) == []


def test_the_blocks_are_found():
    """The parser is real: the pages hold Python blocks, some run and some marked."""
    assert {block.path for block in BLOCKS} >= {README, DOCS / "getting-started.md", DOCS / "capture.md"}
    assert len(RUN) >= 5 and len(BLOCKS) - len(RUN) >= 5


def test_every_not_run_marker_sits_on_a_python_block():
    """A marker before anything else (prose, a bash block) would mark nothing."""
    marked = {(block.path, block.line - 1) for block in BLOCKS if block.reason is not None}
    stray = []
    for path in markdown_files():
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if "not run:" in line and line.lstrip().startswith("<!--") and (path, number) not in marked:
                stray.append(f"{path.relative_to(ROOT)}:{number}")
    assert stray == []


@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.name)
def test_every_python_block_compiles(block):
    """Marked blocks too: a snippet that is not run must still be Python (top-level ``await`` allowed)."""
    compile(block.code, block.name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


@pytest.mark.parametrize("block", RUN, ids=lambda block: block.name)
def test_unmarked_python_blocks_run(block, tmp_path):
    """As written, in a fresh interpreter, in an empty folder (a run directory lands there, not here)."""
    script = tmp_path / (block.name.replace("/", "_").replace(":", "_line") + ".py")
    script.write_text(block.code)
    env = {**os.environ, "TRACERL_CACHE": str(tmp_path / "cache")}
    ran = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert ran.returncode == 0, f"{block.name} failed:\n{ran.stderr[-4000:]}"


def test_the_site_builds_strictly(tmp_path):
    """``make docs``' build, into a temporary folder: every page, link, anchor and API reference resolves."""
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason="install the docs extra: pip install -e '.[docs]' (make install-dev)")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-6000:]
    api = (site / "api" / "index.html").read_text()
    anchors = {anchor.rsplit(".", 1)[-1] for anchor in re.findall(r'id="(tracerl(?:\.\w+)+)"', api)}
    assert sorted(set(tracerl.__all__) - anchors) == []
    assert (site / "architecture" / "index.html").is_file() and (site / "search" / "search_index.json").is_file()
