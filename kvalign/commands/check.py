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
from dataclasses import asdict

from kvalign.commands import check_text
from kvalign.commands.options import positive_int
from kvalign.verify import props
from kvalign.verify.check import plan, run_jobs, selected
from kvalign.verify.property import Budget, Options
from kvalign.verify.rows import EVENT_FORMATS, MODES, VARIANTS
from kvalign.verify.systems import Systems
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
    p.add_argument("--property", dest="props", action="append", choices=props.names(),
                   help="only these properties (default: " + ", ".join(props.default_names()) + ")")
    p.add_argument("--mode", dest="modes", action="append", choices=MODES, help="only these modes")
    for budget in budgets():
        p.add_argument(f"--{budget.option}-examples", dest=f"{budget.option}_examples", type=int, default=None,
                       help=budget.help)
    p.add_argument("--page-size", type=positive_int, default=None, metavar="N",
                   help="run every property at this page (block) size only, e.g. your deployment's; "
                        "default: every size the strategies draw")
    p.add_argument("--event-format", choices=(*EVENT_FORMATS, "both"), default="default",
                   help="SGLang's KV-event format (--kv-events-config '{\"format\": ...}') the event-reading "
                        "properties run with: default (what dynamo.sglang runs), dynamo (SGLang 0.5.23+), or both "
                        "(dynamo where this SGLang has it)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: derandomized, reproducible)")
    p.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    p.set_defaults(run=run)


def budgets() -> list[Budget]:
    """Every registered property's example cap, once each (``--NAME-examples``)."""
    return list({p.budget.option: p.budget for p in props.REGISTRY if p.budget is not None}.values())


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
    caps = {}
    for budget in budgets():
        cap = getattr(args, f"{budget.option}_examples")
        if cap is not None and cap < 1:
            raise UsageError(f"--{budget.option}-examples must be >= 1, got {cap}")
        if cap is not None:
            caps[budget.option] = cap
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
    opts = Options(examples=args.examples, modes=tuple(args.modes or MODES), variants=tuple(VARIANTS), seed=args.seed,
                   page_size=args.page_size, caps=tuple(sorted(caps.items())))
    missing = None if has_dynamo_format() else no_dynamo_format(versions["sglang"])
    jobs = plan(selected(args.props), formats, opts, format_missing=lambda fmt: missing if fmt == "dynamo" else None)
    systems = Systems(hasher, lambda p, eagle: SglangRadixCache(p, eagle=eagle, kind=kind), DynamoRadixTree)
    by_format = {fmt: systems.with_cache(lambda p, eagle, dyn=fmt == "dynamo": SglangRadixCache(p, eagle=eagle, kind=kind,
                                                                                                  dynamo_format=dyn))
                 for fmt in formats}
    try:
        rows = run_jobs(jobs, by_format.__getitem__, opts, progress)
    finally:
        systems.close()
    aligned = all(r.ok for r in rows)
    if args.json:
        json.dump({"aligned": aligned, "router_hasher": label, "cache": kind, "page_size": args.page_size,
                   "event_formats": list(formats), "versions": versions,
                   "seconds": round(time.perf_counter() - start, 2), "rows": [asdict(r) for r in rows]},
                  sys.stdout, default=str, ensure_ascii=False)
        sys.stdout.write("\n")
    else:  # the table in 100 columns, each cause explained once under it (kvalign/commands/check_text.py)
        print(check_text.table(rows))
        below = check_text.explanations(rows, args.page_size)
        if below:
            print(below)
        print("\n" + check_text.verdict(rows, time.perf_counter() - start))
    return 0 if aligned else 1
