"""A process that must not outlive its parent: Linux's parent-death signal, armed from inside the child.

kvalign forks children that hold ports, memory and pipes: the live layer's process groups
(:mod:`kvalign.live.cluster.processes`), the fork server of SGLang's children in the CPU stand-in
(:mod:`kvalign.standins.sglang_cpu.forkserver`) and the vLLM oracle's fork server
(:mod:`kvalign.oracles.vllm_forkserver`). A parent killed outright runs no clean-up, so each child asks the
kernel for SIGKILL when its parent dies. The signal is armed after the fork: a parent that died in between is
seen by the caller (:func:`die_with_parent`'s result), which then exits as the signal would have made it.
"""

from __future__ import annotations

import ctypes  # at import, never in a forked child: it may run between fork and exec (a Popen preexec_fn)
import os
import signal
import sys

#: ``prctl(2)``'s option number, from ``<linux/prctl.h>``
PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None) -> bool:
    """Get SIGKILL when this process's parent dies (Linux; elsewhere nothing is armed).

    ``parent``: the pid the caller was forked from; False if that process is no longer the parent (it died
    before the signal was armed), True otherwise."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:  # no libc.so.6 (a musl system): the caller's own teardown still runs
            pass
    return parent is None or os.getppid() == parent
