"""Measurement: how far the router's credit is from the engine's reuse, approximate mode next to events mode.

One real fuzz cluster (two aggregated ``dynamo.sglang`` EAGLE3 CPU workers, the lossy hop, both
captures) and, per router mode, the same generated workloads (the same Hypothesis seed draws the
same steps; each workload's digest in the output shows it) run by ``kvalign e2e fuzz``'s own
machine and driver. Between modes only the frontend is restarted with the mode's flags (seconds;
the engine keeps running, and every workload starts by flushing both workers):

* ``events``: the router indexes the workers' KV events (the default);
* ``approx ttl=120s``: ``--no-router-kv-events``, Dynamo's default TTL policy;
* ``approx ttl=Ns``: the same with a short ``--router-ttl-secs`` (``--short-ttl``, default 5);
* ``approx lru``: ``--router-approximate-cache-policy lru`` (each worker's advertised capacity).

Per request the figure is the router's credit on the worker it chose (tokens, recovered exactly
from ``kv_hit_rate``) minus what that worker reused (``credit_error``,
:mod:`kvalign.live.runs.fuzz.credit_error`). A measurement, not a pass/fail rule: approximate mode
is expected to be wrong, and the question users ask (dynamo #13425, #13701) is by how much. Run it
under the engine lock:

    flock /tmp/kvalign-engine.lock .venv/bin/python bench/approx_vs_events.py [--examples 3] [--steps 10] [--seed 48]

The last lines are one row per mode: requests, exact, mean and worst |router - engine| tokens,
over- and under-credited requests (and the tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvalign.live.cluster.routers import RouterSetup
from kvalign.live.runs.fuzz.driver import FuzzDriver
from kvalign.live.runs.fuzz.options import FuzzOptions
from kvalign.live.runs.fuzz.plan import fuzz_cluster
from kvalign.live.runs.fuzz.machine import run_fuzz


def modes(short_ttl: float) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("events", {}),
        ("approx ttl=120s", {"router_mode": "approx"}),
        (f"approx ttl={short_ttl:g}s", {"router_mode": "approx", "router_ttl": short_ttl}),
        ("approx lru", {"router_mode": "approx", "approx_policy": "lru"}),
    ]


def row(name: str, ce: dict[str, Any]) -> str:
    return (f"{name:<16} {ce['requests']:>8} {ce['exact']:>6} {str(ce['mean_abs_tokens']):>10} {str(ce['worst_abs_tokens']):>6} "
            f"{ce['overcredited']:>5} {ce['overcredited_tokens']:>8} {ce['undercredited']:>6} {ce['undercredited_tokens']:>8}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=48)
    p.add_argument("--short-ttl", type=float, default=5.0, help="the short --router-ttl-secs (default 5)")
    p.add_argument("--only", nargs="*", default=None, help="run only these modes (by name)")
    args = p.parse_args(argv)
    start = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvalign-approx-") as tmp, \
            fuzz_cluster(FuzzOptions(), Path(tmp) / "cluster") as (cluster, hop):
        say(f"cluster ready: {', '.join(f'{n}={h.instance_id}' for n, h in cluster.workers.items())}")
        for name, kw in modes(args.short_ttl):
            if args.only and name not in args.only:
                continue
            opts = FuzzOptions(**kw)
            setup: RouterSetup = opts.router_setup()
            if cluster.plan.routers != setup:
                say(f"{name}: frontend restarted in {cluster.restart_router(0, routers=setup):.1f}s "
                    f"({' '.join(setup.flags(0)) or 'events mode'})")
            driver = FuzzDriver(cluster, hop, opts, progress=lambda _m: None)
            t0 = time.monotonic()
            res = run_fuzz(driver, examples=args.examples, steps=args.steps, seed=args.seed, shrink_seconds=0,
                           script_path=Path(tmp) / f"{name.replace(' ', '_')}-failure.json", report=lambda _m: None)
            out = res.as_json()
            results[name] = out
            say(f"{name}: verdict {out['verdict']}, {out['requests']} requests in {time.monotonic() - t0:.0f}s; "
                f"credit_error {json.dumps({k: v for k, v in out['credit_error'].items() if k != 'by_workload'})}")
            if out["failure"]:
                say(f"{name}: failure {json.dumps(out['failure'])[:400]}")
    print("per workload (mean | worst |router - engine| tokens; workload = digest of its steps):")
    for name, out in results.items():
        cells = [f"{w['workload']}: {w['mean_abs_tokens']} | {w['worst_abs_tokens']} ({w['requests']} req)"
                 for w in out["credit_error"]["by_workload"]]
        print(f"  {name:<16} " + "; ".join(cells))
    print(f"{'mode':<16} {'requests':>8} {'exact':>6} {'mean|err|':>10} {'worst':>6} {'over':>5} {'over_tok':>8} "
          f"{'under':>6} {'under_tok':>8}")
    for name, out in results.items():
        print(row(name, out["credit_error"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
