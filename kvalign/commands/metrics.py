"""``kvalign metrics URL``: scrape a worker's /metrics and print its spec-decode and KV figures.

For a quick look at a live decode worker (``DYN_SYSTEM_PORT``'s /metrics) without Grafana: the
speculative-decoding series, the KV/cache series, and tokens per verify step from both the
gauge and the hand-off-corrected counters (lifetime values; the e2e run uses windows).
"""

from __future__ import annotations

import argparse
import json
import sys

from kvalign.errors import UsageError
from kvalign.live.wire import metrics as m

_SPEC_COUNTERS = (m.GENERATION_TOKENS, m.FINISHED_REQUESTS)
_KV_MARKERS = ("kv", "cache_hit", "cached_tokens")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("metrics", help="scrape a worker's /metrics and print spec-decode and KV metrics")
    p.add_argument("url", help="metrics URL, e.g. http://127.0.0.1:8081/metrics (the worker's DYN_SYSTEM_PORT)")
    p.add_argument("--timeout", type=float, default=5.0, help="HTTP timeout in seconds (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run)


def selected(snap: m.MetricsSnapshot) -> list[str]:
    """Sample names worth showing: every ``sglang:spec_*`` series, the counters the cross-check
    needs, and anything about KV or cache hits (SGLang's and Dynamo's)."""
    out = []
    for name in snap.names():
        if name.endswith(("_created", "_bucket")):
            continue
        if name.startswith("sglang:spec_") or name in _SPEC_COUNTERS or any(k in name for k in _KV_MARKERS):
            out.append(name)
    return out


def run(args: argparse.Namespace) -> int:
    snap = m.scrape(args.url, timeout=args.timeout)
    names = selected(snap)
    if not names:
        raise UsageError(
            f"no spec-decode or KV metrics at {args.url} ({len(snap.names())} other series): "
            "start the worker with --enable-metrics and a positive DYN_SYSTEM_PORT"
        )
    rows = []
    for name in names:
        kind = snap.type_of(name)
        value = snap.mean(name) if kind == "gauge" else snap.total(name)
        rows.append((name, kind, len(snap.values(name)), value))
    verify, gen, done = (snap.total(n) for n in (m.SPEC_VERIFY_CALLS, m.GENERATION_TOKENS, m.FINISHED_REQUESTS))
    tpv = (gen - done) / verify if verify > 0 else None
    if args.json:
        json.dump({
            "url": args.url,
            "metrics": {n: {"type": k, "label_sets": c, "value": v} for n, k, c, v in rows},
            "tokens_per_verify_counters": tpv,
            "spec_accept_length": snap.mean(m.SPEC_ACCEPT_LENGTH),
        }, sys.stdout)
        sys.stdout.write("\n")
        return 0
    width = max(len(n) for n in names)
    print(f"{'metric':<{width}}  {'type':<9} {'sets':>4}  value")
    for name, kind, count, value in rows:
        print(f"{name:<{width}}  {kind:<9} {count:>4}  {value:g}")
    print("counters summed across label sets; gauges averaged")
    if tpv is None:
        print("tokens per verify (counters, since start): n/a, no verify calls yet")
    else:
        print(f"tokens per verify (counters, since start): ({gen:g} - {done:g}) / {verify:g} = {tpv:.3f}")
    gauge = snap.mean(m.SPEC_ACCEPT_LENGTH)
    print(f"tokens per verify (spec_accept_length gauge, last refresh): {'n/a' if gauge is None else f'{gauge:.3f}'}")
    return 0
