"""``kvalign live``: run the real Dynamo frontend + KV router in front of CPU workers, on 127.0.0.1.

Workers (``--engine``): ``fake-cpu`` (default) are kvalign's fake workers keyed by SGLang's real
radix cache (seconds to start, no model); ``sglang-cpu`` is the real ``dynamo.sglang`` engine on
CPU with a tiny offline Llama and EAGLE3 draft (about a minute to start, ~2.4 GB per worker).

* ``kvalign live plan ...`` prints every process it would start (env + command), starts nothing;
* ``kvalign live up ...`` starts them, waits until the frontend serves, prints where everything
  is, then either runs the prefix-extension scenario (``--scenario``: per-request table, checks,
  exit 1 when a check fails) or holds until Ctrl-C / ``--hold`` seconds. Every process is torn
  down on every exit path; logs stay in the run directory.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from kvalign.commands import hicache_option
from kvalign.errors import UsageError
from kvalign.live.cluster.lifecycle import Cluster, plan_specs, with_routers
from kvalign.live.runs.disagg_eagle import E2eOptions
from kvalign.live.engines.kinds import ENGINE_KINDS
from kvalign.live.cluster.processes import ProcessExited, sigterm_as_interrupt
from kvalign.live.cluster.routers import APPROX_POLICIES, ROUTER_MODES, RouterSetup
from kvalign.live.cluster.topology import (
    CONTROL_PLANES,
    ClusterPlan,
    Topology,
    WorkerKind,
    control_plane_missing,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("live", help="run Dynamo's frontend + KV router with CPU workers (fake or real SGLang)")
    live = p.add_subparsers(dest="live_command", required=True, parser_class=type(p))
    for name, help_ in (("plan", "print the processes a live run would start (dry run)"),
                        ("up", "start a live cluster on 127.0.0.1 and run or hold it")):
        q = live.add_parser(name, help=help_)
        q.add_argument("--engine", choices=("fake-cpu", "sglang-cpu"), default="fake-cpu",
                       help="fake-cpu: SGLang radix cache, no model (default); sglang-cpu: real dynamo.sglang on CPU")
        q.add_argument("--draft", choices=("agree", "disagree"), default="agree",
                       help="sglang-cpu: EAGLE3 draft that the target accepts, or never accepts (negative control)")
        q.add_argument("--workers", type=int, default=None,
                       help="aggregated workers (ignored with --prefill; default 2, 1 with --dp-size)")
        q.add_argument("--dp-size", type=int, default=1, metavar="N",
                       help="with --engine sglang-cpu: SGLang's --dp-size on each aggregated worker (N schedulers, KV "
                            "caches and KV-event streams, registered as ranks [0, N) of one Dynamo worker)")
        q.add_argument("--dp-attention", action="store_true",
                       help="with --dp-size N: the ranks are attention-DP groups of one TP group "
                            "(--tp-size N --attn-dp-size N) instead of replicas")
        q.add_argument("--prefill", type=int, default=0, help="prefill workers (disaggregated topology)")
        q.add_argument("--decode", type=int, default=1, help="decode workers with --prefill")
        q.add_argument("--eagle", action=argparse.BooleanOptionalAction, default=True,
                       help="EAGLE engine: bigram-keyed radix cache (default on)")
        q.add_argument("--register-eagle", choices=("auto", "on", "off"), default="auto",
                       help="router-facing enable_eagle (auto = as dynamo.sglang derives it; off+--eagle = negative control)")
        q.add_argument("--page-size", type=int, default=16, help="KV block / page size shared by router and workers")
        q.add_argument("--run-dir", default=None, help="logs, discovery store, model dir (default: a new temp dir)")
        q.add_argument("--startup-timeout", type=float, default=None,
                       help="seconds to wait for readiness (default 120 fake-cpu, 400 sglang-cpu)")
        q.add_argument("--sglang", metavar="VERSION", default=None,
                       help="with --engine sglang-cpu: the SGLang release the workers run, from kvalign matrix's "
                            "wheel cache (default: the environment's)")
        q.add_argument("--dynamo", metavar="VERSION", default=None,
                       help="with --engine fake-cpu: the Dynamo release every process runs (frontend, router, the "
                            "workers' runtime bindings), from kvalign matrix's wheel cache (default: the environment's)")
        q.add_argument("--control-plane", choices=CONTROL_PLANES, default="file",
                       help="file: file discovery + zmq events, no service (default); etcd-nats: start etcd + "
                            "nats-server on loopback, etcd discovery + NATS events")
        add_router_arguments(q)
        hicache_option.add(q)
        if name == "up":
            q.add_argument("--scenario", action="store_true",
                           help="run the 4-request prefix scenario and check it; with --routers 2+ the router-replica "
                                "scenario (routers_agree after stores, a router restart, an event-plane interruption)")
            q.add_argument("--requests", type=int, default=4, help="requests in the scenario")
            q.add_argument("--hold", type=float, default=None, help="without --scenario: seconds to stay up (default: until Ctrl-C)")
        q.set_defaults(run=run)


def add_router_arguments(q: argparse.ArgumentParser) -> None:
    """``--routers``, ``--router-mode`` and their options (``live`` and ``e2e fuzz`` share them)."""
    q.add_argument("--routers", type=int, default=1,
                   help="dynamo.frontend replicas, each with its own KV router; 2+ start with --router-replica-sync, "
                        "as Dynamo documents replicas (default 1)")
    q.add_argument("--router-mode", choices=ROUTER_MODES, default="events",
                   help="events: routers index the workers' KV events (default); approx: --no-router-kv-events, each "
                        "router predicts the cache from its own routing decisions")
    q.add_argument("--approx-policy", choices=APPROX_POLICIES, default="ttl",
                   help="approx mode: --router-approximate-cache-policy (default ttl)")
    q.add_argument("--router-ttl", type=float, default=None, metavar="SECONDS",
                   help="approx mode: --router-ttl-secs (default Dynamo's, 120)")
    q.add_argument("--no-replica-sync", dest="replica_sync", action="store_false",
                   help="negative control of routers_agree: the second router (router1) runs without "
                        "--router-replica-sync")


def router_setup(args: argparse.Namespace) -> RouterSetup:
    """The routers the arguments ask for (one line and exit 2 when they make no sense)."""
    if not args.replica_sync and args.routers < 2:
        raise UsageError("--no-replica-sync needs --routers 2 or more (it starts the second router without sync)")
    try:
        return RouterSetup(args.routers, args.router_mode, frozenset() if args.replica_sync else frozenset({1}),
                           args.approx_policy, args.router_ttl)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _topology(args: argparse.Namespace) -> Topology:
    if args.page_size < 1:
        raise UsageError(f"--page-size must be >= 1, got {args.page_size}")
    reg = {"auto": None, "on": True, "off": False}[args.register_eagle]
    if args.prefill:
        if args.prefill < 1 or args.decode < 1:
            raise UsageError("a disaggregated topology needs --prefill >= 1 and --decode >= 1")
        if args.dp_size != 1:
            raise UsageError("--dp-size runs aggregated workers only (not with --prefill)")
        return Topology.disaggregated(args.prefill, args.decode, eagle=args.eagle, register_eagle=reg, page_size=args.page_size)
    if args.dp_size < 1:
        raise UsageError(f"--dp-size must be >= 1, got {args.dp_size}")
    if args.dp_size > 1 and args.engine != "sglang-cpu":
        raise UsageError("--dp-size needs --engine sglang-cpu (the fake workers have one KV cache each)")
    if args.workers is None:
        args.workers = 2 if args.dp_size == 1 else 1
    if args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    if args.dp_attention and args.dp_size < 2:
        raise UsageError("--dp-attention needs --dp-size 2 or more")
    return Topology.aggregated(args.workers, eagle=args.eagle, register_eagle=reg, page_size=args.page_size,
                               dp_size=args.dp_size, dp_attention=args.dp_attention)


def _plan(args: argparse.Namespace) -> tuple[ClusterPlan, WorkerKind]:
    """This topology (live's own: aggregated or disaggregated, any eagle setting) on the engine's workers."""
    from kvalign.commands.e2e import release_version

    topology = _topology(args)
    try:
        opts = E2eOptions(engine=args.engine, draft=args.draft, control_plane=args.control_plane,
                          sglang=release_version(args.sglang), dynamo=release_version(args.dynamo, "--dynamo"),
                          hicache=hicache_option.hicache_from(args))
    except ValueError as exc:  # an option this engine does not take
        raise UsageError(str(exc)) from None
    routers = router_setup(args)
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="kvalign-live-"))
    try:
        plan, kind = opts.kind.plan(topology, run_dir, opts)
    except RuntimeError as exc:  # an unsupported release, or one that cannot be installed
        raise UsageError(str(exc).splitlines()[0]) from None
    return with_routers(plan, routers), kind


def run(args: argparse.Namespace) -> int:
    plan, kind = _plan(args)
    if args.startup_timeout is None:
        args.startup_timeout = ENGINE_KINDS[args.engine].live_startup_timeout_s
    if args.live_command == "plan":
        for spec in plan_specs(plan, kind):
            print(f"# {spec.name}\n{spec.command_line()}\n")
        return 0
    return _up(args, plan, kind)


def _up(args: argparse.Namespace, plan: ClusterPlan, kind: WorkerKind) -> int:
    from kvalign.live.runs import scenario

    missing = control_plane_missing(plan.control_plane)
    if missing:
        raise UsageError(f"cannot run here: {missing}")
    fronts = "frontend" if plan.routers.count == 1 else plan.routers.describe()
    print(f"kvalign live: starting {len(plan.topology.workers)} worker(s) + {fronts}; logs in {plan.run_dir / 'logs'}",
          file=sys.stderr)
    try:
        with sigterm_as_interrupt(), Cluster(plan, kind, startup_timeout_s=args.startup_timeout) as cluster:
            print(f"frontend  {cluster.frontend_url}  model {cluster.model!r}  ready in {cluster.ready_s:.1f}s")
            for i, url in enumerate(plan.frontend_urls[1:], start=1):
                print(f"router{i}   {url}  (frontend{i}; {' '.join(plan.routers.flags(i)) or 'no extra flags'})")
            for name, h in cluster.workers.items():
                n = plan.worker_ports[name].kv_ranks
                events = h.kv_events_endpoint if n == 1 or not h.kv_events_endpoint else ", ".join(
                    f"rank {r} {plan.kv_events_connect(h.spec, r)}" for r in range(n))
                print(f"{name:<9} role={h.spec.role:<7} instance_id={h.instance_id} enable_eagle={h.enable_eagle} "
                      f"kv_events={events}")
            sys.stdout.flush()
            if not args.scenario:
                _hold(args.hold)
                return 0
            if plan.routers.replicated:
                return _replica_scenario(cluster, args.requests)
            records = scenario.run_prefix_extension(cluster, args.requests)
            print(scenario.table(records))
            return _verdict(cluster, records, plan)
    except ProcessExited as exc:
        raise UsageError(f"{str(exc).splitlines()[0]} (logs kept in {plan.run_dir / 'logs'})") from None


def _replica_scenario(cluster: Cluster, prompts: int) -> int:
    from kvalign.live.runs.replica_scenario import ReplicaScenario

    report = ReplicaScenario(cluster, progress=lambda m: print(m, file=sys.stderr, flush=True)).run(prompts)
    print(report.render())
    return 0 if report.passed else 1


def _hold(seconds: float | None) -> None:
    print("holding; Ctrl-C to stop", file=sys.stderr)
    try:
        if seconds is None:
            while True:
                time.sleep(3600)
        time.sleep(seconds)
    except KeyboardInterrupt:
        pass


def _verdict(cluster: Cluster, records: list, plan: ClusterPlan) -> int:
    from kvalign.live.runs import scenario

    checks = [scenario.check_timing, scenario.check_prompt_tokens, scenario.check_same_worker,
              scenario.check_hit_positive, scenario.check_prediction]
    if plan.topology.disaggregated_mode:
        checks.append(lambda rs: scenario.check_not_decode(rs, cluster.ids_by_role("decode")))
    failed = False
    for check in checks:
        try:
            check(records)
        except AssertionError as exc:
            failed = True
            print(f"FAIL {getattr(check, '__name__', 'check_not_decode')}: {str(exc).splitlines()[0]}")
    if failed and len(records) > 1:
        from kvalign.commands.diagnose import render

        d = scenario.diagnose(cluster, records[1])
        print(f"$ kvalign {' '.join(d.cli_args)}")
        print(render(d.report))
    print("PASS" if not failed else f"FAIL (logs in {plan.run_dir / 'logs'})")
    return 1 if failed else 0
