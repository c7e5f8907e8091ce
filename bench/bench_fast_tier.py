"""Benchmark: the fast tier's wall time, paired: this tree against another worker count or commit.

Two questions, one method:

* ``--workers N``: this tree with ``-n N`` (B) against ``-n 2`` (A). The fast tier
  (``pytest -m "not slow and not e2e"``) spends a large part of its wall time waiting rather than
  computing: Dynamo runtimes starting, ZMQ subscriptions joining, child processes starting and
  stopping, timeouts that a negative control must sit out. On two cores, more workers than cores
  overlap those waits.
* ``--against REF``: this tree (B) against the commit REF (A), both with the tier's own ``-n auto``.
  REF is exported with ``git archive`` into a temporary directory and run from there with that
  directory first on ``PYTHONPATH``, so its tests import its own ``kvalign``; the installed
  packages are shared. This is how a change to the suite's cost is shown, rather than with one
  before and one after run an evening's load apart.

Each round runs A and B once, alternating the order (A B, then B A), and the report is the median
of the per-round ratios B / A with their spread (``bench/paired.py``'s :class:`Paired`; its
``paired()`` batches short calls, which a minute-long run is not), plus each side's median wall
seconds (the 60 s budget is a wall figure). Each run's CPU seconds (user + system of the run and every
process it waited for, as ``/usr/bin/time`` counts them) are reported the same way: on two cores shared
with other work the tier is CPU-bound, and its CPU moves less with the load than its wall time does.
Every run must pass: a failing run stops the benchmark.

Usage: .venv/bin/python bench/bench_fast_tier.py [--rounds 4] (--workers 4 | --against REF)
The last line is ``B / A wall ratio: X``; the one before it ``B / A CPU ratio: X``.
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from paired import Paired, parse_rounds, rounds_parser  # noqa: E402

FAST = ["-m", "not slow and not e2e", "-q"]


@dataclass(frozen=True)
class Side:
    """One way of running the fast tier: from which tree, with which extra pytest arguments."""

    label: str
    tree: Path
    args: list[str] = field(default_factory=list)

    def run(self) -> tuple[float, float]:
        """Wall and CPU seconds of one fast-tier run (it must pass)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.tree != ROOT:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.tree), env.get("PYTHONPATH")]))
        before, start = _children_cpu(), time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "pytest", *FAST, *self.args], cwd=self.tree,
                             capture_output=True, text=True, env=env)
        took, cpu = time.perf_counter() - start, _children_cpu() - before
        if res.returncode != 0:
            sys.exit(f"the fast tier failed ({self.label}):\n{res.stdout[-3000:]}")
        return took, cpu


def _children_cpu() -> float:
    """User + system seconds of every process this one has waited for (their own waited-for children included)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def export(ref: str, into: Path) -> Path:
    """REF's tracked files in ``into`` (``git archive``), or exit with git's one-line reason; with its bytecode.

    A fresh export has no ``__pycache__``: its first run compiled kvalign and rewrote every test module in each
    xdist worker (677d8cd, one bench's two rounds: 190.9 CPU-s and 216.8 s wall first, 137.7 and 83.1 s next), which
    this tree's run, on a checkout already compiled, never pays. So kvalign is compiled and the tier collected
    once, unmeasured."""
    archive = subprocess.run(["git", "archive", "--format=tar", ref], cwd=ROOT, capture_output=True)
    if archive.returncode != 0:
        sys.exit(f"git archive {ref}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    subprocess.run([sys.executable, "-m", "compileall", "-q", "kvalign"], cwd=into, check=True)
    subprocess.run([sys.executable, "-m", "pytest", *FAST, "--collect-only", "-p", "no:xdist"], cwd=into,
                   capture_output=True, env={**os.environ, "PYTHONPATH": str(into)}, check=True)
    return into


def measure(a: Side, b: Side, rounds: int) -> tuple[Paired, Paired]:
    """The wall seconds' and the CPU seconds' paired ratios, in that order."""
    runs: dict[str, list[tuple[float, float]]] = {a.label: [], b.label: []}
    for r in range(rounds):
        load = os.getloadavg()[0]
        order = (a, b) if r % 2 == 0 else (b, a)
        for side in order:
            runs[side.label].append(side.run())
        (aw, ac), (bw, bc) = runs[a.label][-1], runs[b.label][-1]
        print(f"round {r + 1} (load {load:.2f}, {order[0].label} first): A {aw:.1f}s ({ac:.1f} CPU-s), "
              f"B {bw:.1f}s ({bc:.1f} CPU-s), ratio {bw / aw:.2f} (CPU {bc / ac:.2f})", flush=True)
    return _paired(runs[a.label], runs[b.label], 0), _paired(runs[a.label], runs[b.label], 1)


def _paired(a_runs: list[tuple[float, float]], b_runs: list[tuple[float, float]], k: int) -> Paired:
    """Per-round ratios B / A of field ``k`` of each run (0 wall, 1 CPU) and each side's median."""
    a_s, b_s = [r[k] for r in a_runs], [r[k] for r in b_runs]
    return Paired([b / a for a, b in zip(a_s, b_s)], statistics.median(a_s), statistics.median(b_s))


def main() -> int:
    ap = rounds_parser(__doc__, 4)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--workers", type=int, help="B runs with -n WORKERS, A with -n 2 (same tree)")
    which.add_argument("--against", metavar="REF", help="A is the commit REF, B this tree (both -n auto)")
    args = parse_rounds(ap)
    with tempfile.TemporaryDirectory(prefix="bench-fast-tier-") as tmp:
        if args.against:
            a = Side(f"A = {args.against}", export(args.against, Path(tmp)))
            b = Side("B = this tree", ROOT)
        else:
            if args.workers in (0, 2) or args.workers < 0:
                ap.error("--workers must differ from A's 2 and be at least 1")
            a = Side("A = -n 2", ROOT, ["-n", "2"])
            b = Side(f"B = -n {args.workers}", ROOT, ["-n", str(args.workers)])
        print(f"{a.label}; {b.label}", flush=True)
        p, cpu = measure(a, b, args.rounds)
    print(f"median CPU: A {cpu.a_seconds:.1f}s, B {cpu.b_seconds:.1f}s; spread: {cpu.spread()}")
    print(f"median wall: A {p.a_seconds:.1f}s, B {p.b_seconds:.1f}s")
    print(f"spread: {p.spread()}")
    print(f"B / A CPU ratio: {cpu.median:.2f}")
    print(f"B / A wall ratio: {p.median:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
