"""Quiet by default: Dynamo's and SGLang's own log lines go to a file, kvalign's lines to the terminal.

A user reads a red ``ERROR dynamo_llm::...`` after an ALIGNED verdict as a failure, so the
runtimes' output must not reach the terminal unless asked for (``--verbose``). It has to be
diverted at the file-descriptor level:

* Dynamo's Rust runtime writes its tracing output straight to fd 2; ``DYN_LOG`` only sets the
  level, and is read once, when ``dynamo._core`` is first imported.
* Dynamo 1.6.1 logs ERROR lines on an orderly shutdown of an in-process runtime: its brokered KV
  ingress (``broker_zmq``) waits on the membership channel and its cancellation in an unbiased
  ``tokio::select!``, so when the runtime's token is cancelled the membership task may close the
  channel first ("Brokered KV membership task ended unexpectedly"), and the key-value store's
  watch tasks send to consumers that cancellation already dropped ("KeyValueStoreManager.watch
  receiver closed"). Unregistering and dropping kvalign's routers first does not close that race,
  so those lines are kept out of sight instead, in the log.
* SGLang logs through Python ``logging`` and ``warnings``, whose handlers write to ``sys.stderr``,
  i.e. fd 2.

So while a command runs, fd 2 is the log file and kvalign's own messages go to :func:`console`, a
duplicate of the original stderr. A failure message names the file (:attr:`RuntimeLog.path`); an
empty log is removed.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import TextIO

_console: TextIO | None = None


def console() -> TextIO:
    """Where kvalign's own messages go: the terminal's stderr, also while fd 2 is a log file."""
    return _console if _console is not None else sys.stderr


def log_dir() -> Path:
    """``$KVALIGN_LOG_DIR``, else ``~/.cache/kvalign/logs`` (the temp dir if that cannot be made)."""
    configured = os.environ.get("KVALIGN_LOG_DIR")
    base = Path(configured) if configured else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvalign" / "logs"
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError:
        base = Path(tempfile.gettempdir())
    return base


def _writes_to_fd2(stream: TextIO) -> bool:
    try:
        return stream.fileno() == 2
    except (AttributeError, OSError, ValueError):  # e.g. pytest's capture object
        return False


class RuntimeLog:
    """Points fd 2 at a log file for the ``with`` block.

    ``until_exit``: for the process's own command (``kvalign ...``), fd 2 stays on the log after
    the block, because Dynamo's runtime threads can still write while the interpreter exits; only
    Python's ``sys.stderr`` goes back to the terminal, so tracebacks and kvalign's last lines show.
    """

    def __init__(self, command: str, *, until_exit: bool = False) -> None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.path: Path | None = log_dir() / f"{command}-{stamp}-{os.getpid()}.log"
        self.until_exit = until_exit
        self._saved_fd = -1
        self._own_console: TextIO | None = None

    def __enter__(self) -> RuntimeLog:
        global _console
        assert self.path is not None
        sys.stderr.flush()
        log_fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._saved_fd = os.dup(2)
        if _writes_to_fd2(sys.stderr):
            self._own_console = open(os.dup(self._saved_fd), "w", buffering=1, encoding="utf-8",  # noqa: SIM115
                                     errors="backslashreplace")
        _console = self._own_console or sys.stderr
        os.dup2(log_fd, 2)
        os.close(log_fd)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        global _console
        sys.stderr.flush()
        if self.until_exit:
            if self._own_console is not None:
                sys.stderr = self._own_console
        else:
            os.dup2(self._saved_fd, 2)
            if self._own_console is not None:
                self._own_console.close()
            _console = None
        os.close(self._saved_fd)
        assert self.path is not None
        if self.path.stat().st_size == 0:
            self.path.unlink()
            self.path = None
