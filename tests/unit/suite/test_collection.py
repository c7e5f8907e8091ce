"""Every test module can be collected beside the others: pytest's default (``prepend``) import mode
imports a test file outside a package by its basename, so two ``test_hybrid.py`` in two folders stop
the whole tier's collection ("import file mismatch"), on every xdist worker."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _by_basename(root: Path) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = defaultdict(list)
    for p in sorted(root.rglob("test_*.py")):
        if not (p.parent / "__init__.py").exists():  # a package's modules are imported by their dotted name
            seen[p.name].append(p.relative_to(root).as_posix())
    return seen


def test_no_two_test_modules_share_a_basename():
    assert {name: paths for name, paths in _by_basename(ROOT / "tests").items() if len(paths) > 1} == {}


def test_negative_control_a_second_test_hybrid_is_named(tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "test_hybrid.py").write_text("")
    assert _by_basename(tmp_path) == {"test_hybrid.py": ["a/test_hybrid.py", "b/test_hybrid.py"]}
