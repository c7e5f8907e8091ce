"""``check --jobs N``: the planned jobs run in N worker processes, the rows come back in plan order.

Rows are independent (each drives its own real router worker and real SGLang caches with its own
generated inputs), so a run on two cores can use both. The command builds its systems first, as
``--jobs 1`` does (:func:`kvalign.verify.engine.systems.open_systems`: Dynamo's binding and SGLang's
cache classes imported, seconds of CPU), and the workers are forked from it: each starts in the
state ``--jobs 1`` runs its first job in, with nothing imported twice and no interpreter started
again. That state matters for the rows: the tier rows' engine picks among pages of equal access time
in an order that follows the process's state (with kvalign's other commands imported or not, one
seeded tier row ran 10 or 13 cases), and a worker must give the rows ``--jobs 1`` gives. Nothing
the systems open lazily (the registration code, the router path and its Dynamo runtime threads) is
open yet when they fork, and :func:`gc.freeze` first puts what was imported out of the collector's
sight: a full collection in a worker (Hypothesis runs one when it first seeds its random state)
neither walks SGLang's and torch's objects nor writes to the pages the workers share.

Each worker takes jobs from the parent one at a time; the parent hands them out longest first (the
property's ``cost``), so the long rows start early and the short ones fill in, but for a job that
loads a set-up another worker already loaded (:attr:`~kvalign.verify.engine.property.Job.shares`:
``card``, ``advertised`` and ``dp`` all import dynamo.sglang, about 1.2 s of CPU): that one waits for its
worker while jobs without it remain (:class:`Schedule`). Every job runs with
the same options and seed as under ``--jobs 1``, and its rows are put back in plan order, so the
report is the same whichever worker ran what.

A worker that raises or dies is a :class:`WorkerError` naming the row it was running (the command
exits 2); the parent never waits on a dead worker: it watches each process's sentinel beside its pipe.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from kvalign.errors import UsageError
from kvalign.verify.engine.property import Job, Options
from kvalign.verify.engine.rows import RowResult
from kvalign.verify.engine.systems import Systems


class WorkerError(UsageError):
    """A worker failed: the message names the row (job) it was running, or says it was idle."""


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _worker(conn: Connection, systems: Systems, opts: Options) -> None:
    """A worker's life: run jobs on the systems it was forked with until told to stop."""
    os.dup2(2, 1)  # the runtimes' prints go where their logs go (fd 2, the run's log file); stdout is the report's
    from kvalign.verify.runner.check import run_job

    try:
        while True:
            message = conn.recv()
            if message is None:
                break
            index, job = message
            try:
                conn.send(("rows", index, run_job(index, job, systems.for_format(job.event_format), opts)))
            except Exception as exc:  # a bug in a property or an oracle: its row is named, its traceback logged
                traceback.print_exc()
                conn.send(("error", index, f"{type(exc).__name__}: {exc}"))
                break
    finally:
        # No orderly shutdown of the router path nor the interpreter's teardown of torch, SGLang and Dynamo:
        # their exit handlers (the runtime's shutdown, a publisher's 1 s shutdown each) held a finished worker
        # for seconds while the parent waits for it. Everything it had to say has been sent, the runtimes'
        # log lines are written unbuffered, and its sockets and threads end with the process.
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class Schedule:
    """The jobs not handed out yet, longest first, and which worker loaded each shared set-up."""

    def __init__(self, jobs: Sequence[Job]) -> None:
        self.jobs = jobs
        self.queue = sorted(range(len(jobs)), key=lambda k: (-jobs[k].cost, k))
        #: set-up (:attr:`Job.shares`) -> the worker that took the first job loading it
        self.owners: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self.queue)

    def take(self, worker: int) -> int:
        """The job ``worker`` runs next: the longest whose set-up no other worker has loaded, else the longest
        (a free worker never waits while jobs remain)."""
        pos = next((pos for pos, k in enumerate(self.queue)
                    if self.owners.get(self.jobs[k].shares or "", worker) == worker), 0)
        k = self.queue.pop(pos)
        if self.jobs[k].shares:
            self.owners.setdefault(self.jobs[k].shares, worker)
        return k


class Pool:
    """``workers`` worker processes forked from this one, each with its own copy of ``systems`` (none of it opened yet)."""

    def __init__(self, workers: int, systems: Systems, opts: Options) -> None:
        ctx = multiprocessing.get_context("fork")
        gc.freeze()
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        for _ in range(workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, systems, opts), daemon=True)
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)

    def _receive(self, busy: dict[int, tuple[int, Job]]) -> list[tuple[int, tuple[str, Any, Any]]]:
        """The next messages from any worker; a worker that died raises, naming its job."""
        handles: dict[Any, int] = {}
        for i, (conn, proc) in enumerate(zip(self._conns, self._procs)):
            handles[conn], handles[proc.sentinel] = i, i
        got: list[tuple[int, tuple[str, Any, Any]]] = []
        for ready in wait(list(handles)):
            i = handles[ready]
            if ready is self._conns[i]:
                try:
                    got.append((i, self._conns[i].recv()))
                except EOFError:
                    self._dead(i, busy)
            elif not self._conns[i].poll():
                self._dead(i, busy)
        return got

    def _dead(self, i: int, busy: dict[int, tuple[int, Job]]) -> None:
        self._procs[i].join(timeout=5)  # its pipe closed first: let it be reaped, for its exit status
        code = self._procs[i].exitcode
        how = (f"exited with status {code}" if code is not None and code >= 0 else f"was killed by signal {-code}"
               if code is not None else "stopped answering")
        where = f"while running {busy[i][1].label()}" if i in busy else "while idle"
        raise WorkerError(f"check worker {i + 1} {how} {where}")

    def _failed(self, i: int, job: Job | None, payload: str) -> None:
        first = payload.splitlines()[0]
        raise WorkerError(f"row {job.label() if job else '?'} failed in check worker {i + 1}: {first}")

    def run(self, jobs: Sequence[Job], progress: Callable[[RowResult], None] | None = None) -> list[RowResult]:
        """Every job's rows, in the order of ``jobs``; handed out longest first (:class:`Schedule`), to whichever worker is free."""
        schedule = Schedule(jobs)
        results: dict[int, list[RowResult]] = {}
        busy: dict[int, tuple[int, Job]] = {}

        def hand_out() -> None:
            for i in range(len(self._procs)):
                if i not in busy and schedule:
                    k = schedule.take(i)
                    busy[i] = (k, jobs[k])
                    self._conns[i].send((k, jobs[k]))

        hand_out()
        while len(results) < len(jobs):
            for i, (kind, index, payload) in self._receive(busy):
                if kind == "rows":
                    results[index] = payload
                    del busy[i]
                    for row in payload:
                        if progress:
                            progress(row)
                else:  # "error"
                    self._failed(i, busy.get(i, (None, None))[1], payload)
                hand_out()
        return [row for k in range(len(jobs)) for row in results[k]]

    def close(self) -> None:
        """Tell every worker to stop, and make sure each has."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
