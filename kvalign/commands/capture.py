"""``kvalign capture``: record an SGLang worker's ZMQ KV-event stream to a capture file."""

from __future__ import annotations

import argparse
import signal
import threading
import time

from kvalign.streams.capture import CaptureError, CaptureWriter
from kvalign.commands.options import positive_float, positive_int
from kvalign.runtime_log import console
from kvalign.streams.subscribe import Subscription


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("capture", help="record a worker's KV-event stream (ZMQ) to a JSONL capture")
    p.add_argument("--endpoint", required=True, help="the worker's KV-event endpoint, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--topic", default=None, help="only batches on this topic (default: any topic)")
    p.add_argument("--out", required=True, help="capture file to create (never overwritten without --force)")
    stop = p.add_mutually_exclusive_group()
    stop.add_argument("--duration", type=positive_float, default=None, metavar="S", help="stop after S seconds")
    stop.add_argument("--count", type=positive_int, default=None, metavar="N", help="stop after N batches")
    p.add_argument("--timeout", type=positive_float, default=10.0, metavar="S",
                   help="fail if no batch arrives within S seconds (default 10)")
    p.add_argument("--bind", action="store_true", help="bind the endpoint (for a publisher that connects)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p.set_defaults(run=run)


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    writer = CaptureWriter(args.out, force=args.force, endpoint=args.endpoint, topic=args.topic)
    try:
        with Subscription(args.endpoint, topic=args.topic, bind=args.bind) as subscription:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, _terminate)  # a service manager's stop = Ctrl-C
            if console().isatty():  # for a person watching; scripts get one line (summary or error)
                print(f"kvalign capture: listening on {args.endpoint} -> {args.out}", file=console(), flush=True)
            record(subscription, writer, count=args.count, duration=args.duration, timeout=args.timeout)
    except KeyboardInterrupt:
        pass
    finally:
        removed = writer.discard_if_empty()
    if removed:
        raise CaptureError(f"no batch arrived; nothing written ({args.out} not kept)")
    print(f"kvalign capture: {writer.stats.summary()} -> {args.out}", file=console())
    return 0


def record(
    subscription: Subscription, writer: CaptureWriter, *, count: int | None = None, duration: float | None = None,
    timeout: float = 10.0, stop: threading.Event | None = None,
) -> None:
    """Write received batches until ``count`` batches, ``duration`` seconds, or ``stop`` is set.

    Raises :class:`CaptureError` naming the reason when no batch arrives within ``timeout``.
    """
    start = time.monotonic()
    end = start + duration if duration else None
    while count is None or writer.stats.batches < count:
        now = time.monotonic()
        if (end is not None and now >= end) or (stop is not None and stop.is_set()):
            break
        if writer.stats.batches == 0:
            wait = min(start + timeout, end or float("inf")) - now
            if wait <= 0:
                raise CaptureError(subscription.silence_reason(min(timeout, duration or timeout)))
        else:
            wait = (end - now) if end is not None else 0.5
        frames = subscription.recv(min(wait, 0.1) if stop is not None else wait)
        if frames is None:
            continue
        writer.write_frames(frames, time.time())
