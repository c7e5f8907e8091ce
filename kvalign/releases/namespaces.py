"""Old releases run their own code: where each ``dynamo.*`` and ``sglang.*`` module came from.

A per-release environment (:mod:`kvalign.releases.release_env`) lists the release directories first
and the running environment (Dynamo 1.6.1, SGLang 0.5.23) after them. ``dynamo`` is a namespace
package (no ``__init__.py``), so Python's path for it joins every ``dynamo/`` on ``sys.path``: a
subpackage an old release lacks would import from 1.6.1, and a verdict for the old release would
be 1.6.1's. :func:`pin` closes that: the environment's ``.pth`` calls it to give each release
package a path of the release's directories only. :func:`foreign` is the check that it held
(``tests/unit/releases/test_namespaces.py`` runs ``check`` in each release's environment and
asks it of every module that run imported).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

#: The top-level packages a release directory provides: each must import from its release only.
RELEASE_PACKAGES = ("dynamo", "sglang")


def namespace_portions(dirs: Sequence[Path]) -> dict[str, list[str]]:
    """The release packages that are namespace packages in ``dirs`` (a ``dynamo/`` without
    ``__init__.py``): name -> those directories' portions, the only path each may have."""
    found: dict[str, list[str]] = {}
    for d in dirs:
        for name in RELEASE_PACKAGES:
            portion = Path(d) / name
            if portion.is_dir() and not (portion / "__init__.py").exists():
                found.setdefault(name, []).append(str(portion))
    return found


def pin(portions: Mapping[str, Sequence[str]]) -> None:
    """Give each namespace package exactly ``portions[name]`` as its path (called from the ``.pth``).

    A namespace package's ``__path__`` is recomputed from ``sys.path`` on every import of a
    submodule; a plain list is not, so later ``sys.path`` entries (the running environment) can no
    longer supply one of its subpackages."""
    for name, paths in portions.items():
        module = importlib.import_module(name)
        module.__path__ = list(paths)
        if module.__spec__ is not None:
            module.__spec__.submodule_search_locations = list(paths)


def _files(module: ModuleType) -> list[str]:
    """Where a module was loaded from: its file, or a namespace package's path entries."""
    file = getattr(module, "__file__", None)
    if file:
        return [file]
    return [str(p) for p in getattr(module, "__path__", [])]


def foreign(modules: Mapping[str, ModuleType], roots: Mapping[str, Path]) -> list[str]:
    """``"name: path"`` for each module of a package in ``roots`` loaded from outside its root
    (a namespace package whose path reaches outside counts: any subpackage could come from there)."""
    out = []
    for name, module in sorted(modules.items()):
        top = name.partition(".")[0]
        if top not in roots or module is None:
            continue
        root = Path(roots[top]).resolve()
        for file in _files(module):
            path = Path(file).resolve()
            if path != root and root not in path.parents:
                out.append(f"{name}: {file}")
    return out
