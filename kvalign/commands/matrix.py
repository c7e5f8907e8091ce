"""``kvalign matrix``: ``kvalign check`` across real Dynamo x SGLang releases, one table.

``--shipped`` adds, for each Dynamo release, the SGLang its ``ai-dynamo[sglang]`` extra pins (the
pair a deployment actually runs); the default matrix includes those pairs, an explicit ``--sglang``
list alone does not.

Exit 0 all pairs aligned, 1 any pair misaligned, 2 environment error (a release that cannot be
installed or checked, or the index cannot be read).

Cells, for a CI job matrix: ``--list-cells`` prints the pairs a run with the same options would
check, ``--cell DYNAMO:SGLANG`` checks exactly one of them as the run does, and ``--merge FILE...``
prints the table (or with ``--json`` the report) of one run over the cells' pairs. With ``--cells``
(the ``--list-cells --json`` output) the merge is held to the plan: a planned cell without a result
is an error row, named on stderr, and the exit is 2, so a dead cell job cannot shorten the table.

``--markdown`` prints the compact table the README carries (a row per pair, the causes found), with
the command that reproduces it under it.

``--engine vllm`` checks Dynamo x vLLM pairs instead (``--vllm``; :mod:`kvalign.commands.matrix_vllm`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvalign.verify import props as registry
from kvalign.errors import UsageError
from kvalign.verify.report.matrix import (DEFAULT_SGLANG, LIVE_COLUMN, UNKNOWN, CellFileError, MatrixError, PairResult, cache_root,
                                   cell_document, default_dynamo_versions, exit_code, list_cells, merge_cells,
                                   merge_planned, one_line, plan_pairs, planned_cells, render, render_markdown,
                                   report_json, run_live, run_matrix, shipped_sglang, unknown_result)
from kvalign.runtime_log import console
from kvalign.releases.versions import installed_versions
from kvalign.verify.report import matrix_vllm
from kvalign.commands.release_args import VERSION, versions as _versions

#: ``--examples`` / ``--ingest-examples`` defaults (a reproducing command leaves them out)
EXAMPLES, INGEST_EXAMPLES = 100, 20


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("matrix", help="run check for every Dynamo x SGLang (or x vLLM) release pair (wheels cached "
                                      "per version)")
    p.add_argument("--engine", choices=("sglang", matrix_vllm.ENGINE), default="sglang",
                   help="the engine behind the router: sglang (default), or vllm: check --engine vllm's rows for each "
                        "Dynamo x vLLM pair (--vllm), official vLLM wheels each in an environment of its own")
    p.add_argument("--vllm", metavar="V1,V2,...", default=None,
                   help=f"with --engine vllm: vllm releases (default: {','.join(matrix_vllm.DEFAULT_VLLM)} plus each "
                        "Dynamo release's shipped one, its ai-dynamo[vllm] pin)")
    p.add_argument("--dynamo", metavar="V1,V2,...", default=None,
                   help="ai-dynamo releases (default: every ai-dynamo-runtime release 1.0.0 .. 1.6.1 on the index); "
                        "an item may be a local wheel (ai-dynamo or ai-dynamo-runtime) or a source checkout: a pull "
                        "request's own build")
    p.add_argument("--sglang", metavar="S1,S2,...", default=None,
                   help=f"sglang releases (default: {','.join(DEFAULT_SGLANG)} plus each Dynamo release's shipped one); "
                        "an item may be a local sglang wheel or a source checkout")
    p.add_argument("--shipped", action="store_true",
                   help="add each Dynamo release's own SGLang (the ai-dynamo[sglang] pin in its wheel metadata); "
                        "alone, check only those pairs")
    p.add_argument("--jobs", type=int, default=None,
                   help=f"pairs checked at once (default 2; with --engine vllm, {matrix_vllm.JOBS})")
    p.add_argument("--examples", type=int, default=None,
                   help=f"check --examples per pair (default {EXAMPLES}); with --engine vllm, check --vllm-examples "
                        f"(default {matrix_vllm.EXAMPLES})")
    p.add_argument("--ingest-examples", type=int, default=None,
                   help=f"check --ingest-examples per pair (default {INGEST_EXAMPLES})")
    p.add_argument("--property", dest="props", action="append", choices=registry.names(),
                   help="only these properties (check --property per pair; the table shows only their columns). "
                        "E.g. --property card for a dynamo.sglang change: the card row alone decides it")
    p.add_argument("--all", dest="all_props", action="store_true",
                   help="every property, the opt-in ones too (check --all per pair; with --engine vllm: vLLM's bytes "
                        "block hashes): without it the table says which did not run")
    p.add_argument("--live", action="store_true",
                   help="also run the seed scenario (kvalign e2e run --engine sglang-cpu) per pair, one at a time, "
                        f"as column {LIVE_COLUMN!r} (real CPU engines: ~3 min and ~6 GiB per pair)")
    p.add_argument("--event-format", choices=("default", "both"), default=None,
                   help="both (default): each pair's check also runs SGLang's \"dynamo\" KV-event format where the "
                        "release has it (a format:dynamo column); default: SGLang's default format only")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    out.add_argument("--markdown", action="store_true",
                     help="print a Markdown table, a row per pair with the causes found, and under it the command "
                          "that reproduces it (as the README shows)")
    cells = p.add_mutually_exclusive_group()
    cells.add_argument("--list-cells", action="store_true",
                       help="print the cells (release pairs) this run would check, one DYNAMO:SGLANG a line; with "
                            "--json a JSON list of {cell, dynamo, sglang, shipped} objects (a CI job matrix)")
    cells.add_argument("--cell", metavar="DYNAMO:SGLANG", default=None,
                       help="check only this cell of the matrix the other options describe, as the whole run would; "
                            "--json adds what --merge needs")
    cells.add_argument("--merge", metavar="CELL.json", nargs="*", default=None,
                       help="print the table (--json: the report) of one run over these --cell --json files "
                            "(they may also follow the other options)")
    p.add_argument("--cells", metavar="CELLS.json", default=None,
                   help="with --merge: the planned cells (--list-cells --json); a planned cell without a result "
                        "is an error row, named on stderr, and the exit is 2")
    p.add_argument("results", metavar="RESULT.json", nargs="*", help="with --merge: the cells' --cell --json files")
    p.set_defaults(run=run)


def _cell_arg(text: str) -> tuple[str, str]:
    import re

    dynamo, sep, sglang = text.partition(":")
    if not sep or not re.match(VERSION, dynamo) or not (re.match(VERSION, sglang) or sglang == UNKNOWN):
        raise UsageError(f"--cell takes DYNAMO:SGLANG release versions (as --list-cells prints them), got {text!r}")
    return dynamo, sglang


def _plan(args: argparse.Namespace) -> dict[str, object]:
    """The options that decide a run's rows; every cell of one run carries the same plan
    (``properties`` only when ``--property`` narrowed the run)."""
    plan = {"dynamo": _versions(args.dynamo, "--dynamo"), "sglang": _versions(args.sglang, "--sglang"),
            "shipped": bool(args.shipped), "examples": args.examples, "ingest_examples": args.ingest_examples,
            "live": bool(args.live), "event_format": args.event_format}
    if args.all_props and args.props:
        raise UsageError("--all runs every property: give it or --property, not both")
    if args.all_props:
        plan["all"] = True
    if args.props or args.all_props:
        plan["properties"] = _props(args)
    return plan


def _props(args: argparse.Namespace) -> list[str]:
    """The properties a run checks, in the table's column order."""
    if getattr(args, "all_props", False):
        return [p.name for p in registry.of_engine("sglang")]
    return [p for p in registry.names() if p in args.props] if args.props else list(registry.default_names())


