"""``kvalign e2e mm``: image prompts through the real CPU engine behind the real frontend and router.

Runs :mod:`kvalign.live.runs.mm` (one ``dynamo.sglang`` worker on CPU serving a tiny random-weight
Qwen2-VL). Exit 0 when the router's credit equals the engine's reuse for a repeated image prompt
and neither credits an image changed by one pixel, 1 when a check fails (with the cause
``diagnose`` names on the worker's capture), 2 when it cannot run here.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import time
from pathlib import Path

from kvalign.commands.options import positive_int
from kvalign.errors import UsageError


def register(actions: argparse._SubParsersAction) -> None:
    p = actions.add_parser("mm", help="image prompts on the real CPU engine (tiny Qwen2-VL) behind the real router")
    p.add_argument("--engine", choices=("sglang-cpu",), default="sglang-cpu", help="the real SGLang engine on CPU")
    p.add_argument("--page-size", type=positive_int, default=4, help="KV page / router block size (default 4)")
    p.add_argument("--max-tokens", type=positive_int, default=4, help="max_tokens per request (default 4)")
    p.add_argument("--mm-pads", choices=("sglang", "scalar"), default="sglang",
                   help="sglang: the installed SGLang's own pad values; scalar: SGLang 0.5.21's rule (the shipped "
                        "pair's, the frontend's), loaded into the workers as a stand-in: the aligned control")
    p.add_argument("--sglang", metavar="VERSION", default=None,
                   help="the SGLang release the worker runs, from kvalign matrix's wheel cache (default: the environment's)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for the worker + frontend to be ready")
    p.add_argument("--run-dir", default=None, help="logs, discovery store, capture (default: out/e2e/mm-<time>)")
    p.add_argument("--keep-logs", action="store_true", help="keep the run dir after a pass (always kept on failure)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvalign.commands.release_args import VERSION
    from kvalign.live.cluster.processes import ProcessExited
    from kvalign.live.engines.sglang_cpu import engine_problem
    from kvalign.live.runs.mm import MmLiveOptions, render, run_mm
    from kvalign.live.wire.client import SseError

    version = args.sglang
    if version is not None and not re.match(VERSION, version):
        raise UsageError(f"--sglang takes one release version, got {version!r}")
    problem = engine_problem(version)
    if problem:
        raise UsageError(f"cannot run here: {problem}")
    opts = MmLiveOptions(page_size=args.page_size, max_tokens=args.max_tokens, scalar_pads=args.mm_pads == "scalar",
                         startup_timeout_s=args.startup_timeout, sglang_version=version, keep_logs=True)
    run_dir = Path(args.run_dir or Path("out") / "e2e" / f"mm-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    log(f"kvalign e2e mm: 1 aggregated dynamo.sglang worker on CPU, tiny Qwen2-VL, {args.mm_pads} pad values; "
        f"logs under {run_dir / 'logs'}")
    started = time.monotonic()
    try:
        result = run_mm(run_dir, opts, progress=lambda m: log(f"[{time.monotonic() - started:7.1f}s] {m}"))
    except (ProcessExited, TimeoutError, SseError, RuntimeError) as exc:
        raise UsageError(f"{str(exc).splitlines()[0]} (logs kept under {run_dir / 'logs'})") from None
    print(render(result))
    if result.passed and not args.keep_logs:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        print(f"logs kept under {run_dir}")
    return 0 if result.passed else 1
