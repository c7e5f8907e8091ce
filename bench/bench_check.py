"""Benchmark: ``kvalign check``'s wall time at this tree against an earlier commit or ``--jobs 1``, paired, and its peak memory.

``kvalign check`` is the job users run in CI on every change; this is how a change to its cost is
shown. For each case (the default run, and ``--page-size 16``), each round runs the check once at
the commit REF (A) and once at this tree (B), alternating the order (A B, then B A, so a drift in
the machine's load hits both sides alike); the report is the median of the per-round ratios B / A
with their spread (``bench/paired.py``'s :class:`Paired`), each side's median wall seconds, and the
load average each round started at. REF is exported with ``git archive`` into a temporary directory
and run from there with that directory first on ``PYTHONPATH``, so it imports its own ``kvalign``;
the installed packages (Dynamo, SGLang) are shared.

Peak memory is that of the *whole* run: the ``kvalign`` process and every process under it (``check
--jobs``'s fork server and workers), sampled every 0.1 s from ``/proc``, as two sums: RSS (each
process's resident set, so a page the workers share with the fork server counts once per process)
and PSS (a page shared by n processes counts 1/n in each: the memory the run holds). The report gives
each side's highest sums over all its runs.

``--jobs-1`` instead of ``--against REF``: both sides run this tree, A with ``--jobs 1`` (every row in
the command's own process), B with the default (a worker per usable core): how close the workers come
to the cores' limit (0.5 on two cores; issue 45's target is 0.6 on ``--page-size 16``). The rows must
be equal: each round compares A's and B's ``--json`` rows (the seed is fixed), and a difference stops
the benchmark.

A run must exit 0 or 1 (aligned, or a finding): anything else stops the benchmark with its stderr.

Usage: .venv/bin/python bench/bench_check.py (--against REF | --jobs-1) [--rounds 3] [--case default --case page16]
The last line of each case is ``<case>: B / A wall ratio: X``.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fast_tier import export  # noqa: E402
from paired import Paired, parse_rounds, rounds_parser  # noqa: E402

CASES = {"default": [], "page16": ["--page-size", "16"]}
PAGE = os.sysconf("SC_PAGE_SIZE")


def _children() -> dict[int, list[int]]:
    """Every process's children, from ``/proc/<pid>/stat`` (field 4 is the parent)."""
    tree: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def tree_memory(pid: int) -> tuple[int, int]:
    """Bytes of ``pid`` and every process under it, now: (resident, summed over the processes; proportional,
    each page shared by n of them counted 1/n in each: the memory the run holds, once)."""
    tree, rss, pss, todo = _children(), 0, 0, [pid]
    while todo:
        p = todo.pop()
        todo += tree.get(p, [])
        try:
            with open(f"/proc/{p}/statm") as f:
                rss += int(f.read().split()[1]) * PAGE
            with open(f"/proc/{p}/smaps_rollup") as f:
                pss += next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("Pss:"))
        except (OSError, IndexError, ValueError, StopIteration):
            continue
    return rss, pss


@dataclass
class Run:
    wall: float
    peak_rss: int
    peak_pss: int
    rows: object = None  # the --json report's rows, with their wall seconds taken out (--jobs-1)


