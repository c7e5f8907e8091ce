"""Benchmark: the fast tier's wall time with N xdist workers against 2, paired.

The fast tier (``pytest -m "not slow and not e2e"``) spends a large part of its wall time waiting
rather than computing: Dynamo runtimes starting, ZMQ subscriptions joining, child processes
starting and stopping, timeouts that a negative control must sit out. On two cores, more workers
than cores overlap those waits. Each round runs the tier once with ``-n 2`` (A) and once with
``-n N`` (B), alternating the order (A B, then B A), and the report is the median of the per-round
ratios B / A with their spread (``bench/paired.py``'s :class:`Paired`; its ``paired()`` batches
short calls, which a minute-long run is not), plus each side's median wall seconds (the 60 s budget
is a wall figure). Every run must pass: a failing run stops the benchmark.

Usage: .venv/bin/python bench/bench_fast_tier.py [--rounds 4] [--workers 4]
The last line is ``-n N / -n 2 wall ratio: X``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from paired import Paired, parse_rounds, rounds_parser  # noqa: E402

FAST = ["-m", "not slow and not e2e", "-q"]


def run(workers: int) -> float:
    """Wall seconds of one fast-tier run with ``workers`` xdist workers (it must pass)."""
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "pytest", *FAST, "-n", str(workers)], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    took = time.perf_counter() - start
    if res.returncode != 0:
        sys.exit(f"the fast tier failed with -n {workers}:\n{res.stdout[-3000:]}")
    return took


def main() -> int:
    ap = rounds_parser(__doc__, 4)
    ap.add_argument("--workers", type=int, default=4, help="B's worker count (A is 2)")
    args = parse_rounds(ap)
    if args.workers in (0, 2):
        ap.error("--workers must differ from A's 2 and be at least 1")
    ratios, a_walls, b_walls = [], [], []
    for r in range(args.rounds):
        load = os.getloadavg()[0]
        order = (2, args.workers) if r % 2 == 0 else (args.workers, 2)
        walls = {n: run(n) for n in order}
        a_walls.append(walls[2])
        b_walls.append(walls[args.workers])
        ratios.append(walls[args.workers] / walls[2])
        print(f"round {r + 1} (load {load:.2f}, order {order[0]} then {order[1]}): -n 2 {walls[2]:.1f}s, "
              f"-n {args.workers} {walls[args.workers]:.1f}s, ratio {ratios[-1]:.2f}", flush=True)
    p = Paired(ratios, statistics.median(a_walls), statistics.median(b_walls))
    print(f"median wall: -n 2 {p.a_seconds:.1f}s, -n {args.workers} {p.b_seconds:.1f}s")
    print(f"spread: {p.spread()}")
    print(f"-n {args.workers} / -n 2 wall ratio: {p.median:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
