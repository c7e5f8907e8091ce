"""Benchmark: a real-engine CPU cluster with and without SGLang's ``--sleep-on-idle``, paired.

Without the flag each SGLang scheduler spins a core whenever it has nothing to do. The live tests
run beside the unit tests on a two-core machine, and inside a cluster the router, the frontend
and the harness share the cores with three schedulers, so what matters is what an idle cluster
takes from its neighbours and whether sleeping slows the cluster's own requests. Each round starts
the nightly's topology (2 prefill + 1 decode, EAGLE3, the real SGLang engine on CPU: ``kvalign e2e
run --engine sglang-cpu``) once without the flag (A) and once with it (B), alternating the order,
and measures on each:

- **idle CPU**: CPU seconds the cluster's processes use per wall second over a quiet window;
- **neighbour**: iterations per second of a CPU-bound Python loop run during that window, the
  floor a unit test beside the cluster gets;
- **scenario**: the wall seconds of the run's four requests and its assertions (which must pass).

The report is the median of the per-round ratios B / A with their spread (``bench/paired.py``).

Usage: .venv/bin/python bench/bench_live_idle.py [--rounds 3] [--quiet 10]
The last lines are ``idle CPU B / A``, ``neighbour B / A`` and ``scenario B / A``.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paired import Paired, parse_rounds, rounds_parser  # noqa: E402

from kvalign.live.cluster.lifecycle import Cluster  # noqa: E402
from kvalign.live.cluster.processes import run_pids  # noqa: E402
from kvalign.live.runs import disagg_eagle  # noqa: E402
from kvalign.live.runs.disagg_eagle import E2eOptions  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of ``pids`` (Linux /proc; a process that exited counts 0)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return total / TICK


def neighbour(seconds: float) -> float:
    """Iterations per second of a CPU-bound loop over ``seconds``."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(2000):
            n += 1
    return n / seconds


def one(sleep_on_idle: bool, quiet: float, tmp: Path) -> tuple[float, float, float]:
    """(idle cluster cores, neighbour iterations/s, scenario seconds) of one cluster."""
    opts = E2eOptions(engine="sglang-cpu", bind_host="127.0.0.1")
    run_dir = Path(tempfile.mkdtemp(dir=tmp, prefix=f"idle-{int(sleep_on_idle)}-"))
    plan, kind = disagg_eagle.build(opts, run_dir)
    kind.sleep_on_idle = sleep_on_idle
    with Cluster(plan, kind, startup_timeout_s=opts.startup_timeout_s) as cluster:
        time.sleep(3)  # let start-up work (first compilations, registration) finish
        pids = run_pids(disagg_eagle.RUN_MARKER_ENV, str(plan.run_dir))
        c0, t0 = cpu_seconds(pids), time.perf_counter()
        rate = neighbour(quiet)
        cores = (cpu_seconds(pids) - c0) / (time.perf_counter() - t0)
        start = time.perf_counter()
        result = disagg_eagle.run(cluster, opts)
        took = time.perf_counter() - start
    if not result.passed:
        sys.exit(f"the scenario failed with sleep_on_idle={sleep_on_idle}:\n{result.report()}")
    return cores, rate, took


def main() -> int:
    ap = rounds_parser(__doc__, 3)
    ap.add_argument("--quiet", type=float, default=10.0, help="seconds of the idle window (default 10)")
    args = parse_rounds(ap)
    got: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="kvalign-bench-idle-") as tmp:
        for r in range(args.rounds):
            load = os.getloadavg()[0]
            order = (False, True) if r % 2 == 0 else (True, False)
            for side in order:
                got[side].append(one(side, args.quiet, Path(tmp)))
            a, b = got[False][-1], got[True][-1]
            print(f"round {r + 1} (load {load:.2f}, {'A then B' if order[0] is False else 'B then A'}): idle cores "
                  f"A {a[0]:.2f} B {b[0]:.2f}; neighbour A {a[1]:.3g}/s B {b[1]:.3g}/s; scenario A {a[2]:.1f}s "
                  f"B {b[2]:.1f}s", flush=True)
    names = ("idle CPU", "neighbour", "scenario")
    results = []
    for i, name in enumerate(names):
        a = [x[i] for x in got[False]]
        b = [x[i] for x in got[True]]
        p = Paired([y / max(x, 1e-9) for x, y in zip(a, b)], statistics.median(a), statistics.median(b))
        print(f"{name}: median A (spinning) {p.a_seconds:.3g}, B (--sleep-on-idle) {p.b_seconds:.3g}; {p.spread()}")
        results.append((name, p.median))
    for name, ratio in results:
        print(f"{name} B / A: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