def _read_json(name: str, what: str) -> object:
    try:
        with open(name, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {what} file {name}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{name}: malformed {what}: not JSON ({exc.msg} at line {exc.lineno})") from None


def _merge(args: argparse.Namespace) -> int:
    docs = [(name, _read_json(name, "cell")) for name in [*args.merge, *args.results]]
    missing: list[str] = []
    try:
        if args.cells is not None:
            planned = planned_cells(args.cells, _read_json(args.cells, "planned cells"))
            versions, results, missing = merge_planned(docs, planned, args.cells)
        else:
            versions, results = merge_cells(docs)
    except CellFileError as exc:
        raise UsageError(str(exc)) from None
    # merge_cells checked that every cell has this one; with none merged, no plan is known
    plan = docs[0][1]["cell"]["plan"] if docs else {}
    _print(results, versions, as_json=args.json, props=plan.get("properties") or list(registry.default_names()),
           markdown=plan if args.markdown else None)
    err = console()
    print(f"kvalign matrix: merged {len(results) - len(missing)} cells ({sum(r.verdict == 'aligned' for r in results)} "
          f"aligned, {sum(r.verdict == 'misaligned' for r in results)} misaligned, "
          f"{sum(r.verdict == 'error' for r in results) - len(missing)} error)", file=err, flush=True)
    if missing:
        print(f"kvalign matrix: error: {len(missing)} of {len(results)} planned cells have no result: "
              f"{', '.join(missing)}", file=err, flush=True)
    return exit_code(results)


def reproduce(plan: dict) -> str:
    """The one ``kvalign matrix`` command whose run gives the rows of ``plan`` as a Markdown table."""
    argv = ["kvalign", "matrix"]
    for flag, key in (("--dynamo", "dynamo"), ("--sglang", "sglang")):
        if plan.get(key):
            argv += [flag, ",".join(plan[key])]
    argv += ["--shipped"] if plan.get("shipped") else []
    argv += ["--examples", str(plan["examples"])] if plan.get("examples", EXAMPLES) != EXAMPLES else []
    if plan.get("ingest_examples", INGEST_EXAMPLES) != INGEST_EXAMPLES:
        argv += ["--ingest-examples", str(plan["ingest_examples"])]
    argv += ["--all"] if plan.get("all") else [a for p in plan.get("properties") or () for a in ("--property", p)]
    argv += ["--live"] if plan.get("live") else []
    return " ".join([*argv, "--markdown"])


def _print(results: list[PairResult], versions: dict, *, as_json: bool, props: list[str],
           doc: dict | None = None, markdown: dict | None = None) -> None:
    if as_json:
        json.dump(doc or report_json(results, versions, props), sys.stdout, ensure_ascii=False)
        sys.stdout.write("\n")
    elif markdown is not None:
        print(render_markdown(results, reproduce(markdown), props))
    else:
        print(render(results, props))


def run(args: argparse.Namespace) -> int:
    if args.engine == matrix_vllm.ENGINE:
        from kvalign.commands.matrix_vllm import run as run_vllm

        return run_vllm(args)
    if args.vllm is not None:
        raise UsageError("--vllm names vLLM releases: it goes with --engine vllm")
    args.jobs = 2 if args.jobs is None else args.jobs
    args.examples = EXAMPLES if args.examples is None else args.examples
    args.ingest_examples = INGEST_EXAMPLES if args.ingest_examples is None else args.ingest_examples
    args.event_format = args.event_format or "both"
    if args.merge is None and (args.results or args.cells is not None):
        raise UsageError("RESULT.json files and --cells go with --merge")
    if args.markdown and (args.list_cells or args.cell is not None):
        raise UsageError("--markdown prints the table of a whole run: it goes with a run or --merge")
    if args.merge is not None:
        if args.live:
            raise UsageError("--merge takes the cells as they ran; --live belongs to --cell")
        return _merge(args)
    if args.jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {args.jobs}")
    if args.examples < 1 or args.ingest_examples < 1:
        raise UsageError("--examples and --ingest-examples must be >= 1")
    plan = _plan(args)
    cell = _cell_arg(args.cell) if args.cell is not None else None
    sglang = _versions(args.sglang, "--sglang")
    shipped = args.shipped or sglang is None
    if sglang is None:
        sglang = [] if args.shipped else list(DEFAULT_SGLANG)
    dynamo = _versions(args.dynamo, "--dynamo")
    start = time.perf_counter()
    err = console()
    log = lambda m: print(f"  {m}", file=err, flush=True)  # noqa: E731
    if cell is not None:  # only this cell's Dynamo release is read: the others' pins cannot change its row
        if dynamo is not None and cell[0] not in dynamo:
            raise UsageError(f"cell {args.cell} is not in this matrix: --dynamo {args.dynamo} has no {cell[0]}")
        dynamo = [cell[0]]
    try:
        dynamo = dynamo or default_dynamo_versions()
    except MatrixError as exc:
        raise UsageError(str(exc)) from None
    pairs, unknown = plan_pairs(dynamo, sglang, shipped=shipped, pinned=lambda d: shipped_sglang(d, log=log))
    if args.list_cells:
        cells = list_cells(pairs, unknown)
        if args.json:
            json.dump(cells, sys.stdout, ensure_ascii=False)
            sys.stdout.write("\n")
        else:
            print("\n".join(c["cell"] for c in cells))
        print(f"kvalign matrix: {len(cells)} cells", file=err, flush=True)
        return 0
    if cell is not None:
        return _run_cell(args, cell, pairs, unknown, plan, start, log)
    extra = sum(p.shipped for p in pairs if p.sglang not in sglang)
    print(f"kvalign matrix: {len(dynamo)} Dynamo x {len(sglang)} SGLang releases"
          + (f" + {extra} shipped pairs" if extra else "") + f" = {len(pairs)} pairs, "
          f"{args.jobs} at a time; wheel cache {cache_root()}", file=err, flush=True)

    def progress(r: PairResult, done: int, total: int) -> None:
        what = r.verdict if r.verdict != "misaligned" else f"misaligned ({len(r.findings)} rows)"
        print(f"  [{done}/{total}] dynamo {r.dynamo} x sglang {r.sglang}: {what} in {r.seconds:.0f}s"
              + (f" — {one_line(r.error)}" if r.error else ""), file=err, flush=True)

    results = run_matrix(pairs, examples=args.examples, ingest_examples=args.ingest_examples, jobs=args.jobs,
                         props=args.props, progress=progress, log=log, event_format=args.event_format)
    if args.live:  # one at a time: each starts three real engine processes
        for i, r in enumerate(results, 1):
            r.live = run_live(r.dynamo, r.sglang, log=log)
            print(f"  [live {i}/{len(results)}] dynamo {r.dynamo} x sglang {r.sglang}: {r.live['verdict']} "
                  f"in {r.live['seconds']:.0f}s — {r.live['detail']}", file=err, flush=True)
    results += [unknown_result(d, why) for d, why in unknown.items()]
    wall = time.perf_counter() - start
    _print(results, installed_versions(), as_json=args.json, props=_props(args),
           markdown=plan if args.markdown else None)
    print(f"kvalign matrix: {len(results)} pairs in {wall:.0f}s wall "
          f"({sum(r.verdict == 'aligned' for r in results)} aligned, "
          f"{sum(r.verdict == 'misaligned' for r in results)} misaligned, "
          f"{sum(r.verdict == 'error' for r in results)} error)", file=err, flush=True)
    return exit_code(results)


def _run_cell(args: argparse.Namespace, cell: tuple[str, str], pairs: list, unknown: dict[str, str],
              plan: dict, start: float, log) -> int:
    """One cell, exactly as the whole run checks that pair (same install, same check, same live step)."""
    dynamo, sglang = cell
    if sglang == UNKNOWN:
        if dynamo not in unknown:
            pin = next((p.sglang for p in pairs if p.shipped), None)
            raise UsageError(f"cell {dynamo}:{UNKNOWN}: ai-dynamo {dynamo} pins sglang {pin} now; "
                             f"list the cells again (cell {dynamo}:{pin})" if pin else
                             f"cell {dynamo}:{UNKNOWN} is not in this matrix (run without --sglang, or with --shipped)")
        results = [unknown_result(dynamo, unknown[dynamo])]
    else:
        pair = next((p for p in pairs if p.sglang == sglang), None)
        if pair is None:
            raise UsageError(f"cell {args.cell} is not in this matrix (--list-cells with the same options lists its cells)")
        results = run_matrix([pair], examples=args.examples, ingest_examples=args.ingest_examples, jobs=1,
                             props=args.props, log=log, event_format=args.event_format)
        if args.live:
            results[0].live = run_live(dynamo, sglang, log=log)
    r = results[0]
    versions = installed_versions()
    _print(results, versions, as_json=args.json, props=_props(args),
           doc=cell_document(r, versions, plan, _props(args)) if args.json else None)
    print(f"kvalign matrix: cell {args.cell}: {r.verdict} in {time.perf_counter() - start:.0f}s"
          + (f" — {one_line(r.error)}" if r.error else ""), file=console(), flush=True)
    return exit_code(results)
