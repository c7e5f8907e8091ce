"""A loopback forwarder for SGLang KV events: ``python -m kvalign.live.wire.kv_forwarder SOURCE BIND``.

Before 0.5.23 SGLang's KV-events config has no ``bind``: its publisher connects to the configured
``tcp://127.0.0.1:PORT``, and Dynamo's relay (and kvalign's capture) connect there too, so nothing
would listen. For such a release the harness has SGLang's publisher bind an ``ipc://`` socket
instead (the stand-in's ``kv_events_local_publish`` patch) and runs this process: an XSUB that
connects to that socket and an XPUB bound on the 127.0.0.1 address the relay expects. Frames pass
unchanged; subscriptions travel upstream. Nothing binds a wildcard address.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from urllib.parse import urlparse

import zmq

from kvalign.live.wire.proxy import proxy_until_signalled

LOOPBACK = "127.0.0.1"


def check_bind(endpoint: str) -> str:
    """``endpoint`` if it is ``tcp://127.0.0.1:PORT`` (the only address this forwarder binds)."""
    parsed = urlparse(endpoint)
    if parsed.scheme != "tcp" or parsed.hostname != LOOPBACK or not parsed.port:
        raise ValueError(f"the forwarder binds only tcp://{LOOPBACK}:PORT, got {endpoint!r}")
    return endpoint


def forward(source: str, bind: str) -> None:
    """Run until SIGTERM / SIGINT: ``source`` (SGLang's PUB) -> ``bind`` (the relay's SUB)."""
    ctx = zmq.Context()
    xsub, xpub = ctx.socket(zmq.XSUB), ctx.socket(zmq.XPUB)
    for s in (xsub, xpub):
        s.setsockopt(zmq.LINGER, 0)
    xpub.bind(check_bind(bind))
    xsub.connect(source)
    try:
        proxy_until_signalled(ctx, xsub, xpub)
    finally:
        xsub.close(linger=0)
        xpub.close(linger=0)
        ctx.term()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvalign.live.wire.kv_forwarder")
    ap.add_argument("source", help="SGLang's KV-event PUB endpoint (ipc://...)")
    ap.add_argument("bind", help=f"where the relay subscribes (tcp://{LOOPBACK}:PORT)")
    args = ap.parse_args(argv)
    try:
        check_bind(args.bind)
    except ValueError as exc:
        print(f"kvalign: error: {exc}", file=sys.stderr)
        return 2
    forward(args.source, args.bind)
    return 0


if __name__ == "__main__":
    sys.exit(main())
