"""Benchmark: ``kvalign matrix`` cold and warm, before and after per-release environments, paired.

Before (A) is a commit whose matrix installs releases with ``pip --target`` and runs each pair
under a ``PYTHONPATH`` overlay (default ``c372bbc``, exported with ``git archive``); after (B) is
this checkout (uv installs, each pair in an environment of its own, :mod:`kvalign.releases.release_env`).
Each round runs both sides, alternating the order (A B, then B A), and each side runs twice:

- **cold**: an empty wheel cache *and* an empty installer cache (``PIP_CACHE_DIR`` /
  ``UV_CACHE_DIR`` under the round's own directory), so every wheel is downloaded and installed;
- **warm**: the same command again on the cache the cold run filled (nothing to install; what is
  left is building, or reusing, the pair's environment and the checks themselves).

The report is the median of the per-round ratios B / A with their spread (``bench/paired.py``'s
:class:`Paired`) and each side's median seconds. Both sides must give the same findings for every
pair (a differential check: the new environments must not change a verdict), else it stops.

Usage: .venv/bin/python bench/bench_matrix_install.py [--rounds 3] [--before c372bbc]
       [--dynamo 1.5.1] [--sglang 0.5.19,0.5.21]
The last two lines are ``cold B / A ratio: X`` and ``warm B / A ratio: Y``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from paired import Paired, parse_rounds, rounds_parser  # noqa: E402


def export(ref: str, where: Path) -> Path:
    """The tree of ``ref`` in ``where`` (``git archive``: no worktree left behind)."""
    where.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def run(tree: Path, cache: Path, argv: list[str]) -> tuple[float, dict[tuple[str, str], list[tuple[str, ...]]]]:
    """Wall seconds of one ``kvalign matrix`` run of ``tree`` on ``cache``, and each pair's findings."""
    env = {**os.environ, "PYTHONPATH": str(tree), "KVALIGN_WHEEL_CACHE": str(cache / "wheels"),
           "PIP_CACHE_DIR": str(cache / "pip"), "UV_CACHE_DIR": str(cache / "uv"), "KVALIGN_LOG_DIR": str(cache / "logs")}
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "kvalign", "matrix", *argv, "--json"], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=3600)
    took = time.perf_counter() - start
    if res.returncode not in (0, 1):
        sys.exit(f"matrix of {tree} exited {res.returncode}:\n{res.stderr[-3000:]}")
    rows = json.loads(res.stdout.splitlines()[-1])["rows"]
    errors = [r for r in rows if r["verdict"] == "error"]
    if errors:
        sys.exit(f"matrix of {tree}: error rows {errors}")
    return took, {(r["dynamo"], r["sglang"]): sorted((f["property"], f["mode"], f["variant"], f["cause"])
                                                     for f in r["findings"]) for r in rows}


def main() -> int:
    ap = rounds_parser(__doc__, 3)
    ap.add_argument("--before", default="c372bbc", help="the commit A runs (pip --target + PYTHONPATH)")
    ap.add_argument("--dynamo", default="1.5.1")
    ap.add_argument("--sglang", default="0.5.19,0.5.21")
    ap.add_argument("--examples", default="10")
    args = parse_rounds(ap)
    argv = ["--dynamo", args.dynamo, "--sglang", args.sglang, "--examples", args.examples, "--ingest-examples", "3",
            "--property", "card", "--property", "hash", "--property", "pages"]
    with tempfile.TemporaryDirectory(prefix="kvalign-bench-matrix-") as tmp:
        trees = {"A": export(args.before, Path(tmp) / "before"), "B": ROOT}
        cold: dict[str, list[float]] = {"A": [], "B": []}
        warm: dict[str, list[float]] = {"A": [], "B": []}
        for r in range(args.rounds):
            load = os.getloadavg()[0]
            order = ("A", "B") if r % 2 == 0 else ("B", "A")
            findings = {}
            for side in order:
                cache = Path(tmp) / f"round{r}-{side}"
                took, findings[side] = run(trees[side], cache, argv)
                cold[side].append(took)
                took, again = run(trees[side], cache, argv)
                warm[side].append(took)
                if again != findings[side]:
                    sys.exit(f"{side}: the warm run's findings differ from the cold run's: {findings[side]} vs {again}")
                shutil.rmtree(cache)
            if findings["A"] != findings["B"]:
                sys.exit(f"before and after disagree: {findings['A']} vs {findings['B']}")
            print(f"round {r + 1} (load {load:.2f}, order {order[0]} then {order[1]}): cold A {cold['A'][-1]:.1f}s "
                  f"B {cold['B'][-1]:.1f}s, warm A {warm['A'][-1]:.1f}s B {warm['B'][-1]:.1f}s; same findings on "
                  f"{len(findings['A'])} pair(s)", flush=True)
    for name, walls in (("cold", cold), ("warm", warm)):
        p = Paired([b / a for a, b in zip(walls["A"], walls["B"])], statistics.median(walls["A"]),
                   statistics.median(walls["B"]))
        print(f"{name}: median A (before) {p.a_seconds:.1f}s, B (after) {p.b_seconds:.1f}s; {p.spread()}")
    for name, walls in (("cold", cold), ("warm", warm)):
        print(f"{name} B / A ratio: {statistics.median(b / a for a, b in zip(walls['A'], walls['B'])):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
