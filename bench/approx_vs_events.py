"""Measurement: how far the router's credit is from the engine's reuse, approximate mode next to events mode.

Runs ``kvalign e2e fuzz --json`` once per router mode on the same generated workloads (the same
seed draws the same steps: each workload's digest in the output shows it), on the real CPU engine
(two aggregated ``dynamo.sglang`` EAGLE3 workers behind the real frontend and KV router), and
prints, per mode and per workload, the error of the router's credit against what the worker
reused, request by request (``credit_error``, :mod:`kvalign.live.runs.fuzz.credit_error`):

* ``events``: the router indexes the workers' KV events (the default);
* ``approx ttl=120s``: ``--no-router-kv-events`` with Dynamo's default TTL policy;
* ``approx ttl=Ns``: the same with a short ``--router-ttl-secs`` (``--short-ttl``);
* ``approx lru``: ``--router-approximate-cache-policy lru`` (each worker's advertised capacity).

It is a measurement, not a pass/fail rule: approximate mode is expected to be wrong, and the
question users ask (dynamo #13425, #13701) is by how much. Each run starts its own cluster, one
after the other (a real-engine cluster peaks near 6 GiB); run it under the engine lock:

    flock /tmp/kvalign-engine.lock .venv/bin/python bench/approx_vs_events.py [--examples 3] [--steps 10] [--seed 48]

The last lines are one table row per mode: requests, exact, mean and worst |router - engine| tokens,
over- and under-credited requests.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def modes(short_ttl: float) -> list[tuple[str, list[str]]]:
    return [
        ("events", []),
        ("approx ttl=120s", ["--router-mode", "approx"]),
        (f"approx ttl={short_ttl:g}s", ["--router-mode", "approx", "--router-ttl", f"{short_ttl:g}"]),
        ("approx lru", ["--router-mode", "approx", "--approx-policy", "lru"]),
    ]


def run_one(extra: list[str], args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    cmd = [str(ROOT / ".venv" / "bin" / "kvalign"), "e2e", "fuzz", "--engine", "sglang-cpu", "--json",
           "--examples", str(args.examples), "--steps", str(args.steps), "--seed", str(args.seed),
           "--run-dir", str(run_dir), *extra]
    print(f"$ {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    start = time.monotonic()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, check=False)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"kvalign e2e fuzz exited {proc.returncode} (logs under {run_dir})")
    out = json.loads(proc.stdout)
    out["wall_s"] = round(time.monotonic() - start, 1)
    return out


def row(name: str, ce: dict[str, Any]) -> str:
    return (f"{name:<18} {ce['requests']:>8} {ce['exact']:>6} {str(ce['mean_abs_tokens']):>9} {str(ce['worst_abs_tokens']):>6} "
            f"{ce['overcredited']:>5} {ce['undercredited']:>6}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=48)
    p.add_argument("--short-ttl", type=float, default=5.0, help="the short --router-ttl-secs (default 5)")
    p.add_argument("--only", nargs="*", default=None, help="run only these modes (by name)")
    args = p.parse_args(argv)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvalign-approx-") as tmp:
        for i, (name, extra) in enumerate(modes(args.short_ttl)):
            if args.only and name not in args.only:
                continue
            results[name] = run_one(extra, args, Path(tmp) / f"run{i}")
            ce = results[name]["credit_error"]
            print(f"{name}: verdict {results[name]['verdict']}, {results[name]['requests']} requests in "
                  f"{results[name]['wall_s']}s; credit_error {json.dumps(ce)}", file=sys.stderr, flush=True)
    print("per workload (mean | worst |router - engine| tokens; workload = digest of its steps):")
    for name, out in results.items():
        cells = [f"{w['workload']}: {w['mean_abs_tokens']} | {w['worst_abs_tokens']} ({w['requests']} req)"
                 for w in out["credit_error"]["by_workload"]]
        print(f"  {name:<18} " + "; ".join(cells))
    print(f"{'mode':<18} {'requests':>8} {'exact':>6} {'mean|err|':>9} {'worst':>6} {'over':>5} {'under':>6}")
    for name, out in results.items():
        print(row(name, out["credit_error"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