@dataclass(frozen=True)
class Side:
    label: str
    tree: Path
    args: tuple[str, ...] = ()

    def run(self, extra: list[str]) -> Run:
        env = dict(os.environ)
        if self.tree != ROOT:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.tree), env.get("PYTHONPATH")]))
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "kvalign", "check", *self.args, *extra], cwd=self.tree, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        peak, done = [0, 0], threading.Event()

        def sample() -> None:
            while not done.is_set():
                rss, pss = tree_memory(proc.pid)
                peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)
                done.wait(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        out, err = proc.communicate()
        took = time.perf_counter() - start
        done.set()
        sampler.join()
        if proc.returncode not in (0, 1):
            sys.exit(f"check {' '.join(extra)} failed ({self.label}, exit {proc.returncode}):\n{err[-3000:]}")
        return Run(took, peak[0], peak[1], _rows(out) if "--json" in self.args else None)


def _rows(out: str) -> list[dict]:
    """The report's rows without what differs between two runs of the same rows: their seconds, and the
    loopback ports a row's detail names (the dp rows' schedulers bind free ports)."""
    return [{k: re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", v) if isinstance(v, str) else v
             for k, v in row.items() if k != "seconds"} for row in json.loads(out)["rows"]]


def measure(a: Side, b: Side, extra: list[str], rounds: int, case: str) -> tuple[Paired, Run, Run]:
    ratios, a_walls, b_walls = [], [], []
    a_peak, b_peak = Run(0, 0, 0), Run(0, 0, 0)  # the highest memory of each side's runs
    for r in range(rounds):
        load = os.getloadavg()
        order = (a, b) if r % 2 == 0 else (b, a)
        runs = {side.label: side.run(extra) for side in order}
        ra, rb = runs[a.label], runs[b.label]
        if ra.rows != rb.rows:
            x, y = next((x, y) for x, y in zip(ra.rows, rb.rows) if x != y) if len(ra.rows) == len(rb.rows) else ({}, {})
            fields = {k: (x.get(k), y.get(k)) for k in {*x, *y} if x.get(k) != y.get(k)}
            sys.exit(f"{case} round {r + 1}: the rows differ between {a.label} and {b.label} "
                     f"({len(ra.rows)} and {len(rb.rows)} rows; first difference: {fields})")
        a_walls.append(ra.wall)
        b_walls.append(rb.wall)
        a_peak = Run(0, max(a_peak.peak_rss, ra.peak_rss), max(a_peak.peak_pss, ra.peak_pss))
        b_peak = Run(0, max(b_peak.peak_rss, rb.peak_rss), max(b_peak.peak_pss, rb.peak_pss))
        ratios.append(rb.wall / ra.wall)
        print(f"{case} round {r + 1} (load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {order[0].label} first): "
              f"A {ra.wall:.1f}s, B {rb.wall:.1f}s, ratio {ratios[-1]:.2f}; peak memory A {_mib(ra)}, B {_mib(rb)}",
              flush=True)
    return Paired(ratios, statistics.median(a_walls), statistics.median(b_walls)), a_peak, b_peak


def _mib(run: Run) -> str:
    return f"RSS {run.peak_rss / 2**20:.0f} MiB / PSS {run.peak_pss / 2**20:.0f} MiB"


def main() -> int:
    ap = rounds_parser(__doc__, 3)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--against", metavar="REF", help="A is the commit REF, B this tree")
    which.add_argument("--jobs-1", action="store_true",
                       help="A is this tree with --jobs 1, B this tree with the default jobs (rows compared)")
    ap.add_argument("--case", action="append", choices=tuple(CASES),
                    help="default (kvalign check) and/or page16 (kvalign check --page-size 16); default: both")
    args = parse_rounds(ap)
    with tempfile.TemporaryDirectory(prefix="bench-check-") as tmp:
        if args.jobs_1:
            a, b = Side("A = --jobs 1", ROOT, ("--json", "--jobs", "1")), Side("B = default jobs", ROOT, ("--json",))
        else:
            a, b = Side(f"A = {args.against}", export(args.against, Path(tmp))), Side("B = this tree", ROOT)
        print(f"{a.label}; {b.label}; {os.cpu_count()} CPUs, {len(os.sched_getaffinity(0))} usable", flush=True)
        lines = []
        for case in args.case or list(CASES):
            p, a_peak, b_peak = measure(a, b, CASES[case], args.rounds, case)
            lines += [f"{case}: median wall: A {p.a_seconds:.1f}s, B {p.b_seconds:.1f}s; spread: {p.spread()}; "
                      f"peak memory of the whole run: A {_mib(a_peak)}, B {_mib(b_peak)}",
                      f"{case}: B / A wall ratio: {p.median:.2f}"]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
