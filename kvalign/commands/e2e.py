"""``kvalign e2e plan|run``: the EAGLE3 prefill/decode scenario outside pytest.

``plan`` is a dry run: it prints every process the run would start — exact argv, the
environment each one gets, start order — and what this machine lacks, and starts nothing.
``run`` launches it through the shared live harness, shows progress, and prints the
per-request table and the assertions (exit 0 pass, 1 an assertion failed, 2 cannot run here).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from kvalign.commands import e2e_mm, fuzz, hicache_option
from kvalign.errors import UsageError
from kvalign.live.runs import disagg_eagle
from kvalign.live.cluster.lifecycle import Cluster, plan_specs
from kvalign.live.wire.client import SseError
from kvalign.live.engines.engine_model import PAIRS
from kvalign.live.engines.sglang_cpu import TRANSFER_BACKENDS
from kvalign.live.engines.vllm_cpu import DEFAULT_BLOCK_SIZE as VLLM_BLOCK_SIZE
from kvalign.live.runs.disagg_eagle import ENGINES, E2eOptions
from kvalign.live.cluster.processes import ProcessExited, ProcessSpec
from kvalign.live.cluster.topology import CONTROL_PLANES, ClusterPlan, control_plane_missing
from kvalign.live.engines.sglang_worker import ROUTER_EAGLE_ENV, default_models, router_eagle_from

RUN_DIR_VAR = "$RUN_DIR"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("e2e", help="plan or run the EAGLE3 prefill/decode scenario behind Dynamo's KV router")
    actions = p.add_subparsers(dest="e2e_action", required=True, parser_class=type(p))
    plan = actions.add_parser("plan", help="print the exact commands and environment a run would launch (dry run)")
    _add_options(plan)
    plan.add_argument("--check", action="store_true", help="also try importing dynamo.sglang (slow)")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(run=run_plan)
    run = actions.add_parser("run", help="run the scenario with progress, a per-request table and the assertions")
    _add_options(run)
    run.add_argument("--run-dir", default=None, help="logs, discovery store (default: out/e2e/run-<time>)")
    run.add_argument("--keep-logs", action="store_true", help="keep the run dir after a pass (always kept on failure)")
    run.add_argument("--json", action="store_true",
                     help="print one JSON object: the run, each assertion's values and the machine (torch, GPU, releases)")
    run.set_defaults(run=run_run)
    fuzz.register(actions)
    e2e_mm.register(actions)


def _add_options(p: argparse.ArgumentParser) -> None:
    model, draft = default_models()
    p.add_argument("--model", default=model, help=f"target model path or HF id (env KVALIGN_MODEL; default {model})")
    p.add_argument("--draft-model", default=draft, help=f"EAGLE3 draft (env KVALIGN_DRAFT_MODEL; default {draft})")
    p.add_argument("--engine", choices=ENGINES, default=None,
                   help="sglang-gpu: real dynamo.sglang on GPUs (default); sglang-cpu: the same real engine on "
                        "this CPU with a tiny offline Llama + EAGLE3 draft; fake-cpu: kvalign's fake workers "
                        "(SGLang radix cache, no model, no speculation)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--single-gpu", action="store_true", help="everything on GPU 0, memory fractions split")
    mode.add_argument("--cpu", action="store_true", help="same as --engine fake-cpu")
    p.add_argument("--draft", choices=("agree", "disagree"), default="agree",
                   help="sglang-cpu: disagree = a draft the target never accepts (negative control for assertion 4)")
    p.add_argument("--prefill", type=int, default=2, help="prefill workers (default 2)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    p.add_argument("--router-eagle", choices=("on", "off"), default=None,
                   help=f"off = negative control: router hashes plain (env {ROUTER_EAGLE_ENV})")
    p.add_argument("--page-size", type=int, default=None,
                   help="KV page / router block size (default 16; 32 with --engine vllm-cpu, whose CPU attention "
                        "backend needs a multiple of 32)")
    p.add_argument("--requests", type=int, default=4, help="prefix-extending requests (default 4)")
    p.add_argument("--max-tokens", type=int, default=10, help="max_tokens per request (default 10)")
    p.add_argument("--bind-host", choices=("0.0.0.0", "127.0.0.1"), default="0.0.0.0",
                   help="SGLang --host and KV-event bind (127.0.0.1 needs sglang >= 0.5.23)")
    p.add_argument("--mem-fraction-static", type=float, default=None, help="override the per-GPU split")
    p.add_argument("--context-length", type=int, default=4096, help="SGLang --context-length (0 = model default)")
    p.add_argument("--cuda-graph", action="store_true", help="keep CUDA graphs (default: --disable-cuda-graph)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for workers + frontend to be ready")
    p.add_argument("--sglang", metavar="VERSION", default=None,
                   help="with --engine sglang-cpu: the SGLang release the workers run, from kvalign matrix's wheel "
                        "cache (installed on first use; default: the environment's)")
    p.add_argument("--dynamo", metavar="VERSION", default=None,
                   help="with --engine fake-cpu: the Dynamo release every process runs (frontend, router, the "
                        "workers' runtime bindings), from kvalign matrix's wheel cache (default: the environment's)")
    p.add_argument("--control-plane", choices=CONTROL_PLANES, default="file",
                   help="file: file discovery + zmq events, no service (default); etcd-nats: start etcd + "
                        "nats-server on loopback, etcd discovery + NATS events")
    p.add_argument("--transfer", choices=TRANSFER_BACKENDS, default=None,
                   help="real engines: SGLang's prefill->decode transfer backend (sglang-cpu default nixl: the KV "
                        "moves over UCX/TCP on 127.0.0.1, SGLang's checksum verifies it; fake = negative control, "
                        "decode without the KV; sglang-gpu default fake)")
    p.add_argument("--pair", choices=PAIRS, default="kv",
                   help="real engines, tiny models: kv = the target's output depends on the prompt's KV and the "
                        "draft's acceptance on its own state (default); zero-head = constant output, every draft "
                        "token accepted")
    p.add_argument("--no-compare-aggregated", dest="compare_aggregated", action="store_false",
                   help="real engines: skip assertion 5 (the same prompts on one aggregated worker, outputs and "
                        "speculation compared request by request)")
    p.add_argument("--checksum-mismatch-prob", type=float, default=0.0, metavar="P",
                   help="real engines: SGLang's own KV-checksum mismatch injector on decode "
                        "(SGLANG_TEST_DISAGG_KV_CHECKSUM_MISMATCH_PROB; negative control of assertion 6)")
    hicache_option.add(p)


def options(args: argparse.Namespace) -> E2eOptions:
    eagle = router_eagle_from(args.router_eagle if args.router_eagle is not None else os.environ.get(ROUTER_EAGLE_ENV))
    if args.cpu and args.engine not in (None, "fake-cpu"):
        raise UsageError(f"--cpu means --engine fake-cpu; it conflicts with --engine {args.engine}")
    engine = "fake-cpu" if args.cpu else args.engine or "sglang-gpu"
    if args.page_size is None:
        args.page_size = VLLM_BLOCK_SIZE if engine == "vllm-cpu" else 16
    if args.page_size < 1:
        raise UsageError(f"--page-size must be >= 1, got {args.page_size}")
    if args.single_gpu and engine != "sglang-gpu":
        raise UsageError(f"--single-gpu applies to --engine sglang-gpu, not {engine}")
    try:
        return _options(args, eagle, engine)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _options(args: argparse.Namespace, eagle: bool, engine: str) -> E2eOptions:
    return E2eOptions(
        model=args.model, draft_model=args.draft_model, engine=engine, draft=args.draft, single_gpu=args.single_gpu,
        prefill=args.prefill, decode=args.decode, router_eagle=eagle, page_size=args.page_size,
        requests=args.requests, max_tokens=args.max_tokens, bind_host=args.bind_host,
        mem_fraction_static=args.mem_fraction_static, context_length=args.context_length or None,
        cuda_graph=args.cuda_graph, startup_timeout_s=args.startup_timeout, control_plane=args.control_plane,
        sglang=release_version(args.sglang), dynamo=release_version(args.dynamo, "--dynamo"),
        hicache=hicache_option.hicache_from(args), transfer=getattr(args, "transfer", None),
        pair=getattr(args, "pair", "kv"), compare_aggregated=getattr(args, "compare_aggregated", True),
        checksum_mismatch_prob=getattr(args, "checksum_mismatch_prob", 0.0),
    )


def release_version(text: str | None, flag: str = "--sglang") -> str | None:
    """``--sglang`` / ``--dynamo``: one release version, or None."""
    from kvalign.commands.release_args import VERSION

    if text is not None and not re.match(VERSION, text):
        raise UsageError(f"{flag} takes one release version, got {text!r}")
    return text


def _format_argv(argv: list[str]) -> str:
    """One flag (with its value) per continuation line, shell-quoted."""
    head, rest = [], argv
    while rest and not rest[0].startswith("--"):
        head.append(rest[0])
        rest = rest[1:]
    parts = [" ".join(shlex.quote(a) for a in head)]
    i = 0
    while i < len(rest):
        if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            parts.append(f"{rest[i]} {shlex.quote(rest[i + 1])}")
            i += 2
        else:
            parts.append(rest[i])
            i += 1
    return " \\\n      ".join(parts)


def render_plan(opts: E2eOptions, specs: list[ProcessSpec], plan: ClusterPlan, problems: list[str],
                checked_import: bool) -> str:
    common = plan.plane_env()
    out = [f"kvalign e2e plan: {opts.describe()}", *opts.kind.model_lines(opts, plan)]
    out += [f"namespace {plan.namespace}; frontend {plan.frontend_url}; ports were free at planning time "
            "(`e2e run` allocates its own); RUN_DIR = the run's --run-dir"]
    out.append(f"control plane: {plan.control_plane} (" + ", ".join(f"{k} {v}" for k, v in plan.planes.items()) + ")")
    if opts.cpu:
        out.append("prerequisites: the CPU live stack (scripts/setup.sh); checked when the run starts")
        out += [f"  - missing: {p}" for p in problems]
    elif problems:
        out.append("prerequisites missing on this machine (a run would stop; pytest would skip):")
        out += [f"  - {p}" for p in problems]
    else:
        out.append("prerequisites: all present" + ("" if checked_import else " (dynamo.sglang import not tried; use --check)"))
    out.append("plane environment (PLANE below; on top of the inherited one):")
    out += [f"  {k}={v}" for k, v in sorted(common.items())]
    for i, s in enumerate(specs, 1):
        has_plane = all(s.env.get(k) == v for k, v in common.items())
        own = {k: v for k, v in s.env.items() if not (has_plane and k in common)}
        out.append(f"[{i}/{len(specs)}] {s.name}")
        words = (["PLANE"] if has_plane else []) + [f"{k}={shlex.quote(v)}" for k, v in sorted(own.items())]
        out.append("  env: " + (" ".join(words) if words else "inherited only"))
        out.append("  $ " + _format_argv(s.argv))
    first = "wait for etcd /health and the NATS INFO greeting, then " if plan.control_plane == "etcd-nats" else ""
    out.append(f"then: {first}wait for every worker in discovery, start the KV-event capture and the frontend, "
               "wait for /v1/models + one probe; send the requests; scrape decode /metrics after each")
    return "\n".join(out)


def run_plan(args: argparse.Namespace) -> int:
    opts = options(args)
    tmp = Path(tempfile.mkdtemp(prefix="kvalign-e2e-plan-"))
    try:
        try:
            plan, kind = disagg_eagle.build(opts, tmp)
        except RuntimeError as exc:
            raise UsageError(str(exc).splitlines()[0]) from None
        specs = plan_specs(plan, kind)
        pre = disagg_eagle.prerequisites(opts, import_check=args.check)
        problems = list(pre.problems) if pre else []
        problems += [m for m in [control_plane_missing(opts.control_plane)] if m]
        if args.json:
            text = json.dumps({
                "description": opts.describe(), "router_eagle": opts.router_eagle,
                "processes": [{"name": s.name, "argv": s.argv, "env": s.env} for s in specs],
                "missing_prerequisites": problems,
            }, indent=2)
        else:
            text = render_plan(opts, specs, plan, problems, args.check)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(text.replace(str(tmp.resolve()), RUN_DIR_VAR).replace(str(tmp), RUN_DIR_VAR))
    return 0


def run_run(args: argparse.Namespace) -> int:
    opts = options(args)
    progress = disagg_eagle.Progress(lambda m: print(m, file=sys.stderr, flush=True))
    progress(f"kvalign e2e run: {opts.describe()}")
    pre = disagg_eagle.prerequisites(opts)
    problems = [*(pre.problems if pre is not None else []), *[m for m in [control_plane_missing(opts.control_plane)] if m]]
    if problems:
        raise UsageError("cannot run here: " + "; ".join(problems))
    run_dir = Path(args.run_dir or Path("out") / "e2e" / f"run-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    try:
        plan, kind = disagg_eagle.build(opts, run_dir)
    except RuntimeError as exc:  # the release could not be installed into the wheel cache
        raise UsageError(str(exc).splitlines()[0]) from None
    specs = plan_specs(plan, kind)
    progress(f"starting {len(specs)} processes ({', '.join(s.name for s in specs)}); logs under {run_dir / 'logs'}")
    t0 = time.monotonic()
    try:
        with Cluster(plan, kind, startup_timeout_s=opts.startup_timeout_s, keep_logs=True) as cluster:
            started = time.monotonic() - t0
            progress("cluster ready: " + ", ".join(
                f"{n}={h.instance_id} (enable_eagle={h.enable_eagle})" for n, h in cluster.workers.items()))
            result = disagg_eagle.run(cluster, opts, progress)
        if opts.decode_half:
            reference = None
            if opts.compare_aggregated:
                progress("the same prompts on one aggregated worker (assertion 5's reference)")
                reference = disagg_eagle.reference(opts, run_dir / "aggregated", progress)
            disagg_eagle.judge_decode_half(result, reference)
    except (ProcessExited, TimeoutError, SseError) as exc:
        raise UsageError(f"{str(exc).splitlines()[0]} (logs kept under {run_dir / 'logs'})") from None
    if args.json:
        from kvalign.live.engines.gpu import environment

        print(json.dumps({"description": opts.describe(), "engine": opts.engine, "page_size": opts.page_size,
                          "prefill": opts.prefill, "decode": opts.decode, "environment": environment(),
                          "cluster_start_s": round(started, 1), "run_s": round(time.monotonic() - t0 - started, 1),
                          **result.as_json()}, indent=1))
    else:
        print(result.report())
    if result.passed and not args.keep_logs:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        print(f"logs kept under {run_dir / 'logs'}", file=sys.stderr if args.json else sys.stdout)
    return 0 if result.passed else 1
