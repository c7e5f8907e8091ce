"""The installed pair's ``kvalign matrix`` cell, run once for the tests that read it.

``test_matrix_cells.py`` merges this cell into the table of a whole run with the same options, and
``test_local_build.py`` holds a pull request's build of the installed ai-dynamo to this cell's row (the
release's). Each ran its own ``matrix`` child for it, which checks the pair in a ``check`` child: about
15 CPU-s each, mostly the two start-ups, for the same row. The ``installed_cell`` session fixture
(``tests/unit/conftest.py``) runs it once; ``tests/xdist_scopes.py`` keeps both files on one worker, so
a run of the suite pays it once.

The options are the local build's (it compares three rows, so its examples decide what the ``hash``
row shows); the merge test runs its whole-run half with the same, as a merge requires.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: What an ai-dynamo build can change: ``dynamo.sglang``'s registration (the card) and what the router is
#: told from it; the runtime (hashing, relay, router) comes from ai-dynamo-runtime, pinned by the build's
#: METADATA, so ``hash`` is the same release's either way and shows the row is not card-only by accident.
#: The other properties run the same runtime wheel and cost minutes (nightly matrix).
PROPS = ("card", "hash")
EXAMPLES, INGEST_EXAMPLES = 5, 3


def options(dynamo: str, sglang: str) -> list[str]:
    """``kvalign matrix``'s options for ``dynamo`` x ``sglang`` (a release or a local build) on :data:`PROPS`."""
    return ["--dynamo", dynamo, "--sglang", sglang, "--examples", str(EXAMPLES), "--ingest-examples",
            str(INGEST_EXAMPLES), *(a for p in PROPS for a in ("--property", p))]


def matrix(*argv: str, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    """``kvalign matrix ARGV`` in a child, as a user runs it (this checkout first on the path)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "kvalign", "matrix", *argv], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=cwd)


@dataclass(frozen=True)
class Cell:
    """One ``matrix --cell DYNAMO:SGLANG --json`` run: its id, exit code, stdout (the cell document) and stderr."""

    cell: str
    returncode: int
    stdout: str
    stderr: str

    @property
    def document(self) -> dict[str, Any]:
        return json.loads(self.stdout)


def run_cell(dynamo: str, sglang: str, cwd: Path) -> Cell:
    """The cell ``dynamo:sglang`` of the matrix :func:`options` describe, as a CI cell job runs it."""
    cell = f"{dynamo}:{sglang}"
    res = matrix(*options(dynamo, sglang), "--cell", cell, "--json", cwd=cwd)
    return Cell(cell, res.returncode, res.stdout, res.stderr)
