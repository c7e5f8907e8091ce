"""vLLM children forked from one interpreter that has imported vLLM, instead of a fresh interpreter each.

Importing vLLM is most of a child's start (about 12 s of CPU). :class:`~kvalign.oracles.vllm.VllmEngine`
keeps a closed engine's child for the next one, but engines open at once (two data-parallel ranks, a
routing-impact test's pair) each needed an interpreter of their own. So the first child of an environment
starts a fork server (``python -m kvalign.oracles.vllm_child --fork-server PATH``): it imports what a child's
``init`` imports, listens on a unix socket in a private directory, and for each connection forks a child
that serves :mod:`kvalign.oracles.vllm_child`'s protocol on the pipes and log the connection passed it
(``SCM_RIGHTS``), as ``multiprocessing``'s forkserver does. The connection then carries the child's exit
status when the server reaps it, so the parent still learns how a child ended (:class:`ForkedChild`).

Why forking after the import is safe here: the server runs no Python thread but its main one, and the only
native threads vLLM's import chain starts are numpy's and scipy's idle OpenBLAS servers, which OpenBLAS
shuts down around a fork (``pthread_atfork``); torch's OpenMP pool is not started (the server computes
nothing). A child builds its cache, its ``ZmqEventPublisher`` and their threads after the fork, as a fresh
child did. It inherits the server's environment, so ``PYTHONHASHSEED=0`` and the engine's extra variables
are the ones a fresh child had: a different environment is a different server.

This module is imported on both sides: the server half (:func:`serve_forks`) in vLLM's interpreter, the
parent half (:class:`ForkServer`) in kvalign's; both use the standard library and :mod:`kvalign.lifeline` only.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from typing import IO, Any, BinaryIO

from kvalign.lifeline import die_with_parent

#: ``KVALIGN_VLLM_FORK=0``: every child is a fresh interpreter again (the measure of what forking saves)
FORK_ENV = "KVALIGN_VLLM_FORK"
#: what a child's ``returncode`` says when its server died before reporting it (the child died with it)
LOST = "unknown: its fork server exited"


class ForkServerError(RuntimeError):
    """The fork server did not start, or did not fork a child (its last log line)."""


def forking() -> bool:
    """Whether new vLLM children are forked (the default) rather than started as fresh interpreters."""
    return os.environ.get(FORK_ENV, "1") != "0"


class ForkedChild:
    """A forked child as :class:`subprocess.Popen` shows one to :class:`~kvalign.oracles.vllm.VllmEngine`:
    its request and reply pipes, ``poll``, ``wait`` and ``kill``; its exit status comes over ``status``."""

    def __init__(self, pid: int, stdin: BinaryIO, stdout: BinaryIO, status: socket.socket) -> None:
        self.pid, self.stdin, self.stdout, self._status = pid, stdin, stdout, status
        self.returncode: int | str | None = None

    def poll(self) -> int | str | None:
        if self.returncode is None and _readable(self._status, 0.0):
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | str:
        if self.returncode is None:
            if not _readable(self._status, timeout):
                raise subprocess.TimeoutExpired(f"vLLM child {self.pid}", timeout or 0.0)
            self._read_status()
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _read_status(self) -> None:
        data = b""
        while len(data) < 4 and (chunk := self._status.recv(4 - len(data))):
            data += chunk
        self.returncode = int.from_bytes(data, "big", signed=True) if len(data) == 4 else LOST
        self._status.close()


class ForkServer:
    """One environment's fork server, owned by the process that started it (``owner``; a process forked from
    that one, a ``check`` worker say, starts its own): it exits when its owner closes its stdin (:meth:`close`,
    or the owner's exit), and its children with it."""

    def __init__(self, python: str, env: Mapping[str, str], *, timeout: float) -> None:
        self.owner = os.getpid()
        self._dir = tempfile.mkdtemp(prefix="kvalign-vllm-fork-")
        self.path = os.path.join(self._dir, "socket")
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([python, "-m", "kvalign.oracles.vllm_child", "--fork-server", self.path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=dict(env))
        assert self.proc.stdout is not None
        if not _readable(self.proc.stdout, timeout) or self.proc.stdout.read(1) != b"R":
            self.close()
            raise ForkServerError(f"vLLM's fork server did not start: {self.last_log_line()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, log: IO[bytes], *, timeout: float) -> ForkedChild:
        """A new child serving its requests on fresh pipes, its stderr into ``log``."""
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            socket.send_fds(conn, [b"F"], [in_r, out_w, log.fileno()])
            pid = b""
            while len(pid) < 8 and _readable(conn, timeout) and (chunk := conn.recv(8 - len(pid))):
                pid += chunk
        except OSError as exc:
            pid = b""
            reason = f"{type(exc).__name__}: {exc}"
        else:
            reason = self.last_log_line()
        finally:
            os.close(in_r)
            os.close(out_w)
        if len(pid) < 8:
            conn.close()
            os.close(in_w)
            os.close(out_r)
            raise ForkServerError(f"vLLM's fork server did not fork a child: {reason}")
        return ForkedChild(int.from_bytes(pid, "big"), os.fdopen(in_w, "wb"), os.fdopen(out_r, "rb"), conn)

    def last_log_line(self) -> str:
        self.log.seek(0)
        lines = [ln for ln in self.log.read().decode(errors="replace").splitlines() if ln.strip()]
        return lines[-1] if lines else "(no output)"

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _readable(f: Any, timeout: float | None) -> bool:
    with selectors.DefaultSelector() as sel:
        sel.register(f, selectors.EVENT_READ)
        return bool(sel.select(timeout))


def serve_forks(path: str, ready: BinaryIO, preload: Callable[[], object], child_main: Callable[[], object]) -> None:
    """The server (vLLM's interpreter): ``preload``, say ``R`` on ``ready``, then fork a child running
    ``child_main`` for each connection to ``path`` until stdin (the owner's pipe) closes.

    A failing ``preload`` is not the server's to report: a child's ``init`` imports again and answers the
    failure to its engine, as a fresh child did."""
    try:
        preload()
    except Exception as exc:  # noqa: BLE001 - the child's init reports it to its engine
        print(f"kvalign: vLLM's fork server could not preload: {type(exc).__name__}: {exc}", file=sys.stderr)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    for f in (0, wake_r, listener):
        sel.register(f, selectors.EVENT_READ)
    ready.write(b"R")
    ready.flush()
    try:
        _fork_until_eof(listener, wake_r, wake_w, sel, ready, child_main)
    finally:  # the socket's directory goes with the server, whether or not its owner's exit cleans up
        with contextlib.suppress(OSError):
            os.unlink(path)
            os.rmdir(os.path.dirname(path))


def _fork_until_eof(listener: socket.socket, wake_r: int, wake_w: int, sel: selectors.BaseSelector, ready: BinaryIO,
                    child_main: Callable[[], object]) -> None:
    """Fork a child per connection and report each one's exit on its connection, until stdin closes."""
    children: dict[int, socket.socket] = {}
    while True:
        for key, _ in sel.select():
            if key.fileobj == 0 and not os.read(0, 4096):
                return  # the owner is gone: the children die with the server (PR_SET_PDEATHSIG)
            if key.fileobj == wake_r:
                os.read(wake_r, 4096)
            if key.fileobj is listener:
                conn, _ = listener.accept()
                _, fds, _, _ = socket.recv_fds(conn, 1, 3)
                sys.stdout.flush()
                sys.stderr.flush()
                server = os.getpid()
                pid = os.fork()
                if pid == 0:
                    _become_child(server, fds, [listener, conn, *children.values()],
                                  [wake_r, wake_w, ready.fileno()], child_main)
                for fd in fds:
                    os.close(fd)
                conn.sendall(pid.to_bytes(8, "big"))
                children[pid] = conn
        _reap(children)


def _reap(children: dict[int, socket.socket]) -> None:
    """Send each exited child's status to its parent's connection and close it."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(os.waitstatus_to_exitcode(status).to_bytes(4, "big", signed=True))
            except OSError:
                pass  # the parent closed the connection first
            conn.close()


def _become_child(server: int, fds: list[int], sockets: list[socket.socket], pipes: list[int],
                  child_main: Callable[[], object]) -> None:
    """In the forked child: the server's sockets and signal set-up gone, the passed pipes on fds 0-2, then serve."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for s in sockets:
            s.close()
        for fd in pipes:
            os.close(fd)
        if not die_with_parent(server):  # a child outlives no fork server (nor, through it, the server's owner)
            os._exit(70)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        child_main()
    finally:
        os._exit(70)
