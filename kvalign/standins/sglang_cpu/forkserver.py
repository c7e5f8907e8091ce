"""SGLang's scheduler and detokenizer forked from one pre-imported server instead of spawned.

SGLang starts its children with ``spawn``: each is a fresh interpreter that imports torch,
transformers and SGLang again, 9-10 CPU-s apiece on this machine, and a worker has two of them
(a cluster's start-up CPU is mostly these imports). With ``forkserver`` and SGLang's child modules
in its preload, one server process imports them once and each child is a fork of it: the engine
runs the same code on the same arguments, in children that start with their modules loaded.

What differs is the process tree: the children's parent is the fork server, not the worker. SGLang's
children signal a failure with SIGQUIT to their parent (``parent_process.send_signal``), and the
worker's handler then kills the whole tree; the fork server passes that SIGQUIT on to the worker
(:func:`forward_quit_to_worker`, run by :mod:`.forkserver_preload`), so a failing child still takes
the worker down as under ``spawn``. The children die with the fork server as with the worker
(SGLang's ``PR_SET_PDEATHSIG``), and the fork server exits when the worker does.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from typing import Any

#: "1" in a worker's environment arms :func:`forkserver_children` (:class:`SglangCpuWorkerKind` sets it)
FORKSERVER_ENV = "KVALIGN_SGLANG_FORKSERVER"

#: what the fork server imports before its first fork: the SIGQUIT relay, then the modules of
#: SGLang's children (a DP controller's and a multi-detokenizer router's live in these too)
PRELOAD = ["kvalign.standins.sglang_cpu.forkserver_preload", "sglang.srt.managers.scheduler",
           "sglang.srt.managers.detokenizer_manager"]


class _Multiprocessing:
    """``multiprocessing`` as SGLang's engine module sees it, with ``spawn`` read as ``forkserver``."""

    def __getattr__(self, name: str) -> Any:
        return getattr(multiprocessing, name)

    def set_start_method(self, method: str, force: bool = False) -> None:
        if method == "spawn":
            multiprocessing.set_forkserver_preload(PRELOAD)
            method = "forkserver"
        multiprocessing.set_start_method(method, force=force)


def forkserver_children() -> None:
    """Run after ``sglang.srt.entrypoints.engine`` loads: its ``mp`` becomes :class:`_Multiprocessing`."""
    engine = sys.modules["sglang.srt.entrypoints.engine"]
    if getattr(engine, "mp", None) is not multiprocessing:
        raise RuntimeError("kvalign stand-in: sglang.srt.entrypoints.engine no longer imports multiprocessing as mp")
    engine.mp = _Multiprocessing()


def _relay_quit(signum: int, frame: object) -> None:
    os.kill(os.getppid(), signal.SIGQUIT)


def forward_quit_to_worker() -> None:
    """In the fork server: pass a SIGQUIT (a child's failure report) to its parent, the worker.
    Forked children get SIGQUIT's default action back, as a spawned child has it."""
    signal.signal(signal.SIGQUIT, _relay_quit)
    os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGQUIT, signal.SIG_DFL))
