"""Benchmark: replay + diagnose on a capture of 1,000,000 stored blocks, as a ratio to a floor.

The capture is made the way a real one is: SGLang's real radix cache (CPU) serves a synthetic
multi-tenant workload (shared system prompts + unique continuations, EAGLE bigram keys, page 16),
its events are encoded by SGLang's own msgpack encoder into ``[topic, seq, payload]`` frames
exactly as ``ZmqEventPublisher`` sends them (0.5.23 tagged-map encoding), decoded by kvalign and
written by the capture writer. Generation is not timed.

Replay throughput means little on its own on a shared machine, so it is reported as a ratio to a
floor measured in the same process, in pairs (``bench/paired.py``): the floor is the time to merely
read the capture's lines and decode them with msgspec into the capture's own types; the ratio is
floor seconds / replay seconds (1.0 = replay costs nothing beyond reading the file; target >= 0.5,
i.e. replay takes at most twice the floor), as the median of per-round ratios with its spread.

Then ``kvalign replay FILE --json`` and ``kvalign diagnose`` run as child processes for their peak
RSS (from ``wait4``) and the end-to-end wall time.

Usage: .venv/bin/python bench/bench_replay.py [--blocks N] [--rounds N] [--keep FILE [--reuse]]
The last two lines are ``replay / floor ratio: X`` and ``blocks/s: N`` (median paired round).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import msgspec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from paired import paired  # noqa: E402

from kvalign.streams.capture import Batch, CaptureWriter  # noqa: E402
from kvalign.model.events import decode_frames  # noqa: E402
from kvalign.oracles.sglang import SglangRadixCache, _modules  # noqa: E402
from kvalign.streams.replay import replay_captures  # noqa: E402

PAGE = 16
PREFIXES = 64
PREFIX_TOKENS = 8 * PAGE
REQUEST_TOKENS = 64 * PAGE + 1  # 64 bigram pages per request
VOCAB = 151_000


def generate(path: str, blocks: int, seed: int = 0) -> tuple[int, list[int]]:
    """Fill ``path`` with a capture of at least ``blocks`` stored blocks; returns (stored, a cached prompt)."""
    _modules()
    from sglang.srt.disaggregation.kv_events import KVEventBatch

    encode = msgspec.msgpack.Encoder().encode  # what ZmqEventPublisher's thread uses
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(PREFIX_TOKENS)] for _ in range(PREFIXES)]
    cache = SglangRadixCache(PAGE, eagle=True)
    writer = CaptureWriter(path, force=True, endpoint="tcp://127.0.0.1:5557 (bench)", topic="kv-events")
    stored, seq, prompt = 0, 0, []
    while stored < blocks:
        events = []
        for _ in range(8):  # a scheduler step publishes what several requests cached
            toks = prefixes[rng.randrange(PREFIXES)] + [rng.randrange(VOCAB) for _ in range(REQUEST_TOKENS - PREFIX_TOKENS)]
            cache.insert(toks)
            prompt = toks
            events += cache.take_raw_events()
        if seq % 16 == 15:  # some memory pressure: whole leaves are evicted
            cache.evict(4 * REQUEST_TOKENS)
            events += cache.take_raw_events()
        stored += sum(len(e.block_hashes) for e in events if type(e).__name__.startswith("BlockStored"))
        payload = encode(KVEventBatch(ts=time.time(), events=events, attn_dp_rank=0))
        writer.write_batch(decode_frames([b"kv-events", seq.to_bytes(8, "big"), payload]))
        seq += 1
    writer.close()
    return stored, prompt


def run_child(argv: list[str]) -> tuple[str, float, float, int]:
    """Run a child process; (stdout, wall seconds, its own peak RSS in MiB, exit code)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return out, time.perf_counter() - start, usage.ru_maxrss / 1024, proc.returncode


def kvalign(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvalign", *args]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--keep", default=None, help="write the capture (and FILE.prompt.json) here and keep them")
    ap.add_argument("--reuse", action="store_true", help="with --keep: time the capture already there, if any")
    ap.add_argument("--rounds", type=int, default=7, help="paired replay/floor rounds (default 7)")
    ap.add_argument("--generate-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.generate_only:  # runs as its own process, so the timed children never inherit its memory
        stored, prompt = generate(args.keep, args.blocks)
        with open(args.keep + ".prompt.json", "w") as f:
            json.dump(prompt, f)
        print(stored)
        return 0
    tmp = None
    if args.keep:
        path = args.keep
    else:
        tmp = tempfile.TemporaryDirectory(prefix="kvalign-bench-")
        path = os.path.join(tmp.name, "bench.jsonl")
    prompt_path = path + ".prompt.json"
    if args.reuse and os.path.exists(path) and os.path.exists(prompt_path):
        print(f"reusing {path} ({os.path.getsize(path) / 2**20:.0f} MiB)")
    else:
        out, gen_s, gen_rss, rc = run_child([sys.executable, __file__, "--generate-only", "--keep", path,
                                             "--blocks", str(args.blocks)])
        if rc != 0:
            print(f"generation failed with exit code {rc}", file=sys.stderr)
            return 1
        print(f"generated {int(out)} stored blocks with SGLang's real radix cache + encoder in {gen_s:.1f}s: "
              f"{path} ({os.path.getsize(path) / 2**20:.0f} MiB)")

    decode = msgspec.json.Decoder(Batch).decode

    def floor() -> None:
        with open(path, "rb") as f:
            f.readline()  # the header
            for line in f:
                decode(line)

    stats: list = []

    def replay() -> None:
        stats.append(replay_captures([path])[1][0])

    p = paired(replay, floor, rounds=args.rounds, target_s=0.001)
    w = stats[-1]
    stored = w.stats.blocks_stored
    print(f"replay: {stored} stored / {w.stats.blocks_indexed} indexed / {w.stats.blocks_removed} removed blocks, "
          f"{w.batches} batches; median round: replay {p.a_seconds:.2f}s ({stored / p.a_seconds:,.0f} blocks/s), "
          f"floor (read + msgspec decode) {p.b_seconds:.2f}s")
    print(f"replay / floor throughput ratio: {p.median:.2f} ({p.spread()}, {len(p.ratios)} paired rounds; "
          f"target >= 0.5)")

    out, wall, rss, rc = run_child(kvalign("replay", path, "--json"))
    if rc != 0:
        print(f"replay failed with exit code {rc}", file=sys.stderr)
        return 1
    rep = json.loads(out)
    print(f"kvalign replay (child process): {rep['seconds']:.2f}s ({rep['cpu_seconds']:.2f}s CPU; wall {wall:.2f}s incl. "
          f"interpreter start-up); peak RSS {rss:.0f} MiB")

    out, dwall, drss, drc = run_child(kvalign("diagnose", "--capture", path, "--prompt", prompt_path, "--json"))
    if drc not in (0, 1):
        print(f"diagnose failed with exit code {drc}", file=sys.stderr)
        return 1
    diag = json.loads(out)
    print(f"diagnose: {dwall:.2f}s wall incl. start-up; peak RSS {drss:.0f} MiB; router overlap "
          f"{diag['router']['overlap']}/{diag['router']['blocks']}, cause {diag['cause']['name'] if diag['cause'] else None}")
    print(f"peak RSS: replay {rss:.0f} MiB, diagnose {drss:.0f} MiB")
    if tmp is not None:
        tmp.cleanup()
    print(f"replay / floor ratio: {p.median:.2f}")
    print(f"blocks/s: {int(stored / p.a_seconds)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
