"""Process lifecycle for live runs: start, watch, and always tear down, with per-process logs.

A live run is several OS processes (frontend, workers, broker) and each may fork children
(SGLang's scheduler and detokenizer). An orphan keeps ports and GPU memory and poisons the next
run, so teardown is by *process group*, escalating SIGTERM -> SIGKILL, and it runs on every exit
path: normal exit, exception, timeout, Ctrl-C (the caller's ``with`` block / pytest finaliser),
and — as a last resort if this Python process itself is SIGKILLed — the kernel's parent-death
signal set in each child (Linux).

Each process writes stdout+stderr to ``<log_dir>/<name>.log``; callers keep the directory when a
run fails and may delete it when it passes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvalign.lifeline import die_with_parent


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()  # own process group, so teardown reaches grandchildren too
    die_with_parent()


@dataclass(frozen=True)
class ProcessSpec:
    """One process of a topology: what to run, with which environment, logged under ``name``.

    ``infrastructure`` processes (the event-plane broker) are stopped after all others: a
    Dynamo process flushing events on exit to a broker that is already gone can block its
    ZMQ context termination until it is killed.
    """

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    infrastructure: bool = False

    def command_line(self) -> str:
        """A copy-pasteable shell line (env overrides first), for plans and failure reports."""
        import shlex

        envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (envs + " " if envs else "") + " ".join(shlex.quote(a) for a in self.argv)


class ProcessExited(RuntimeError):
    """A process of the group died while the run still needed it."""


@dataclass
class ManagedProcess:
    spec: ProcessSpec
    popen: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n_bytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-n_bytes:].decode("utf-8", "replace")


class ProcessGroup:
    """The processes of one run; :meth:`stop` (idempotent) kills every one of their groups."""

    def __init__(self, log_dir: str | Path, base_env: Mapping[str, str] | None = None):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.procs: list[ManagedProcess] = []
        self.killed: list[str] = []

    def start(self, spec: ProcessSpec) -> ManagedProcess:
        if any(p.spec.name == spec.name for p in self.procs):
            raise ValueError(f"duplicate process name {spec.name!r}")
        log_path = self.log_dir / f"{spec.name}.log"
        with open(log_path, "ab") as log:
            log.write(f"$ {spec.command_line()}\n".encode())
            log.flush()
            popen = subprocess.Popen(
                spec.argv, env={**self.base_env, **spec.env}, cwd=spec.cwd, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
            )
        proc = ManagedProcess(spec, popen, log_path)
        self.procs.append(proc)
        return proc

    def check_alive(self) -> None:
        """Raise :class:`ProcessExited` naming the first process that died, with its log tail."""
        for p in self.procs:
            rc = p.popen.poll()
            if rc is not None:
                raise ProcessExited(f"{p.spec.name} (pid {p.pid}) exited with code {rc}; log {p.log_path}:\n{p.log_tail()}")

    def stop(self, grace_s: float = 8.0) -> list[str]:
        """Stop every group (services first, infrastructure last); return the names that needed SIGKILL.

        Each wave gets SIGTERM, up to ``grace_s`` to exit, then SIGKILL for the whole group
        (grandchildren may outlive their leader). Idempotent.
        """
        killed: list[str] = []
        services = [p for p in reversed(self.procs) if not p.spec.infrastructure]
        infra = [p for p in reversed(self.procs) if p.spec.infrastructure]
        for wave in (services, infra):
            for p in wave:
                _signal_group(p.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for p in wave:
                try:
                    p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    killed.append(p.spec.name)
                _signal_group(p.pid, signal.SIGKILL)
                if p.popen.poll() is None:
                    p.popen.wait(timeout=5)
        deadline = time.monotonic() + 5.0
        while any(group_alive(p.pid) for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.02)  # grandchildren re-parented to init: wait until reaped
        self.killed = killed
        return killed

    def stop_one(self, name: str, grace_s: float = 8.0) -> bool:
        """Stop process ``name``'s whole group (SIGTERM, then SIGKILL after ``grace_s``) and forget
        it, so a restart may reuse the name and its log; True if it needed SIGKILL."""
        proc = next((p for p in self.procs if p.spec.name == name), None)
        if proc is None:
            raise ValueError(f"no process named {name!r}")
        _signal_group(proc.pid, signal.SIGTERM)
        killed = False
        try:
            proc.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            killed = True
        _signal_group(proc.pid, signal.SIGKILL)
        if proc.popen.poll() is None:
            proc.popen.wait(timeout=5)
        deadline = time.monotonic() + 5.0
        while group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        self.procs.remove(proc)
        return killed

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def environ(self, name: str) -> dict[str, str] | None:
        """The environment process ``name`` runs with, read from the kernel (``/proc/PID/environ``): what
        it inherited and what its spec set, as the program sees them (None: no such process, or no /proc)."""
        proc = next((p for p in self.procs if p.spec.name == name), None)
        if proc is None:
            return None
        try:
            raw = Path(f"/proc/{proc.pid}/environ").read_bytes()
        except OSError:
            return None
        pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
        return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` still exists (for teardown checks)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pids_with_env(key: str, value: str) -> list[int]:
    """PIDs of live processes whose environment has ``key=value`` (Linux /proc; [] elsewhere).

    The orphan check: every process of a run carries a run marker, so anything still carrying
    it after teardown is a leak, however it was spawned.
    """
    needle = f"{key}={value}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0") and int(entry.name) != os.getpid():
            found.append(int(entry.name))
    return found


def run_pids(key: str, value: str) -> list[int]:
    """Every live process of a run: those carrying its marker and every member of their process
    groups. Markers alone miss SGLang's scheduler and detokenizer: ``setproctitle`` overwrites
    the memory ``/proc/<pid>/environ`` reads, while the process group survives."""
    marked = pids_with_env(key, value)
    groups = set()
    for pid in marked:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            continue
    return sorted(set(marked) | set(pids_in_groups(groups)))


def pids_in_groups(pgids: set[int]) -> list[int]:
    """Live PIDs whose process group is in ``pgids`` (Linux /proc; [] elsewhere)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if len(fields) > 2 and int(fields[2]) in pgids and int(entry.name) != os.getpid():
            found.append(int(entry.name))
    return found


def rss_bytes(pids: list[int]) -> int:
    """Resident memory of ``pids`` summed (Linux /proc; processes that exited count 0)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            continue
    return total


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt inside the block, so ``with Cluster(...)`` unwinds
    (and tears down) when a CLI run is terminated, exactly as on Ctrl-C. Main thread only."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
