"""Benchmark: ``kvalign check``'s HiCache rows (tier, servable), paired: this tree against a commit.

The tier and servable rows are the part of the default ``kvalign check`` whose cost moved with issue
28 (every request through SGLang's own scheduler code, a bounded device pool, 60 servable examples
per row); the other rows do not touch that code. A is the commit REF, exported with ``git archive``
(``bench_fast_tier.export``) and run with that directory first on ``PYTHONPATH``; B is this tree.
Each round runs ``python -m kvalign check --property tier --property servable --json`` once per side,
alternating the order (A B, then B A), and takes the seconds the rows report (the command's
``"seconds"``: import and set-up left out) and the wall seconds; the report is the median of the
per-round ratios B / A with their spread (``bench/paired.py``'s :class:`Paired`). A run must exit
0 or 1 (1: the servable finding) with a JSON report, or the benchmark stops.

Usage: .venv/bin/python bench/bench_check_hicache.py --against REF [--rounds 3] [--page-size N]
The last line is ``B / A rows ratio: X``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fast_tier import export  # noqa: E402
from paired import Paired, parse_rounds, rounds_parser  # noqa: E402


def run(tree: Path, label: str, page_size: int | None) -> tuple[float, float]:
    """(seconds in the rows, wall seconds) of one check of the HiCache rows from ``tree``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "kvalign", "check", "--property", "tier", "--property", "servable", "--json"]
    if page_size:
        cmd += ["--page-size", str(page_size)]
    start = time.perf_counter()
    res = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if res.returncode not in (0, 1) or not res.stdout.strip():
        sys.exit(f"kvalign check failed ({label}, exit {res.returncode}):\n{res.stderr[-2000:]}")
    return float(json.loads(res.stdout.strip().splitlines()[-1])["seconds"]), wall


def main() -> int:
    ap = rounds_parser(__doc__, 3)
    ap.add_argument("--against", metavar="REF", required=True, help="A is the commit REF, B this tree")
    ap.add_argument("--page-size", type=int, default=None, help="check --page-size (default: every size)")
    args = parse_rounds(ap)
    with tempfile.TemporaryDirectory(prefix="bench-check-hicache-") as tmp:
        sides = {"A": export(args.against, Path(tmp)), "B": ROOT}
        print(f"A = {args.against}; B = this tree; page size {args.page_size or 'every'}", flush=True)
        ratios, walls, rows = [], {"A": [], "B": []}, {"A": [], "B": []}
        for r in range(args.rounds):
            load = os.getloadavg()[0]
            for label in ("A", "B") if r % 2 == 0 else ("B", "A"):
                seconds, wall = run(sides[label], label, args.page_size)
                rows[label].append(seconds)
                walls[label].append(wall)
            ratios.append(rows["B"][-1] / rows["A"][-1])
            print(f"round {r + 1} (load {load:.2f}): rows A {rows['A'][-1]:.1f}s B {rows['B'][-1]:.1f}s "
                  f"(wall A {walls['A'][-1]:.1f}s B {walls['B'][-1]:.1f}s), ratio {ratios[-1]:.2f}", flush=True)
    p = Paired(ratios, statistics.median(rows["A"]), statistics.median(rows["B"]))
    print(f"median rows: A {p.a_seconds:.1f}s, B {p.b_seconds:.1f}s; median wall: A "
          f"{statistics.median(walls['A']):.1f}s, B {statistics.median(walls['B']):.1f}s")
    print(f"spread: {p.spread()}")
    print(f"B / A rows ratio: {p.median:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
