"""``kvalign watch``: live per-batch view of a worker's KV events; Ctrl-C prints a summary, exit 0."""

from __future__ import annotations

import argparse
import signal
import threading
import time

from kvalign.capture import CaptureError
from kvalign.commands.options import positive_float, positive_int
from kvalign.subscribe import Subscription
from kvalign.watch import Watcher

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
    p.set_defaults(run=run)


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    watcher = Watcher(block_size=args.block_size, router_eagle=args.router_eagle)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    try:
        with Subscription(args.endpoint, topic=args.topic, bind=args.bind) as subscription:
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
