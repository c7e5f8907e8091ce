"""``kvalign matrix --engine vllm``: ``kvalign check --engine vllm`` across real Dynamo x vLLM releases, one table.

The options mean what they mean for SGLang: ``--dynamo`` the Dynamo releases, ``--vllm`` the vLLM
ones (the official wheels), ``--shipped`` each Dynamo release's own vLLM (its ``ai-dynamo[vllm]``
pin; without ``--vllm`` those pairs are in the default matrix), ``--json`` / ``--markdown`` the
report and the README's table with the command that reproduces it, ``--all`` each check's opt-in properties too
(the bytes block hashes; without it the verdicts are for workers with vLLM's default int hashes, and say so under the
table, as the SGLang matrix says what it left out). The table has the SGLang
matrix's shape, verdicts, classes and exit codes (0 aligned, 1 misaligned, 2 a pair in error: a
release that does not install or import). What belongs to SGLang's check only (its event formats,
properties, live scenario, CI cells) is a usage error here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvalign.commands.release_args import versions as _versions
from kvalign.errors import UsageError
from kvalign.releases.versions import installed_versions
from kvalign.runtime_log import console
from kvalign.verify.report import matrix_vllm
from kvalign.verify.report.matrix import (MatrixError, PairResult, UNKNOWN, default_dynamo_versions, exit_code, one_line,
                                          plan_pairs, render, render_markdown)

#: SGLang-only options and the value each has when not given.
SGLANG_ONLY = {"sglang": None, "live": False, "list_cells": False, "cell": None, "merge": None, "cells": None,
               "props": None, "event_format": None, "ingest_examples": None, "results": []}


def _flag(dest: str) -> str:
    return {"props": "--property", "results": "RESULT.json"}.get(dest, "--" + dest.replace("_", "-"))


def reproduce(dynamo: list[str] | None, vllm: list[str] | None, shipped: bool, examples: int | None,
              all_props: bool = False) -> str:
    """The one ``kvalign matrix --engine vllm`` command whose run gives this table."""
    argv = ["kvalign", "matrix", "--engine", matrix_vllm.ENGINE]
    argv += ["--dynamo", ",".join(dynamo)] if dynamo else []
    argv += ["--vllm", ",".join(vllm)] if vllm else []
    argv += ["--shipped"] if shipped else []
    argv += ["--all"] if all_props else []
    argv += ["--examples", str(examples)] if examples not in (None, matrix_vllm.EXAMPLES) else []
    return " ".join([*argv, "--markdown"])


def run(args: argparse.Namespace) -> int:
    given = [_flag(d) for d, unset in SGLANG_ONLY.items() if getattr(args, d) != unset]
    if given:
        raise UsageError(f"{', '.join(given)}: SGLang's matrix only, not with --engine vllm")
    args.jobs = matrix_vllm.JOBS if args.jobs is None else args.jobs
    if args.jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {args.jobs}")
    if args.examples is not None and args.examples < 1:
        raise UsageError(f"--examples must be >= 1, got {args.examples}")
    asked_dynamo, asked_vllm = _versions(args.dynamo, "--dynamo"), _versions(args.vllm, "--vllm")
    shipped = args.shipped or asked_vllm is None
    vllm = asked_vllm if asked_vllm is not None else ([] if args.shipped else list(matrix_vllm.DEFAULT_VLLM))
    err = console()
    log = lambda m: print(f"  {m}", file=err, flush=True)  # noqa: E731
    start = time.perf_counter()
    try:
        dynamo = asked_dynamo or default_dynamo_versions()
    except MatrixError as exc:
        raise UsageError(str(exc)) from None
    pairs, unknown = plan_pairs(dynamo, vllm, shipped=shipped, pinned=lambda d: matrix_vllm.shipped_vllm(d, log=log),
                                 engine=matrix_vllm.ENGINE)
    extra = sum(p.shipped for p in pairs if p.sglang not in vllm)
    print(f"kvalign matrix: {len(dynamo)} Dynamo x {len(vllm)} vLLM releases"
          + (f" + {extra} shipped pairs" if extra else "") + f" = {len(pairs)} pairs, {args.jobs} at a time", file=err,
          flush=True)

    def progress(r: PairResult, done: int, total: int) -> None:
        what = r.verdict if r.verdict != "misaligned" else f"misaligned ({len(r.findings)} rows)"
        print(f"  [{done}/{total}] dynamo {r.dynamo} x vllm {r.sglang}: {what} in {r.seconds:.0f}s"
              + (f" — {one_line(r.error)}" if r.error else ""), file=err, flush=True)

    examples = matrix_vllm.EXAMPLES if args.examples is None else args.examples
    results = matrix_vllm.run_matrix(pairs, examples=examples, jobs=args.jobs, all_props=args.all_props,
                                     progress=progress, log=log)
    results += [PairResult(d, UNKNOWN, "error", error=f"shipped vLLM unknown: {why}", shipped=True)
                for d, why in unknown.items()]
    cols = matrix_vllm.columns([r for r in results if r.verdict != matrix_vllm.NOT_APPLICABLE])
    matrix_vllm.fill_not_applicable(results, cols)
    scope = matrix_vllm.scope_line(args.all_props)
    if args.json:
        json.dump(matrix_vllm.report_json(results, installed_versions(), cols, args.all_props), sys.stdout,
                  ensure_ascii=False)
        sys.stdout.write("\n")
    elif args.markdown:
        print(render_markdown(results, reproduce(asked_dynamo, asked_vllm, args.shipped, args.examples, args.all_props),
                              engine=matrix_vllm.ENGINE, scope=scope))
    else:
        print(render(results, engine=matrix_vllm.ENGINE, columns=cols, scope=scope))
    print(f"kvalign matrix: {len(results)} pairs in {time.perf_counter() - start:.0f}s wall "
          f"({sum(r.verdict == 'aligned' for r in results)} aligned, "
          f"{sum(r.verdict == 'misaligned' for r in results)} misaligned, "
          f"{sum(r.verdict == 'error' for r in results)} error, "
          f"{sum(r.verdict == matrix_vllm.NOT_APPLICABLE for r in results)} n/a)", file=err, flush=True)
    return exit_code(results)
