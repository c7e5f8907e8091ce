"""``kvalign report FINDING``: a self-contained Markdown report of one finding on one release pair.

The pair defaults to the installed Dynamo release and the SGLang its ``ai-dynamo[sglang]`` extra
pins (the pair a deployment runs). The releases come from ``kvalign matrix``'s per-version cache;
the evidence is collected in a subprocess run by that pair's own environment
(:mod:`kvalign.verify.report.finding`, :mod:`kvalign.releases.release_env`). Exit 0 report printed, 1 the finding does not reproduce on that pair
(no report), 2 usage or environment error. ``--engine vllm`` (implied by a ``VLLM_*`` cause) reports a finding of
the vLLM properties instead, on the installed Dynamo and the pinned vLLM (:mod:`kvalign.verify.props.vllm.report`,
:mod:`kvalign.verify.props.vllm.shared_report`); the SGLang report stays the default for the causes both share.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvalign.model.causes import Cause
from kvalign.commands.options import positive_int
from kvalign.errors import UsageError

#: Seconds the in-pair search + replay may take.
COLLECT_TIMEOUT_S = 900


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="Markdown report of one finding (e.g. LORA_NOT_IN_EVENTS) on one release pair")
    p.add_argument("finding", metavar="FINDING", help="a cause name, e.g. LORA_NOT_IN_EVENTS")
    p.add_argument("--dynamo", metavar="V", default=None, help="ai-dynamo release (default: the installed one)")
    p.add_argument("--sglang", metavar="V", default=None,
                   help="sglang release (default: the one the Dynamo release's ai-dynamo[sglang] extra pins)")
    p.add_argument("--mode", dest="modes", action="append", choices=("plain", "eagle"),
                   help="only search this mode (default: plain, then eagle)")
    p.add_argument("--examples", type=positive_int, default=30,
                   help="generated cases per property x mode x variant in the search (default 30)")
    p.add_argument("--engine", choices=("sglang", "vllm"), default=None,
                   help="the engine whose finding to report (default: sglang; VLLM_* findings are vLLM's); "
                        "vllm reports a finding of the vLLM properties on the installed Dynamo and the pinned vLLM")
    p.add_argument("--out", metavar="FILE", type=Path, default=None, help="write the report here instead of stdout")
    p.set_defaults(run=run)


def _not_found(stderr: str) -> str:
    """The collector's "not found" line (a runtime's own log lines may precede it on stderr)."""
    from kvalign.verify.report.matrix import one_line

    line = next((ln for ln in stderr.splitlines() if ln.startswith("not found: ")), stderr)
    return one_line(line).removeprefix("not found: ")


def _shipped(dynamo: str, log: Any) -> str | None:
    """The SGLang ``ai-dynamo[sglang]==dynamo`` pins (the report's first line says whether the pair is it)."""
    from kvalign.verify.report.matrix import MatrixError, one_line, shipped_sglang

    try:
        return shipped_sglang(dynamo, log=log)
    except MatrixError as exc:
        raise UsageError(f"cannot read which SGLang ai-dynamo {dynamo} ships: {one_line(str(exc))}") from None


def run(args: argparse.Namespace) -> int:
    from kvalign.commands.release_args import VERSION
    from kvalign.verify.report.matrix import MatrixError, ensure_release, installed, one_line, pair_env, shipped_sglang
    from kvalign.releases.release_env import ReleaseEnvError

    if args.finding not in Cause.__members__:
        raise UsageError(f"unknown finding {args.finding!r}; expected a cause name such as LORA_NOT_IN_EVENTS "
                         f"(one of {', '.join(Cause.__members__)})")
    if args.engine == "vllm" or (args.engine is None and args.finding.startswith("VLLM_")):
        return run_vllm(args)
    if args.finding.startswith("VLLM_"):
        raise UsageError(f"{args.finding} is a vLLM finding: drop --engine sglang")
    for flag, value in (("--dynamo", args.dynamo), ("--sglang", args.sglang)):
        if value is not None and not re.match(VERSION, value):
            raise UsageError(f"{flag} takes one release version, got {value!r}")
    dynamo = args.dynamo or installed("ai-dynamo")
    if dynamo is None:
        raise UsageError("ai-dynamo is not installed here: pass --dynamo VERSION")
    err = sys.stderr
    log = lambda m: print(f"  {m}", file=err, flush=True)  # noqa: E731
    try:
        sglang = args.sglang or shipped_sglang(dynamo, log=log)
        if sglang is None:
            raise UsageError(f"ai-dynamo {dynamo} pins no sglang release: pass --sglang VERSION")
        python, env = pair_env(ensure_release("dynamo", dynamo, log=log), ensure_release("sglang", sglang, log=log), sglang)
    except (MatrixError, ReleaseEnvError) as exc:
        raise UsageError(one_line(str(exc))) from None
    print(f"kvalign report: {args.finding} on ai-dynamo {dynamo} x sglang {sglang} (searching, then replaying)",
          file=err, flush=True)
    modes = args.modes or ["plain", "eagle"]
    cmd = [python, "-m", "kvalign.verify.report.finding", args.finding, "--examples", str(args.examples),
           *[a for m in modes for a in ("--mode", m)]]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=COLLECT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise UsageError(f"collecting {args.finding} did not finish within {COLLECT_TIMEOUT_S}s") from None
    if res.returncode == 3:
        print(f"kvalign report: {args.finding} does not reproduce on ai-dynamo {dynamo} x sglang {sglang}: "
              f"{_not_found(res.stderr)}", file=err)
        return 1
    if res.returncode != 0:
        raise UsageError(f"collecting {args.finding} on ai-dynamo {dynamo} x sglang {sglang} failed: "
                         f"{one_line(res.stderr or f'exit {res.returncode}')}")
    from kvalign.verify.report.finding import render

    data = json.loads(res.stdout.strip().splitlines()[-1])
    mode_flag = f" --mode {data['mode']}"
    shipped = sglang if args.sglang is None else _shipped(dynamo, log)
    text = render(data, f"kvalign report {args.finding} --dynamo {dynamo} --sglang {sglang}{mode_flag}", shipped)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
        print(f"kvalign report: wrote {args.out}", file=err)
    else:
        sys.stdout.write(text)
    return 0


def run_vllm(args: argparse.Namespace) -> int:
    """A vLLM finding on the installed Dynamo and the pinned vLLM (collected here; vLLM runs in its own
    interpreter): a ``VLLM_*`` cause, or (``--engine vllm``) one the vLLM properties share with SGLang. Exit 0
    report printed, 2 a pair it cannot collect on."""
    from kvalign.oracles.base import OracleUnavailable
    from kvalign.verify.props.vllm import report, shared_report
    from kvalign.verify.report.matrix import installed, one_line
    from kvalign.verify.report.vllm_finding import render

    cause = Cause[args.finding]
    known = report.CAUSES | frozenset(shared_report.FINDINGS)
    if cause not in known:
        raise UsageError(f"kvalign reports no vLLM finding {args.finding}; one of {', '.join(sorted(c.name for c in known))}")
    collect = report.collect if cause in report.CAUSES else shared_report.collect
    dynamo = installed("ai-dynamo")
    if args.sglang is not None or (args.dynamo is not None and args.dynamo != dynamo):
        raise UsageError(f"{args.finding} is collected on the installed ai-dynamo ({dynamo}) and the pinned vLLM: "
                         "drop --dynamo / --sglang")
    print(f"kvalign report: {args.finding} on ai-dynamo {dynamo} x the pinned vLLM (replaying, then routing)",
          file=sys.stderr, flush=True)
    try:
        data = collect(cause)
    except OracleUnavailable as exc:
        raise UsageError(f"collecting {args.finding} failed: {one_line(str(exc))}") from None
    text = render(data, f"kvalign report {args.finding}" + (" --engine vllm" if cause in shared_report.SHARED else ""))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
        print(f"kvalign report: wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
