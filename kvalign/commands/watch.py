"""``kvalign watch``: live per-batch view of a worker's KV events; Ctrl-C prints a summary, exit 0.

With ``--metrics-port`` it also serves the same counts as Prometheus metrics (a sidecar beside the
worker), bound to 127.0.0.1 unless ``--metrics-host`` says otherwise.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from typing import Any

from kvalign.streams.capture import CaptureError
from kvalign.errors import UsageError
from kvalign.commands.options import positive_float, positive_int
from kvalign.streams.subscribe import Subscription
from kvalign.streams.watch import Watcher

NO_PUBLISHER_NOTICE_S = 5.0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("watch", help="show a worker's KV-event stream live, as the router would index it")
    p.add_argument("--endpoint", required=True, help="the worker's KV-event endpoint, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--topic", default=None, help="only batches on this topic (default: any topic)")
    p.add_argument("--router-eagle", choices=("auto", "on", "off"), default="auto",
                   help="flag blocks a router with this EAGLE setting could never match")
    p.add_argument("--block-size", type=positive_int, default=None,
                   help="router kv_block_size (default: the engine's, from the first stored event)")
    p.add_argument("--timeout", type=positive_float, default=None, metavar="S",
                   help="fail if no batch arrives within S seconds (default: wait)")
    p.add_argument("--bind", action="store_true", help="bind the endpoint (for a publisher that connects)")
    p.add_argument("--router-salt", choices=("on", "off"), default="on",
                   help="off: the router hashes queries without cache_salt (Dynamo before 1.5), so salted blocks "
                        "count as router-blind")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics on PORT (0: any free port; the line 'metrics on URL' says which)")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="address the metrics server binds (default 127.0.0.1)")
    p.add_argument("--worker", default=None, metavar="NAME", help="the metrics' worker label (default: the endpoint)")
    p.set_defaults(run=run)


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _serve_metrics(args: argparse.Namespace, watcher: Watcher) -> Any:
    from kvalign.streams.watch_metrics import serve

    try:
        server = serve({args.worker or args.endpoint: watcher}, args.metrics_host, args.metrics_port)
    except OSError as exc:
        raise UsageError(f"cannot serve metrics on {args.metrics_host}:{args.metrics_port}: {exc.strerror or exc}") from None
    print(f"metrics on http://{args.metrics_host}:{server.server_port}/metrics", flush=True)
    return server


def run(args: argparse.Namespace) -> int:
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise UsageError(f"--metrics-port must be 0..65535, got {args.metrics_port}")
    watcher = Watcher(block_size=args.block_size, router_eagle=args.router_eagle, router_salt=args.router_salt == "on")
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    server = None
    try:
        with Subscription(args.endpoint, topic=args.topic, bind=args.bind) as subscription:
            server = _serve_metrics(args, watcher) if args.metrics_port is not None else None
            print(f"watching {args.endpoint} (Ctrl-C for a summary)", flush=True)
            start, noticed = time.monotonic(), False
            while True:
                frames = subscription.recv(0.5)
                if frames is not None:
                    for line in watcher.on_frames(frames):
                        print(line, flush=True)
                    continue
                waited = time.monotonic() - start
                if watcher.totals.batches == 0:
                    if args.timeout is not None and waited >= args.timeout:
                        raise CaptureError(subscription.silence_reason(args.timeout))
                    if not noticed and waited >= NO_PUBLISHER_NOTICE_S:
                        print(f"still waiting: {subscription.silence_reason(waited)}", flush=True)
                        noticed = True
    except KeyboardInterrupt:
        print(watcher.summary(), flush=True)
        return 0
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
