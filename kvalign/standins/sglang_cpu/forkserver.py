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

The fork server itself is a fork of the worker (:func:`fork_server_now`), taken once
``dynamo.sglang.main`` has been imported and before ``main()`` starts Dynamo's runtime: at that point
the worker has imported torch, transformers, SGLang (the scheduler and detokenizer modules included)
and Dynamo, and runs one thread. ``multiprocessing`` would start the server as a fresh interpreter
that imports all of SGLang again (12-14 CPU-s per worker measured on a 2 prefill + 1 decode start,
about an eighth of the cluster's CPU); forked, it starts with the worker's modules. Forking later,
once the runtime's threads run, could copy a lock another thread holds, so with more than one thread
the server is left to ``multiprocessing`` as before. What the fork would otherwise freeze too early is
the environment: the engine sets variables after that import (``PROMETHEUS_MULTIPROC_DIR``, which
makes the children's metrics reach the worker's ``/metrics``; ``SGLANG_RUN_ID``; NCCL's), so each
child takes the worker's environment as it is when the child starts, as a spawned one does
(:func:`_prepare_in_environ`), and prometheus_client picks its multiprocess mode from it.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
import traceback
from multiprocessing import connection, spawn, util
from multiprocessing import forkserver as mp_forkserver
from collections.abc import Callable
from typing import Any

from kvalign.lifeline import die_with_parent

#: "1" in a worker's environment arms :func:`forkserver_children` (:class:`SglangCpuWorkerKind` sets it)
FORKSERVER_ENV = "KVALIGN_SGLANG_FORKSERVER"

#: what the fork server imports before its first fork: the SIGQUIT relay, then the modules of
#: SGLang's children (a DP controller's and a multi-detokenizer router's live in these too)
PRELOAD = ["kvalign.standins.sglang_cpu.forkserver_preload", "sglang.srt.managers.scheduler",
           "sglang.srt.managers.detokenizer_manager"]

#: the module after whose import the worker forks its fork server (:func:`fork_server_before_runtime`):
#: ``dynamo.sglang``'s entry imports it, then calls its ``main()``, which starts Dynamo's runtime
SERVER_FROM = "dynamo.sglang.main"


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


def threads() -> int:
    """This process's threads as the kernel counts them (native ones included), or Python's count
    where there is no ``/proc``."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def fork_server_now(preload: list[str] = PRELOAD) -> int | None:
    """Start ``multiprocessing``'s fork server as a fork of this process (its pid), so it holds every
    module imported so far instead of importing ``preload`` again in a new interpreter; what
    ``ForkServer.ensure_running`` does but ``fork`` for ``exec``. Later ``forkserver`` starts find it
    running and use it. None, starting nothing, when a server already runs, when this process runs
    more than one thread (forking then could copy a lock another thread holds) or on a Python whose
    fork server takes an authentication key (3.13+): ``multiprocessing`` then starts its own."""
    server = mp_forkserver._forkserver
    if server._forkserver_pid is not None or threads() > 1 or sys.version_info >= (3, 13):
        return None
    worker = os.getpid()
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # the server exits once every holder of alive_w has
        pid = os.fork()
        if pid == 0:
            spawn.prepare = _prepare_in_environ(spawn.prepare)
            _serve(listener.fileno(), alive_r, alive_w, preload, worker)
        os.close(alive_r)
    spawn.get_preparation_data = _with_environ(spawn.get_preparation_data)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return pid


#: where the worker's environment travels in a child's preparation data (``multiprocessing.spawn``)
ENVIRON_KEY = "kvalign_environ"


def _with_environ(get_preparation_data: Callable[[str], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
    """In the worker: each child's preparation data carries the worker's environment of now."""
    def with_environ(name: str) -> dict[str, Any]:
        return {**get_preparation_data(name), ENVIRON_KEY: dict(os.environ)}

    return with_environ


def _prepare_in_environ(prepare: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    """In the forked server's children: take the worker's environment from the preparation data before
    anything else runs, and let prometheus_client choose its value class again from it (imported in the
    worker before the engine set ``PROMETHEUS_MULTIPROC_DIR``, it chose single-process values)."""
    def in_environ(data: dict[str, Any]) -> None:
        environ = data.get(ENVIRON_KEY)
        if environ is not None:
            # only what differs: rewriting every variable moves them all off the block that follows argv,
            # and setproctitle then cannot retitle the child (``sglang::scheduler``, which teardown checks read)
            for name in [k for k in os.environ if k not in environ]:
                del os.environ[name]
            for name, value in environ.items():
                if os.environ.get(name) != value:
                    os.environ[name] = value
            values = sys.modules.get("prometheus_client.values")
            if values is not None:
                values.ValueClass = values.get_value_class()
        prepare(data)

    return in_environ


def _serve(listener_fd: int, alive_r: int, alive_w: int, preload: list[str], worker: int) -> None:
    """The forked server's whole life: ``multiprocessing``'s server loop, then ``os._exit`` (the
    worker's exit handlers are the worker's, never run here)."""
    code = 0
    try:
        os.close(alive_w)
        # SIGKILL when the worker dies (a fork clears the worker's own), so a worker killed outright takes its
        # server and, through SGLang's own parent-death signal, the server's children with it: the alive pipe alone
        # never closes while those children hold its other end
        if not die_with_parent(worker):
            os._exit(0)  # the worker died before the signal was armed
        mp_forkserver.main(listener_fd, alive_r, preload)
    except SystemExit as exc:  # the loop's end: the worker closed its end of the alive pipe
        code = exc.code if isinstance(exc.code, int) else 0
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def fork_server_before_runtime() -> None:
    """Run once ``dynamo.sglang.main`` has been imported (:mod:`.hooks`): :func:`fork_server_now`."""
    fork_server_now()
