"""Paired timing: the only ratio a shared, noisy machine cannot flip.

Timing A, then B, best-of-N, lets a burst of load land on one side only: the same code gave ratios
0.68 and 1.01 in two runs. Here A and B alternate within every round (A B, then B A, so a drift
in load hits both equally), each round yields one ratio, and the report is the median of the
per-round ratios with their spread (interquartile range and min..max). A round times a batch of
calls sized so that one batch takes about ``target_s`` (default 1 ms, shorter than a scheduler
time slice, so a preemption spoils single rounds, which the median discards, rather than shifting
whole batches); the garbage collector is off while timing, as in :mod:`timeit`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Paired:
    """Per-round ratios ``time(B) / time(A)``: > 1 means A is faster (A's throughput / B's)."""

    ratios: list[float]
    a_seconds: float  # median seconds per call of A
    b_seconds: float

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def iqr(self) -> tuple[float, float]:
        q = statistics.quantiles(self.ratios, n=4, method="inclusive")
        return q[0], q[2]

    def spread(self) -> str:
        lo, hi = self.iqr
        return f"IQR {lo:.2f}-{hi:.2f}, min..max {min(self.ratios):.2f}..{max(self.ratios):.2f}"


def _batch_seconds(fn: Callable[[], object], calls: int) -> float:
    enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return time.perf_counter() - start
    finally:
        if enabled:
            gc.enable()


def _calls_for(fn: Callable[[], object], target_s: float) -> int:
    calls = 1
    while True:
        took = _batch_seconds(fn, calls)
        if took >= target_s / 4 or calls >= 1 << 20:
            return max(1, int(calls * target_s / max(took, 1e-9)))
        calls *= 4


def paired(a: Callable[[], object], b: Callable[[], object], *, rounds: int = 301, target_s: float = 0.001) -> Paired:
    """Alternate A and B for ``rounds`` rounds; one ratio per round (see the module docstring)."""
    a(), b()  # warm both (imports, caches, first-call allocation)
    calls = min(_calls_for(a, target_s), _calls_for(b, target_s))  # the slower side takes ~target_s
    ratios, ta_all, tb_all = [], [], []
    for r in range(rounds):
        if r % 2 == 0:
            ta = _batch_seconds(a, calls)
            tb = _batch_seconds(b, calls)
        else:
            tb = _batch_seconds(b, calls)
            ta = _batch_seconds(a, calls)
        ratios.append(tb / ta)
        ta_all.append(ta / calls)
        tb_all.append(tb / calls)
    return Paired(ratios, statistics.median(ta_all), statistics.median(tb_all))


def rounds_parser(doc: str, default_rounds: int) -> argparse.ArgumentParser:
    """The argument parser of a benchmark that runs whole rounds (a minute-long run, not a call):
    its description from the script's docstring and ``--rounds``; parse with :func:`parse_rounds`."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=default_rounds,
                    help=f"paired rounds, at least 2 (default {default_rounds})")
    return ap


def parse_rounds(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse, refusing fewer than two rounds: a spread needs two ratios."""
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (a spread needs two ratios)")
    return args
