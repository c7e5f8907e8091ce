"""The XSUB -> XPUB proxy of the event-plane broker and of the KV forwarder: both relay on loopback,
and both stop at once on SIGTERM or ctrl-c (CI once saw the broker outlive a 5 s wait)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq

from kvalign.live.cluster.ports import PortPool

SIGNALS = pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])


def _relayed(pub: zmq.Socket, sub: zmq.Socket, frames: list[bytes], timeout_s: float = 20.0) -> list[bytes] | None:
    """Publish ``frames`` until ``sub`` receives them (ZMQ's slow joiner), bounded by ``timeout_s``."""
    sub.setsockopt(zmq.RCVTIMEO, 200)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pub.send_multipart(frames)
        try:
            return sub.recv_multipart()
        except zmq.Again:
            pass
    return None


def _relays_then_stops(argv: list[str], wire: Callable[[zmq.Socket, zmq.Socket], None], topic: bytes, sig: int) -> None:
    """Start the proxy process, wire a PUB and a SUB to it (``wire``), see one message through, then
    signal it with traffic in flight: it must exit 0 within 10 s (milliseconds when idle)."""
    proc = subprocess.Popen([sys.executable, "-m", *argv])
    ctx = zmq.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    try:
        wire(pub, sub)
        sub.setsockopt(zmq.SUBSCRIBE, topic)
        assert _relayed(pub, sub, [topic, b"hello"]) == [topic, b"hello"]
        pub.send_multipart([topic, b"more"])  # traffic in flight does not hold the stop up
        started = time.monotonic()
        proc.send_signal(sig)
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - started < 10
    finally:
        if proc.poll() is None:
            proc.kill()
        for s in (pub, sub):
            s.close(linger=0)
        ctx.term()


@SIGNALS
def test_broker_relays_publishers_to_subscribers_on_loopback_and_stops_on_a_signal(sig):
    pool = PortPool()
    xsub, xpub = (f"tcp://127.0.0.1:{pool.take(n)}" for n in ("xsub", "xpub"))

    def wire(pub: zmq.Socket, sub: zmq.Socket) -> None:  # both connect: only the broker listens
        pub.connect(xsub)
        sub.connect(xpub)

    _relays_then_stops(["kvalign.live.cluster.broker", "--xsub", xsub, "--xpub", xpub], wire, b"t", sig)


@SIGNALS
def test_forwarder_relays_an_ipc_publisher_to_loopback_and_stops_on_a_signal(tmp_path: Path, sig):
    source, bind = f"ipc://{tmp_path}/pub", f"tcp://127.0.0.1:{PortPool().take('fwd')}"

    def wire(pub: zmq.Socket, sub: zmq.Socket) -> None:  # SGLang's publisher binds; the relay connects
        pub.bind(source)
        sub.connect(bind)

    _relays_then_stops(["kvalign.live.wire.kv_forwarder", source, bind], wire, b"", sig)
