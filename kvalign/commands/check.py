"""``kvalign check``: are the router's block keys and SGLang's radix-cache keys aligned?

Runs the differential properties over the whole router path of the installed pair — the card
``dynamo.sglang`` registers, the router hasher (default: the installed Dynamo binding), SGLang's
real radix cache, and SGLang's published events through Dynamo's real worker relay into a real
router — in plain and EAGLE mode, with LoRA / namespace variants. Exit 0 aligned, 1 misaligned,
2 usage or environment error, or a negative control that did not fail (its row proves nothing).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Sequence

from kvalign.commands import check_text
from kvalign.commands.options import positive_int
from kvalign.verify import props
from kvalign.verify.runner.check import plan, run_jobs, selected
from kvalign.verify.engine.impact import blocking
from kvalign.verify.runner.pool import Pool, usable_cores
from kvalign.verify.engine.property import Budget, Options, Property
from kvalign.verify.engine.rows import EVENT_FORMATS, MODES, VARIANTS, RowResult, row_json
from kvalign.verify.engine.systems import Facts, Systems, SystemsSpec, open_systems
from kvalign.verify.engine.scope import Scope
from kvalign.verify.runner.confirm import unexplained
from kvalign.errors import UsageError
from kvalign.oracles.sglang import KINDS
from kvalign.runtime_log import console
from kvalign.releases.versions import installed_versions


#: ``--engine``'s vLLM value: the property that holds vLLM's rows (kvalign/verify/props/vllm/)
VLLM = props.vllm.PROPERTY.name


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
                   help="only these properties (default: " + ", ".join(props.default_names()) + "; the verdict "
                        "names those that did not run)")
    p.add_argument("--all", dest="all_props", action="store_true",
                   help="run every property of the engine, the opt-in ones too (" + ", ".join(props.opt_in_names("sglang"))
                        + f"; with --engine {VLLM}: " + ", ".join(props.opt_in_names(VLLM)) + "): a verdict for every "
                        "surface")
    p.add_argument("--engine", choices=("sglang", VLLM), default="sglang",
                   help=f"the engine behind the router: sglang (default), or {VLLM} (its hash, pages, ingest, tenants "
                        "and other rows, for workers with vLLM's default int block hashes; --all adds the bytes ones)")
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
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="run rows in N worker processes (default: the usable cores); the report is the same for any N")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 on any finding, credit-skew advisories included (default: only cache-blind ones)")
    p.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    p.set_defaults(run=run, quick_exit=True)


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


def control_error(rows: Sequence[RowResult]) -> str | None:
    """The one line that ends a run in exit 2 where a row's negative control did not fail, naming each such
    control and row; None where every control failed as it must. A property that passes a deliberate
    misalignment would pass a real one too, so neither ALIGNED (exit 0) nor a finding (exit 1) may
    stand on that row."""
    missed = check_text.missed_controls(rows)
    if not missed:
        return None
    return (f"{len(missed)} negative control(s) did not fail, so their rows prove nothing: "
            + "; ".join(f"{check_text.row_name(r)}: control {r.control['mutation']} got {r.control['cause']}, "
                        f"expected {r.control['expected']}" for r in missed))


def engine_properties(engine: str, all_props: bool, asked: Sequence[str] | None) -> list[Property]:
    """What ``check --engine ENGINE`` runs: the engine's default properties, every one of its properties with
    ``--all``, or those ``--property`` names (another engine's is a usage error naming the engine to run it with)."""
    mine = props.of_engine(engine)
    chosen = selected([p.name for p in mine] if all_props else asked or props.default_names(engine))
    other = [p for p in chosen if p.engine != engine]
    if other:
        raise UsageError(f"--property {', '.join(p.name for p in other)} checks another engine: run it with "
                         f"--engine {other[0].engine}")
    return chosen


def open_uncollected(spec: SystemsSpec) -> tuple[Systems, Facts]:
    """:func:`open_systems` with the cyclic collector paused, then what it built frozen (:func:`gc.freeze`).

    The run's start is serial whatever ``--jobs``: it imports SGLang, torch and transformers, about 650,000
    objects that live as long as the run, and the collector's full passes over them while they were being
    built cost about 1 of the start's 9-10 CPU-s (8.5 against 9.4, one after the other on one machine).
    Frozen, they are out of every later collection's sight, with the few cycles the imports left (about
    13 MiB), in ``--jobs 1`` as in the workers ``check --jobs`` forks from this state: both run their first
    job with the same heap, which the rows need (:mod:`kvalign.verify.runner.pool`). :func:`run` unfreezes
    them when its rows are done (a process that goes on, as the tests' does, collects them again)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return open_systems(spec)
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def run(args: argparse.Namespace) -> int:
    if args.examples < 1:
        raise UsageError(f"--examples must be >= 1, got {args.examples}")
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {args.jobs}")
    caps = {}
    for budget in budgets():
        cap = getattr(args, f"{budget.option}_examples")
        if cap is not None and cap < 1:
            raise UsageError(f"--{budget.option}-examples must be >= 1, got {cap}")
        if cap is not None:
            caps[budget.option] = cap
    opts = Options(examples=args.examples, modes=tuple(args.modes or MODES), variants=tuple(VARIANTS), seed=args.seed,
                   page_size=args.page_size, caps=tuple(sorted(caps.items())))
    if args.all_props and args.props:
        raise UsageError("--all runs every property: give it or --property, not both")
    chosen = engine_properties(args.engine, args.all_props, args.props)
    scope = Scope.of(props.of_engine(args.engine), (p.name for p in chosen))
    asked = EVENT_FORMATS if args.event_format == "both" else (args.event_format,)
    # at most a worker per job: a run of one job (--property card) starts none and runs in this process
    workers = min(args.jobs or usable_cores(), len(plan(chosen, asked, opts)))
    spec = SystemsSpec(args.router_hash, args.cache)
    pool = systems = None
    try:
        # the workers are forked from this process once its systems are built, as --jobs 1 builds them
        systems, facts = open_uncollected(spec)
        if workers > 1:
            pool = Pool(workers, systems, opts)
        versions = {**installed_versions(), "sglang": facts.sglang, "ai-dynamo-runtime": facts.dynamo}
        formats = formats_to_run(args.event_format, facts.dynamo_format, facts.sglang)
        label = args.router_hash or "dynamo._core.compute_block_hash_for_seq"
        if not args.json:
            print("\n".join(props.vllm.header(facts.dynamo, opts.examples_for(props.vllm.BUDGET), args.page_size)) if args.engine == VLLM else
                  check_text.header(label, facts.sglang, facts.kind, facts.dynamo, args.examples, args.page_size),
                  flush=True)
        start = time.perf_counter()
        progress = None if args.json else lambda r: print(check_text.progress_line(r), file=console(), flush=True)
        missing = None if facts.dynamo_format else no_dynamo_format(facts.sglang)
        jobs = plan(chosen, formats, opts, format_missing=lambda fmt: missing if fmt == "dynamo" else None)
        rows = pool.run(jobs, progress) if pool else run_jobs(jobs, systems, opts, progress)
    finally:
        if pool:
            pool.close()
        if systems:
            systems.close()
        gc.unfreeze()  # a caller in this process (the tests) collects what the run froze, at its exit too
    kind = facts.kind
    failing = blocking(rows, args.strict)
    errors = [e for e in (control_error(rows), unexplained(rows)) if e]
    error = "; ".join(errors) or None
    if args.json:
        json.dump({"aligned": not blocking(rows), "findings": sum(r.status == "finding" for r in rows),
                   "unconfirmed": [check_text.row_name(r) for r in rows if r.status == "unconfirmed"],
                   "strict": args.strict, "exit": 2 if error else int(bool(failing)), "error": error,
                   "not_applicable": [check_text.row_name(r) for r in rows if r.skipped],
                   "scope": scope.as_json(),
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
        print("\n" + check_text.verdict(rows, time.perf_counter() - start, args.strict, scope))
    if error:  # after the report, which shows every row and control; the CLI says it in one line, exit 2
        raise UsageError(error)
    return 1 if failing else 0
