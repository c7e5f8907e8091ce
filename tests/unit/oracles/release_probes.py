"""One child in Dynamo 1.0.2's release environment, shared by the probes of two test files.

``test_router_recovery.py`` (a new router's recovery of its worker's tree) and ``test_router_crosstalk.py``
(each worker's own event plane) each started a child of their own in that environment, and each child's first
worker paid the same start-up: SGLang's publisher, whose import is about 11 CPU-s of the child's 13 (the
relays and routers themselves start in under a second). Now each file adds its probe as a named section
(:func:`add`) when pytest imports it, and the ``dynamo_1_0_2_probes`` session fixture (``conftest.py`` beside
this file) runs ONE child with every section, in order (:func:`add`); ``tests/xdist_scopes.py`` keeps the two
files on one worker, so a run of the suite starts one child. Each probe opens and closes its own router paths
(as each did before, two apiece in one process); a section's traceback fails only its own test.

The child is :mod:`section_child` (each section in turn, its stdout and traceback kept apart), with the checkout
first on its path, as ``python -c`` from it had.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import section_child

ROOT = Path(__file__).resolve().parents[3]
#: each probe's own child had 500 s
TIMEOUT_S = 600

#: name -> child code, in the order the child runs them
SECTIONS: dict[str, str] = {}


def add(name: str, code: str, *, first: bool = False) -> None:
    """Run ``code`` in the shared child as section ``name``: its stdout is what :meth:`Probes.section` returns.

    ``first``: before every section added so far (pytest imports the files alphabetically), for a probe whose
    router paths must be the first the child starts, as they were in a child of its own."""
    if first:
        rest = {k: v for k, v in SECTIONS.items() if k != name}
        SECTIONS.clear()
        SECTIONS.update({name: code, **rest})
    else:
        SECTIONS[name] = code


class Probes:
    """The session's one child in the release environment ``(python, env)``, run when a test first asks."""

    def __init__(self, python: str, env: dict[str, str]) -> None:
        self.python, self.env = python, env
        self._run: dict | str | None = None

    def section(self, name: str) -> str:
        """``name``'s stdout in the child; its traceback (or the child's failure) fails the test."""
        if self._run is None:
            self._run = self._start()
        if isinstance(self._run, str):
            raise AssertionError(self._run)
        got = self._run["sections"].get(name)
        assert got is not None, f"the Dynamo 1.0.2 child ran no section {name!r} (ran {sorted(self._run['sections'])})"
        assert got["error"] is None, (f"the Dynamo 1.0.2 child, section {name!r}:\n{got['error'][-2000:]}"
                                      f"\nits stderr ends:\n{self._run['stderr'][-1500:]}")
        return got["out"]

    def _start(self) -> dict | str:
        """Run the child (once: a failure is kept, and raised for each test)."""
        res = subprocess.run([self.python, section_child.SCRIPT, str(ROOT), json.dumps(SECTIONS)], capture_output=True, text=True,
                             env=self.env, timeout=TIMEOUT_S, cwd=ROOT)
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
        if res.returncode != 0 or not lines:
            return f"the Dynamo 1.0.2 child exited {res.returncode}; its stderr ends:\n{res.stderr[-2000:]}"
        return {"sections": json.loads(lines[-1]), "stderr": res.stderr}

