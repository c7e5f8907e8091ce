"""kvalign's layers hold: ``lint-imports`` keeps the contracts in ``pyproject.toml``, and no import
statement anywhere in the package (module level, inside a function, under ``TYPE_CHECKING``)
closes a cycle.

Each check has a negative control: the same run on a copy of the package with one deliberate
upward import (``lint-imports``) or one two-module cycle (the cycle finder) must fail, naming it.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the package under ``root`` with the project's contracts."""
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} is missing: scripts/setup.sh installs import-linter with kvalign's test extras")
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", str(ROOT / "pyproject.toml")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


def test_lint_imports_keeps_every_contract() -> None:
    proc = _lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


def test_negative_control_an_upward_import_breaks_the_layers_contract(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "kvalign", tmp_path / "kvalign", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "kvalign" / "model" / "upward.py").write_text(
        '"""A deliberate upward import (the model reaching for the check engine)."""\n\n'
        "def run() -> None:\n    from kvalign.verify.runner import check  # noqa: F401\n")
    proc = _lint_imports(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "kvalign's layers import downwards only BROKEN" in proc.stdout
    assert "kvalign.model.upward -> kvalign.verify.runner.check" in proc.stdout


def _imports(path: Path, module: str, package: bool) -> Iterator[str]:
    """Every ``kvalign`` module that ``path`` names in any import statement, wherever it stands."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")[: len(module.split(".")) - node.level + (1 if package else 0)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (a name that is not a module counts as its module)."""
    top = package_dir.name
    modules: dict[str, Path] = {}
    for path in package_dir.rglob("*.py"):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if "site" in parts:  # the stand-in's sitecustomize tree is loaded by path, never imported as kvalign.*
            continue
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for target in _imports(path, name, path.name == "__init__.py"):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target.startswith(top) and target != name and not name.startswith(f"{target}."):
                targets.add(target)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle in ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_in_kvalign() -> None:
    graph = import_graph(ROOT / "kvalign")
    assert len(graph) > 90 and any(graph.values())  # the walk saw the package, not an empty tree
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_negative_control_a_cycle_through_type_checking_and_a_function_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "kvalign"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "one.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvalign.two import Two\n")
    (pkg / "two.py").write_text("def f():\n    from .a import one\n    return one\n")
    assert find_cycle(import_graph(pkg)) in (["kvalign.a.one", "kvalign.two", "kvalign.a.one"],
                                             ["kvalign.two", "kvalign.a.one", "kvalign.two"])
