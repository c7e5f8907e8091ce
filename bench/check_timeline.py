"""Where one ``kvalign check`` run's wall time goes: its serial start, each job on each process, the tail.

``bench/bench_check.py`` says how long a run took; this says why (issue 45, item 3: the default run
against ``--jobs 1``). It runs the command in a child process with hooks installed from outside (no
change to kvalign): the start of the systems' opening (``open_systems``, which imports SGLang), the
workers' fork (``Pool``), each job's start and end (``run_job``, in whichever process runs it) and the
rows' end, each marked with the wall clock, the process's CPU seconds (every thread) and its main
thread's time on a core and waiting for one (``/proc/<pid>/schedstat``). A job's wall is then its main
thread's CPU, plus its wait for a core (other processes: the machine's load), plus its sleep (waiting on
its threads, sockets, subprocesses): on a shared machine the CPU and the sleep are what a quiet one
would see, the wait is what the load added.

Usage: .venv/bin/python bench/check_timeline.py [--jobs N] [--page-size 16] [other check options]
(``--json`` is added; the header line gives a digest of the report's rows, without their seconds and ports,
equal for two runs whose rows are equal).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_check import _rows  # noqa: E402

TRACE = "KVALIGN_CHECK_TIMELINE"


def mark(event: str) -> None:
    """One line in the trace file: wall clock, pid, event, then cpu= (the process), run= and wait= (its main thread)."""
    t = os.times()
    with open(f"/proc/{os.getpid()}/schedstat") as f:
        run, wait, _ = f.read().split()
    with open(os.environ[TRACE], "a") as f:
        f.write(f"{time.time():.3f} {os.getpid()} cpu={t.user + t.system:.2f} run={int(run) / 1e9:.3f} "
                f"wait={int(wait) / 1e9:.3f} {event}\n")


def child(argv: list[str]) -> None:
    """The command, as ``python -m kvalign check ...`` runs it, with the hooks in place."""
    mark("start")
    from kvalign.commands import check as command
    from kvalign.verify.runner import check as runner
    from kvalign.verify.runner import pool

    def wrap(owner, name, before, after):  # noqa: ANN001 - a hook on any function
        fn = getattr(owner, name)

        def hooked(*args, **kwargs):  # noqa: ANN002, ANN003
            mark(before(*args))
            try:
                return fn(*args, **kwargs)
            finally:
                mark(after(*args))
        setattr(owner, name, hooked)

    wrap(command, "open_systems", lambda *_: "systems", lambda *_: "systems open")
    wrap(pool.Pool, "__init__", lambda *_: "fork", lambda *_: "forked")
    wrap(runner, "run_job", lambda k, job, *_: f"job {k} {job.label()}", lambda k, *_: f"end {k}")
    for owner, name in ((command, "run_jobs"), (pool.Pool, "run")):
        wrap(owner, name, lambda *_: "rows", lambda *_: "rows done")
    from kvalign.cli import main

    sys.argv = ["kvalign", "check", *argv]
    sys.exit(main())


def _parse(path: Path) -> list[tuple[float, int, dict[str, float], str]]:
    lines = []
    for line in path.read_text().splitlines():
        t, pid, rest = line.split(" ", 2)
        nums = dict((k, float(v)) for k, v in re.findall(r"(\w+)=([\d.]+)", rest))
        lines.append((float(t), int(pid), nums, re.sub(r"^(\w+=[\d.]+ )+", "", rest)))
    return lines


def report(path: Path, launched: float, ended: float) -> list[str]:
    """The timeline as lines: seconds since launch, the serial start, every job, each process's totals."""
    events = _parse(path)
    parent = events[0][1]
    out, begun, totals = [], {}, defaultdict(lambda: [0.0, 0.0, 0.0, 0.0, 0, 0.0])
    for t, pid, m, what in events:
        at = t - launched
        if what.startswith("job "):
            begun[(pid, what.split()[1])] = (at, m, what.split(" ", 2)[2])
        elif what.startswith("end "):
            start, m0, label = begun.pop((pid, what.split()[1]))
            cpu, run, wait = (m[k] - m0[k] for k in ("cpu", "run", "wait"))
            sleep = at - start - run - wait
            tot = totals[pid]
            tot[0] += at - start
            tot[1] += cpu
            tot[2] += run
            tot[3] += wait
            tot[4] += 1
            tot[5] = at
            out.append(f"  {pid:>7} {start:6.1f}-{at:6.1f}  wall {at - start:5.2f}  cpu {cpu:5.2f}  main {run:5.2f}  "
                       f"waited {wait:5.2f}  slept {sleep:5.2f}  {label}")
        elif pid == parent:
            out.append(f"  {pid:>7} {at:6.1f}  {what}: process cpu {m['cpu']:.2f} s, main thread waited {m['wait']:.2f} s")
    out.append(f"  exit at {ended - launched:.1f} s")
    for pid, (wall, cpu, run, wait, n, last) in sorted(totals.items(), key=lambda kv: kv[1][5]):
        out.append(f"  process {pid}: {n} jobs, last ended at {last:.1f} s; wall {wall:.1f} = main thread cpu "
                   f"{run:.1f} + waited {wait:.1f} + slept {wall - run - wait:.1f}; process cpu {cpu:.1f} "
                   f"(threads {cpu - run:.1f})")
    return out


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2:])
    with tempfile.TemporaryDirectory(prefix="check-timeline-") as tmp:
        trace, rows = Path(tmp) / "trace", Path(tmp) / "rows.json"
        env = dict(os.environ, **{TRACE: str(trace)})
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        load = os.getloadavg()
        launched = time.time()
        with rows.open("w") as f:
            proc = subprocess.run([sys.executable, __file__, "--child", "--json", *sys.argv[1:]], stdout=f,
                                  stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        ended = time.time()
        if proc.returncode not in (0, 1):
            sys.exit(f"check failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        got = _rows(rows.read_text())
        digest = hashlib.sha256(json.dumps(got, sort_keys=True, default=str).encode()).hexdigest()[:12]
        print(f"kvalign check {' '.join(sys.argv[1:])}: {ended - launched:.1f} s wall, load at start "
              f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {len(got)} rows, digest {digest}")
        print("\n".join(report(trace, launched, ended)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
