"""A loopback ZMQ event-plane broker, so no Dynamo process binds a wildcard address.

In direct mode (the default) every Dynamo event-plane publisher binds ``tcp://0.0.0.0:0``
(hard-coded in ai-dynamo-runtime 1.6.1; ``DYN_EVENT_PLANE_HOST`` only changes the *advertised*
address). Dynamo's broker mode (``DYN_ZMQ_BROKER_URL="xsub=<url> , xpub=<url>"``) makes
publishers and subscribers *connect* to a broker instead, so the only listening sockets are the
broker's, and those bind 127.0.0.1. The broker itself is the textbook XSUB/XPUB proxy.
"""

from __future__ import annotations

import argparse
import sys

import zmq

from kvalign.live.wire.proxy import proxy_until_signalled


def broker_url(xsub: str, xpub: str) -> str:
    """The ``DYN_ZMQ_BROKER_URL`` value for one broker."""
    return f"xsub={xsub} , xpub={xpub}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvalign.live.cluster.broker", description=__doc__.splitlines()[0])
    p.add_argument("--xsub", required=True, help="publishers connect here, e.g. tcp://127.0.0.1:5601")
    p.add_argument("--xpub", required=True, help="subscribers connect here, e.g. tcp://127.0.0.1:5602")
    args = p.parse_args(argv)
    ctx = zmq.Context()
    front, back = ctx.socket(zmq.XSUB), ctx.socket(zmq.XPUB)
    for sock in (front, back):
        sock.setsockopt(zmq.LINGER, 0)
    front.bind(args.xsub)
    back.bind(args.xpub)
    try:
        proxy_until_signalled(ctx, front, back)
    finally:
        front.close()
        back.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
