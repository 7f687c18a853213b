"""Capture uses other libraries through their public APIs only, and builds each record in one place.

Read from the source (AST), over every module of ``tracerl.integrations``:

- no ``obj._name`` unless ``_name`` is defined in that same module (``self._x``, a module-level
  ``_x``, a ``def _x``): an OpenTelemetry SDK tracer's ``_span_limits``, a client's
  ``_client``, a Langfuse processor's ``_should_export_span`` would all be caught, read or written;
- no ``getattr`` / ``setattr`` / ``hasattr`` / ``delattr`` with a ``_name`` string;
- no ``from library import _name``;
- one ``ModelCall`` builder (``convert.new_model_call``).

Dunder names (``__init__``, ``__pydantic_extra__``) are public protocol, not private.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CAPTURE = sorted((ROOT / "integrations").rglob("*.py"))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_here(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def private_access(source: str) -> list[str]:
    """Each use of another object's private name in ``source``: ``line: what``."""
    tree = ast.parse(source)
    ours = _defined_here(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in ours:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr", "hasattr", "delattr"):
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                if _private(node.args[1].value):
                    found.append(f"{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names if _private(a.name)]
    return found


@pytest.mark.parametrize("path", CAPTURE, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_attribute_of_another_library(path):
    assert private_access(path.read_text()) == []


def test_the_checker_catches_what_capture_once_did():
    once = '''
limit = tracer._span_limits.max_span_attributes
sampled = getattr(sampler, "_local_parent_sampled", None)
processor._should_export_span = lambda span: True
client = getattr(completions, "_client", None)
from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY
'''
    assert sorted(line.split(": ")[0] for line in private_access(once)) == ["2", "3", "4", "5", "6"]
    mine = '''
class Box:
    def __init__(self):
        self._items = []
def _helper(box):
    return box._items, _helper.__name__
'''
    assert private_access(mine) == []


def test_one_model_call_builder():
    builders = []
    for path in CAPTURE:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "ModelCall":
                builders.append(path.name)
    assert builders == ["convert.py"]
