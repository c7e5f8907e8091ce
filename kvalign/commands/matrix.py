"""``kvalign matrix``: ``kvalign check`` across real Dynamo x SGLang releases, one table.

``--shipped`` adds, for each Dynamo release, the SGLang its ``ai-dynamo[sglang]`` extra pins (the
pair a deployment actually runs); the default matrix includes those pairs, an explicit ``--sglang``
list alone does not.

Exit 0 all pairs aligned, 1 any pair misaligned, 2 environment error (a release that cannot be
installed or checked, or the index cannot be read).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvalign.errors import UsageError
from kvalign.matrix import (DEFAULT_SGLANG, LIVE_COLUMN, MatrixError, PairResult, cache_root, default_dynamo_versions,
                            one_line, plan_pairs, run_live, run_matrix, shipped_sglang, table)
from kvalign.runtime_log import console
from kvalign.versions import installed_versions

VERSION = r"^\d+(\.\d+)*(\.post\d+)?$"


def _versions(text: str | None, flag: str) -> list[str] | None:
    if text is None:
        return None
    import re

    versions = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in versions if not re.match(VERSION, v)]
    if not versions or bad:
        raise UsageError(f"{flag} takes comma-separated release versions, got {text!r}")
    return list(dict.fromkeys(versions))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("matrix", help="run check for every Dynamo x SGLang release pair (wheels cached per version)")
    p.add_argument("--dynamo", metavar="V1,V2,...", default=None,
                   help="ai-dynamo releases (default: every ai-dynamo-runtime release 1.0.0 .. 1.6.1 on the index)")
    p.add_argument("--sglang", metavar="S1,S2,...", default=None,
                   help=f"sglang releases (default: {','.join(DEFAULT_SGLANG)} plus each Dynamo release's shipped one)")
    p.add_argument("--shipped", action="store_true",
                   help="add each Dynamo release's own SGLang (the ai-dynamo[sglang] pin in its wheel metadata); "
                        "alone, check only those pairs")
    p.add_argument("--jobs", type=int, default=2, help="pairs checked at once (default 2)")
    p.add_argument("--examples", type=int, default=100, help="check --examples per pair (default 100)")
    p.add_argument("--ingest-examples", type=int, default=20, help="check --ingest-examples per pair (default 20)")
    p.add_argument("--live", action="store_true",
                   help="also run the seed scenario (kvalign e2e run --engine sglang-cpu) per pair, one at a time, "
                        f"as column {LIVE_COLUMN!r} (real CPU engines: ~3 min and ~6 GiB per pair)")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {args.jobs}")
    if args.examples < 1 or args.ingest_examples < 1:
        raise UsageError("--examples and --ingest-examples must be >= 1")
    sglang = _versions(args.sglang, "--sglang")
    shipped = args.shipped or sglang is None
    if sglang is None:
        sglang = [] if args.shipped else list(DEFAULT_SGLANG)
    dynamo = _versions(args.dynamo, "--dynamo")
    start = time.perf_counter()
    try:
        dynamo = dynamo or default_dynamo_versions()
    except MatrixError as exc:
        raise UsageError(str(exc)) from None
    err = console()
    log = lambda m: print(f"  {m}", file=err, flush=True)  # noqa: E731
    pairs, unknown = plan_pairs(dynamo, sglang, shipped=shipped, pinned=lambda d: shipped_sglang(d, log=log))
    extra = sum(p.shipped for p in pairs if p.sglang not in sglang)
    print(f"kvalign matrix: {len(dynamo)} Dynamo x {len(sglang)} SGLang releases"
          + (f" + {extra} shipped pairs" if extra else "") + f" = {len(pairs)} pairs, "
          f"{args.jobs} at a time; wheel cache {cache_root()}", file=err, flush=True)

    def progress(r: PairResult, done: int, total: int) -> None:
        what = r.verdict if r.verdict != "misaligned" else f"misaligned ({len(r.findings)} rows)"
        print(f"  [{done}/{total}] dynamo {r.dynamo} x sglang {r.sglang}: {what} in {r.seconds:.0f}s"
              + (f" — {one_line(r.error)}" if r.error else ""), file=err, flush=True)

    results = run_matrix(pairs, examples=args.examples, ingest_examples=args.ingest_examples, jobs=args.jobs,
                         progress=progress, log=log)
    if args.live:  # one at a time: each starts three real engine processes
        for i, r in enumerate(results, 1):
            r.live = run_live(r.dynamo, r.sglang, log=log)
            print(f"  [live {i}/{len(results)}] dynamo {r.dynamo} x sglang {r.sglang}: {r.live['verdict']} "
                  f"in {r.live['seconds']:.0f}s — {r.live['detail']}", file=err, flush=True)
    results += [PairResult(d, "unknown", "error", error=f"shipped SGLang unknown: {why}", shipped=True)
                for d, why in unknown.items()]
    wall = time.perf_counter() - start
    if args.json:
        json.dump({"versions": installed_versions(), "rows": [r.as_json() for r in results]}, sys.stdout, ensure_ascii=False)
        sys.stdout.write("\n")
    else:
        print(table(results))
        for r in results:
            if r.verdict == "error":
                print(f"\n{r.dynamo} x {r.sglang}: error: {one_line(r.error or 'unknown error')}")
    print(f"kvalign matrix: {len(results)} pairs in {wall:.0f}s wall "
          f"({sum(r.verdict == 'aligned' for r in results)} aligned, "
          f"{sum(r.verdict == 'misaligned' for r in results)} misaligned, "
          f"{sum(r.verdict == 'error' for r in results)} error)", file=err, flush=True)
    if any(r.verdict == "error" or (r.live or {}).get("verdict") == "error" for r in results):
        return 2
    return 1 if any(r.verdict == "misaligned" or (r.live or {}).get("verdict") == "fail" for r in results) else 0
