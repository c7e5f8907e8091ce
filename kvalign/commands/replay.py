"""``kvalign replay``: rebuild each worker's router index from captures and report what happened."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from kvalign.commands.options import positive_int
from kvalign.streams.replay import WorkerReplay, replay_captures
from kvalign.runtime_log import console


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="rebuild router indexes from captures and print replay stats")
    p.add_argument("captures", nargs="+", metavar="FILE", help="capture files, one per worker")
    p.add_argument("--worker", action="append", default=[], metavar="NAME",
                   help="name for the next capture's worker (repeat, in order; default: file name)")
    p.add_argument("--block-size", type=positive_int, default=None,
                   help="router kv_block_size (default: the capture's engine block size)")
    p.add_argument("--strict", action="store_true", help="fail on the first malformed batch instead of skipping it")
    p.add_argument("--json", action="store_true", help="print the stats as JSON")
    p.set_defaults(run=run)


def _worker_json(rep: WorkerReplay) -> dict:
    return {
        "worker": rep.name, "capture": rep.path, "encoding": rep.header.encoding, "batches": rep.batches,
        "events": rep.events, "seq_first": rep.seq.first, "seq_last": rep.seq.last,
        "gaps": [{"after": a, "next": b, "missing": b - a - 1} for a, b in rep.seq.gaps],
        "restarts": [{"after": a, "first": b} for a, b in rep.seq.restarts],
        "malformed_skipped": dict(rep.malformed), "held_blocks": rep.held, **asdict(rep.stats),
        "partial_tail_bytes": rep.issues.partial_tail_bytes, "unreadable_lines": rep.issues.bad_lines,
    }


def _worker_text(rep: WorkerReplay) -> list[str]:
    s, seq = rep.stats, rep.seq
    span = f"seq {seq.first}..{seq.last}" if seq.first is not None else "no sequence numbers"
    lines = [
        f"worker {rep.name} ({rep.path}): {rep.header.sglang or 'encoding unknown'}, {rep.batches} batches {span}",
        f"  blocks: {s.blocks_stored} stored, {s.blocks_indexed} indexed, {s.blocks_removed} removed, "
        f"{rep.held} held now; {s.clears} clears",
        f"  gaps: {len(seq.gaps)}" + (f" ({seq.missing_batches} batches missing: {seq.describe_gaps()})" if seq.gaps else "")
        + f"; restarts: {len(seq.restarts)}" + (f" (at seq {', '.join(str(b) for _, b in seq.restarts[:3])})" if seq.restarts else ""),
    ]
    if rep.malformed:
        counts = ", ".join(f"{why}: {n}" for why, n in rep.malformed.most_common())
        lines.append(f"  malformed batches skipped: {sum(rep.malformed.values())} ({counts})")
    lines.append(f"  relay dropped: {s.dropped_block_size} blocks (block size), {s.dropped_short_window} blocks "
                 f"(short window), {s.dropped_duplicate_events} events (duplicate hashes); "
                 f"orphan events: {s.dropped_orphans}")
    return lines


def run(args: argparse.Namespace) -> int:
    start, cpu = time.perf_counter(), time.process_time()
    index, reps = replay_captures(args.captures, args.worker, block_size=args.block_size, strict=args.strict)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    stored = sum(r.stats.blocks_stored for r in reps)
    for rep in reps:
        for problem in rep.issues.describe(rep.path):
            print(f"kvalign: warning: {problem}", file=console())
    if args.json:
        json.dump({"kv_block_size": index.kv_block_size, "seconds": round(elapsed, 6), "cpu_seconds": round(cpu, 6),
                   "workers": [_worker_json(r) for r in reps]}, sys.stdout)
        sys.stdout.write("\n")
        return 0
    for rep in reps:
        print("\n".join(_worker_text(rep)))
    rate = f"{stored / elapsed:,.0f} blocks/s" if elapsed > 0 else "n/a"
    print(f"index: kv_block_size {index.kv_block_size}, {len(reps)} workers; "
          f"replayed {stored} stored blocks in {elapsed:.2f}s ({rate})")
    return 0
