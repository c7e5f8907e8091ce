"""One child per SGLang release with kvalign's CPU stand-in loaded as in a worker, shared by three test files.

``test_sglang_cpu_standin.py`` (the environment's release: ``sgl_kernel``'s exports and the patches),
``test_sglang_cpu_standin_releases.py`` (each other release: every patch finds its target) and
``test_hicache_cpu_standin.py`` (every release: SGLang's own host pool round trips through the stand-in)
check the stand-in inside SGLang's interpreter, each in a child of its own per release: six children for
three releases, and each paid the same start-up (torch, the stand-in, SGLang's scheduler and memory pools:
10-13 CPU-s apiece). Now each file adds its child code as named sections (:func:`add`) when pytest imports
it, and the ``standin_children`` session fixture (``conftest.py`` beside this file) runs, once per release,
ONE child with that release's sections: those that import what they check (``imports_first``) before the
others, on the fresh interpreter they had before, each group in the order added. ``tests/xdist_scopes.py``
keeps the three files on one worker, so a run of the suite starts one child per release.

The child's environment is each former child's: the stand-in's ``worker_env`` with the release's wheel-cache
directory (if any) and then this checkout first on the path, and the harness's KV-events IPC endpoint set as
in a worker (``test_sglang_cpu_standin_releases.py``'s child set it so the KV-events patch applies too).

The child is :mod:`section_child` (each section in turn, its stdout and traceback kept apart), with this folder
first on its path, as each file's own child script had.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import section_child

ROOT = Path(__file__).resolve().parents[3]
#: the folder the sections import their helpers from (``hicache_pool_child``), first on the child's path
HERE = str(Path(__file__).resolve().parent)
#: the child imports SGLang's scheduler, attention and memory-pool modules; a release from the wheel cache is
#: compiled from source on import (its cache holds no bytecode)
TIMEOUT_S = 600


@dataclass(frozen=True)
class Section:
    """Child code for some releases: ``code(release)`` is run by the release's child."""

    code: Callable[[str], str]
    releases: frozenset[str]
    imports_first: bool


#: name -> section, in the order the test files added them
SECTIONS: dict[str, Section] = {}


def add(name: str, code: str | Callable[[str], str], releases: Iterable[str], *, imports_first: bool) -> None:
    """Run ``code`` (or ``code(release)``) in the child of each of ``releases``, as section ``name``.

    ``imports_first``: the section checks what happens when SGLang's modules are first imported (a patch
    applies then), so it runs before any section that is not."""
    SECTIONS[name] = Section(code if callable(code) else (lambda _release: code), frozenset(releases), imports_first)


def sections_of(release: str) -> dict[str, str]:
    """``release``'s sections, in the order its child runs them."""
    mine = [(name, s) for name, s in SECTIONS.items() if release in s.releases]
    return {name: s.code(release) for name, s in sorted(mine, key=lambda item: not item[1].imports_first)}


def child_env(release_dir: Path | None, kv_events_ipc: Path) -> dict[str, str]:
    """The stand-in's worker environment, with ``release_dir`` (a wheel-cache release) and this checkout first."""
    from kvalign.standins import sglang_cpu as standin

    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", standin.ENABLE_ENV, "SGLANG_USE_CPU_ENGINE")}
    path = os.pathsep.join(str(p) for p in (release_dir, ROOT) if p is not None)
    return {**base, **standin.worker_env(path), standin.KV_EVENTS_IPC_ENV: f"ipc://{kv_events_ipc}"}


class StandinChildren:
    """The session's children, one per release, each run when a test first asks for one of its sections."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self._runs: dict[str, dict[str, dict] | str] = {}

    def section(self, release: str, release_dir: Path | None, name: str) -> str:
        """``name``'s stdout in ``release``'s child; its traceback fails the test, naming the release."""
        if release not in self._runs:
            self._runs[release] = self._run(release, release_dir)
        run = self._runs[release]
        if isinstance(run, str):
            raise RuntimeError(run)
        got = run["sections"].get(name)
        assert got is not None, f"sglang {release}'s stand-in child ran no section {name!r} (ran {sorted(run['sections'])})"
        assert got["error"] is None, (f"sglang {release}'s stand-in child, section {name!r}:\n{got['error'][-2000:]}"
                                      f"\nits stderr ends:\n{run['stderr'][-1500:]}")
        return got["out"]

    def _run(self, release: str, release_dir: Path | None) -> dict | str:
        """Run the child (once: a failure is kept, and raised for each of the release's tests)."""
        stderr = self.tmp / f"sglang-{release}.stderr"
        env = child_env(release_dir, self.tmp / f"kv-{release}.ipc")
        with stderr.open("w") as err:
            proc = subprocess.run([sys.executable, section_child.SCRIPT, str(HERE), json.dumps(sections_of(release))], stdout=subprocess.PIPE,
                                  stderr=err, text=True, timeout=TIMEOUT_S, env=env)
        tail = stderr.read_text(errors="replace")
        if proc.returncode != 0 or not proc.stdout.strip():
            return (f"sglang {release}'s stand-in child exited {proc.returncode}; its stderr ends:\n"
                    f"{tail[-3000:]}")
        return {"sections": json.loads(proc.stdout.strip().splitlines()[-1]), "stderr": tail}

