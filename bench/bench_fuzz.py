"""Benchmark: what the live fuzz costs per request, as a ratio to the same requests sent bare.

One real fuzz cluster (two aggregated ``dynamo.sglang`` EAGLE3 CPU workers behind the real frontend
and KV router, events through the lossy hop, kvalign capturing both sides). Each round runs the same
request sequence twice on it, in alternating order (A B, then B A), after a flush of every worker
(not timed), so both sides start from the same empty caches:

* **A, bare**: the requests posted with :func:`kvalign.live.wire.client.complete_tokens`, one after
  the other, nothing else;
* **B, fuzz**: the same requests as fuzz steps (:meth:`FuzzDriver.run_step`): settling on the
  event streams, both views' predictions, the metric scrapes for prefill reuse and speculation
  (one decode-worker scrape per speculation window of the fuzz's default ``--spec-window``), and
  every invariant, the example's last windows judged at its end.

A round gives one ratio B/A; the report is the median of the per-round ratios with their spread
(interquartile range, min..max). Goal: <= 1.3.

Usage: .venv/bin/python bench/bench_fuzz.py [--rounds N] [--requests N] [--spec-window N]
The last line is ``fuzz/bare ratio R (IQR Q1-Q3, min..max A..B, N paired rounds)``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvalign.live.runs.fuzz.driver import FuzzDriver  # noqa: E402
from kvalign.live.runs.fuzz.options import FuzzOptions  # noqa: E402
from kvalign.live.runs.fuzz.plan import fuzz_cluster  # noqa: E402
from kvalign.live.runs.fuzz.prompts import resolve  # noqa: E402
from kvalign.live.wire.client import complete_tokens  # noqa: E402


def sequence(n: int) -> list[dict[str, Any]]:
    """Request steps as the fuzz draws them: fresh prompts, extensions and follow-ups, 4-12 tokens out."""
    steps: list[dict[str, Any]] = []
    for i in range(n):
        if i % 3 == 0:
            prompt: dict[str, Any] = {"kind": "fresh", "seed": i, "length": 80 + 20 * (i % 4)}
        elif i % 3 == 1:
            prompt = {"kind": "extend", "of": i - 1, "cut": 64, "seed": i, "length": 130}
        else:
            prompt = {"kind": "follow_up", "of": i - 1, "seed": i, "extra": 17}
        steps.append({"rule": "request", "prompt": prompt, "max_tokens": 4 + 4 * (i % 3)})
    return steps


def bare(driver: FuzzDriver, steps: list[dict[str, Any]]) -> float:
    """Seconds to send ``steps`` with nothing around them (follow-ups resolved from the answers)."""
    from kvalign.live.runs.fuzz.prompts import Sent

    history: list[Sent] = []
    start = time.perf_counter()
    for step in steps:
        tokens = resolve(step["prompt"], history)
        c = complete_tokens(driver.cluster.frontend_url, driver.cluster.model, tokens, max_tokens=step["max_tokens"])
        history.append(Sent(tuple(tokens), tuple(c.completion_token_ids)))
    return time.perf_counter() - start


def fuzzed(driver: FuzzDriver, steps: list[dict[str, Any]]) -> float:
    """Seconds to run ``steps`` as one fuzz example, its last speculation windows judged at its end."""
    start = time.perf_counter()
    for step in steps:
        driver.run_step(step)
    driver.end_example()
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=9)
    ap.add_argument("--spec-window", type=int, default=FuzzOptions().spec_window,
                    help="the fuzz's --spec-window (1: a decode-worker scrape after every request)")
    args = ap.parse_args()
    opts = FuzzOptions(spec_window=args.spec_window)
    steps = sequence(args.requests)
    with tempfile.TemporaryDirectory(prefix="kvalign-bench-fuzz-") as tmp:
        with fuzz_cluster(opts, Path(tmp)) as (cluster, hop):
            driver = FuzzDriver(cluster, hop, opts)
            ratios, a_s, b_s = [], [], []
            for r in range(args.rounds):
                times = {}
                for side in (("A", "B") if r % 2 == 0 else ("B", "A")):
                    driver.begin_example()  # flush both workers, confirmed on the engine's stream
                    times[side] = bare(driver, steps) if side == "A" else fuzzed(driver, steps)
                    if side == "A":  # the bare requests moved the decode counters behind the fuzz's back
                        driver.metrics.forget()
                        driver.metrics.decode(list(driver.metrics.decode_urls))
                ratios.append(times["B"] / times["A"])
                a_s.append(times["A"] / len(steps))
                b_s.append(times["B"] / len(steps))
                print(f"round {r + 1}: bare {times['A']:.2f}s, fuzz {times['B']:.2f}s, ratio {ratios[-1]:.2f}",
                      flush=True)
            print(f"fuzz side: {driver.requests} requests checked, unsettled waits {driver.unsettled}, "
                  f"notes {driver.notes or 'none'}", flush=True)
            failed = {k: v for k, v in driver.tally.failed.items() if v}
            if failed:
                print(f"invariants failed during the benchmark: {failed}")
                return 1
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
    print(f"{len(steps)} requests per side, {args.rounds} rounds; per request: bare {statistics.median(a_s):.2f}s, "
          f"fuzz {statistics.median(b_s):.2f}s (medians)")
    print(f"fuzz/bare ratio {statistics.median(ratios):.2f} (IQR {q[0]:.2f}-{q[2]:.2f}, "
          f"min..max {min(ratios):.2f}..{max(ratios):.2f}, {args.rounds} paired rounds)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
