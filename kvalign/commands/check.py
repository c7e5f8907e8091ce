"""``kvalign check``: are the router's block keys and SGLang's radix-cache keys aligned?

Runs the differential properties over the whole router path of the installed pair — the card
``dynamo.sglang`` registers, the router hasher (default: the installed Dynamo binding), SGLang's
real radix cache, and SGLang's published events through Dynamo's real worker relay into a real
router — in plain and EAGLE mode, with LoRA / namespace variants. Exit 0 aligned, 1 misaligned,
2 usage or environment error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvalign.commands import check_text
from kvalign.commands.options import positive_int
from kvalign.verify.check import run_check
from kvalign.verify.impact import assess, blocking
from kvalign.verify.rows import (DEFAULT_PROPERTIES, EVENT_FORMATS, EVENT_PROPERTIES, MODES, PROPERTIES, VARIANTS, RowResult,
                                 row_json)
from kvalign.errors import UsageError
from kvalign.oracles.sglang import KINDS
from kvalign.runtime_log import console
from kvalign.releases.versions import installed_versions


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="differential alignment check: router hasher vs SGLang radix cache")
    p.add_argument("--examples", type=int, default=200, help="generated cases per property x mode x variant (default 200)")
    p.add_argument("--router-hash", metavar="MODULE:FUNC", default=None,
                   help="router hasher to test (signature of dynamo._core.compute_block_hash_for_seq); "
                        "default: the installed Dynamo router")
    p.add_argument("--cache", choices=KINDS, default="default",
                   help="SGLang cache class: the one this release's server builds (default: UnifiedRadixCache from "
                        "0.5.19 on, RadixCache before), UnifiedRadixCache, its Python core, or RadixCache")
    p.add_argument("--property", dest="props", action="append", choices=PROPERTIES,
                   help="only these properties (default: all but mm, the image-prompt property, which is opt-in)")
    p.add_argument("--mode", dest="modes", action="append", choices=MODES, help="only these modes")
    p.add_argument("--ingest-examples", type=int, default=25,
                   help="cap on generated cases per ingest row (each runs the real relay and router; default 25)")
    p.add_argument("--tier-examples", type=int, default=None,
                   help="cap on generated state-machine runs per tier / servable row (default 12)")
    p.add_argument("--dp-examples", type=int, default=None,
                   help="cap on generated cases per dp row (each caches on every rank and routes; default 20)")
    p.add_argument("--mm-examples", type=int, default=None,
                   help="cap on generated image scenarios per mm row (default 25; each runs two chat requests "
                        "through Dynamo's frontend and SGLang's multimodal path)")
    p.add_argument("--page-size", type=positive_int, default=None, metavar="N",
                   help="run every property at this page (block) size only, e.g. your deployment's; "
                        "default: every size the strategies draw")
    p.add_argument("--event-format", choices=(*EVENT_FORMATS, "both"), default="default",
                   help="SGLang's KV-event format (--kv-events-config '{\"format\": ...}') the event-reading "
                        "properties run with: default (what dynamo.sglang runs), dynamo (SGLang 0.5.23+), or both "
                        "(dynamo where this SGLang has it)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: derandomized, reproducible)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 on any finding, credit-skew advisories included (default: only cache-blind ones)")
    p.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    p.set_defaults(run=run)


def no_dynamo_format(version: str) -> str:
    return (f"SGLang {version} has no \"dynamo\" KV-event format (KVEventsConfig.format arrived in 0.5.23; "
            "CacheInitParams has no dynamo_kv_event_format)")


def formats_to_run(asked: str, has_dynamo: bool, version: str) -> tuple[str, ...]:
    """The event formats a check runs: ``both`` is the default format, then dynamo (rows ``skipped`` with
    the reason where the release has no such format); ``dynamo`` asked of such a release is a usage error."""
    if asked == "dynamo" and not has_dynamo:
        raise UsageError(f"--event-format dynamo: {no_dynamo_format(version)}")
    return EVENT_FORMATS if asked == "both" else (asked,)


def run(args: argparse.Namespace) -> int:
    if args.examples < 1:
        raise UsageError(f"--examples must be >= 1, got {args.examples}")
    if args.ingest_examples < 1:
        raise UsageError(f"--ingest-examples must be >= 1, got {args.ingest_examples}")
    if args.mm_examples is not None and args.mm_examples < 1:
        raise UsageError(f"--mm-examples must be >= 1, got {args.mm_examples}")
    if args.tier_examples is not None and args.tier_examples < 1:
        raise UsageError(f"--tier-examples must be >= 1, got {args.tier_examples}")
    if args.dp_examples is not None and args.dp_examples < 1:
        raise UsageError(f"--dp-examples must be >= 1, got {args.dp_examples}")
    from kvalign.oracles.dynamo import DynamoRadixTree, dynamo_version, load_router_hasher
    from kvalign.oracles.sglang import SglangRadixCache, has_dynamo_format, sglang_version

    hasher = load_router_hasher(args.router_hash)
    versions = {**installed_versions(), "sglang": sglang_version(), "ai-dynamo-runtime": dynamo_version()}
    # import and build once: fail fast with an install hint, and name the class "default" resolves to
    kind = SglangRadixCache(1, eagle=False, kind=args.cache).kind
    formats = formats_to_run(args.event_format, has_dynamo_format(), versions["sglang"])
    label = args.router_hash or "dynamo._core.compute_block_hash_for_seq"
    if not args.json:
        print(check_text.header(label, versions["sglang"], kind, versions["ai-dynamo-runtime"], args.examples,
                                args.page_size), flush=True)
    start = time.perf_counter()
    progress = None if args.json else lambda r: print(check_text.progress_line(r), file=console(), flush=True)
    props = tuple(args.props or DEFAULT_PROPERTIES)
    rows: list[RowResult] = []
    for i, fmt in enumerate(formats):
        # a property that reads no events runs once, with the first format; the others once per format
        todo = props if i == 0 else tuple(p for p in props if p in EVENT_PROPERTIES)
        if fmt == "dynamo" and not has_dynamo_format():
            rows += [RowResult(p, m, "base", skipped=no_dynamo_format(versions["sglang"]), event_format="dynamo")
                     for p in todo for m in tuple(args.modes or MODES)]
            continue
        make_cache = lambda p, eagle, dyn=fmt == "dynamo": SglangRadixCache(p, eagle=eagle, kind=kind, dynamo_format=dyn)  # noqa: E731
        rows += run_check(hasher, make_cache, DynamoRadixTree, examples=args.examples,
                          props=todo, modes=tuple(args.modes or MODES),
                          variants=tuple(VARIANTS), seed=args.seed, progress=progress,
                          ingest_examples=args.ingest_examples, tier_examples=args.tier_examples,
                          page_size=args.page_size, event_format=fmt,
                          dp_examples=args.dp_examples, mm_examples=args.mm_examples)
    assess(rows)  # each finding's class; a credit skew's bound and measured routing impact
    failing = blocking(rows, args.strict)
    if args.json:
        json.dump({"aligned": not blocking(rows), "findings": sum(not r.ok and not r.skipped for r in rows),
                   "strict": args.strict, "exit": int(bool(failing)),
                   "not_applicable": [check_text.row_name(r) for r in rows if r.skipped],
                   "router_hasher": label, "cache": kind, "page_size": args.page_size,
                   "event_formats": list(formats), "versions": versions,
                   "seconds": round(time.perf_counter() - start, 2), "rows": [row_json(r) for r in rows]},
                  sys.stdout, default=str, ensure_ascii=False)
        sys.stdout.write("\n")
    else:  # the table in 100 columns, each cause explained once under it (kvalign/commands/check_text.py)
        print(check_text.table(rows))
        below = check_text.explanations(rows, args.page_size)
        if below:
            print(below)
        notes = check_text.advisory_lines(rows)
        if notes:
            print(notes)
        print("\n" + check_text.verdict(rows, time.perf_counter() - start, args.strict))
    return 1 if failing else 0
