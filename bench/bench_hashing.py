"""Throughput of kvalign.hashing.block_hashes vs the Rust router binding, in one run.

Prints one row per case (prompt length x block size x mode) with tokens/s for both and the ratio
kvalign / binding (> 1 means kvalign is faster). Both get the same input a router gets: a Python
list of ints. Last line: ``min ratio at 128k tokens: X.XX``.

    .venv/bin/python bench/bench_hashing.py [--repeat N]
"""

from __future__ import annotations

import argparse
import random
import timeit

from dynamo._core import compute_block_hash_for_seq

from kvalign.hashing import block_hashes

LENGTHS = {"1k": 1024, "16k": 16 * 1024, "128k": 128 * 1024}


def best_seconds(fn, repeat: int) -> float:
    """Best-of-``repeat`` time per call, auto-ranged so each sample runs >= 0.2 s."""
    timer = timeit.Timer(fn)
    number, _ = timer.autorange()
    number = max(1, number)
    return min(timer.repeat(repeat=repeat, number=number)) / number


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(0)
    print(f"{'tokens':>6} {'B':>3} {'mode':>5} {'kvalign tok/s':>14} {'binding tok/s':>14} {'ratio':>6}")
    ratios_128k = []
    for label, n in LENGTHS.items():
        tokens = [rng.randrange(200_000) for _ in range(n)]
        for b in (16, 64):
            for eagle in (False, True):
                assert block_hashes(tokens, b, eagle=eagle) == compute_block_hash_for_seq(tokens, b, None, None, eagle, None)
                ours = best_seconds(lambda: block_hashes(tokens, b, eagle=eagle), args.repeat)
                theirs = best_seconds(lambda: compute_block_hash_for_seq(tokens, b, None, None, eagle, None), args.repeat)
                ratio = theirs / ours
                if label == "128k":
                    ratios_128k.append(ratio)
                print(f"{label:>6} {b:>3} {'eagle' if eagle else 'plain':>5} {n / ours:>14,.0f} {n / theirs:>14,.0f} {ratio:>6.2f}")
    print(f"min ratio at 128k tokens: {min(ratios_128k):.2f}")


if __name__ == "__main__":
    main()
