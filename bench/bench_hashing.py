"""Throughput of kvalign.model.hashing.block_hashes vs the Rust router binding, measured in pairs.

Both get the input a router gets: a Python list of token ids. For each case (prompt length x
block size x mode) the two calls alternate round by round (see ``bench/paired.py``); the ratio is
kvalign / binding throughput (> 1: kvalign is faster), reported as the median of the per-round
ratios with its spread. Targets (issue 10): median >= 1.0 in every case, >= 1.3 at 128k tokens.

    .venv/bin/python bench/bench_hashing.py [--rounds N] [--sizes 1k,4k,128k]

Every case is first checked for equal output. The last lines are ``min median ratio: X`` and
``min median ratio at 128k tokens: X``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dynamo._core import compute_block_hash_for_seq  # noqa: E402
from paired import paired  # noqa: E402

from kvalign.model.hashing import block_hashes  # noqa: E402

SIZES = {f"{k}k": k * 1024 for k in (1, 2, 4, 8, 16, 32, 64, 128)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=301, help="paired rounds per case (default 301)")
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated prompt lengths (default: all)")
    parser.add_argument("--target-s", type=float, default=0.001, help="seconds per timed batch (default 0.001)")
    args = parser.parse_args()
    rng = random.Random(0)
    versions = ", ".join(f"{pkg} {importlib.metadata.version(pkg)}" for pkg in ("ai-dynamo-runtime", "xxhash", "numpy"))
    print(f"python {platform.python_version()}, {versions}; {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}; {args.rounds} paired rounds per case")
    print(f"{'tokens':>6} {'B':>3} {'mode':>5} {'kvalign tok/s':>14} {'binding tok/s':>14} {'ratio':>6}  spread")
    medians: dict[tuple[str, int, bool], float] = {}
    for label in args.sizes.split(","):
        n = SIZES[label]
        tokens = [rng.randrange(200_000) for _ in range(n)]
        for b in (16, 64):
            for eagle in (False, True):
                ours = block_hashes(tokens, b, eagle=eagle)
                assert ours == compute_block_hash_for_seq(tokens, b, None, None, eagle, None), (label, b, eagle)
                p = paired(lambda: block_hashes(tokens, b, eagle=eagle),
                           lambda: compute_block_hash_for_seq(tokens, b, None, None, eagle, None),
                           rounds=args.rounds, target_s=args.target_s)
                medians[(label, b, eagle)] = p.median
                print(f"{label:>6} {b:>3} {'eagle' if eagle else 'plain':>5} {n / p.a_seconds:>14,.0f} "
                      f"{n / p.b_seconds:>14,.0f} {p.median:>6.2f}  {p.spread()}", flush=True)
    print(f"min median ratio: {min(medians.values()):.2f}")
    big = [v for (label, _, _), v in medians.items() if label == "128k"]
    if big:
        print(f"min median ratio at 128k tokens: {min(big):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
