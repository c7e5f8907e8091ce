"""The XSUB -> XPUB proxy of the event-plane broker and of the KV forwarder: both relay on loopback,
and both stop at once on SIGTERM or ctrl-c (CI once saw the broker outlive a 5 s wait)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
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


def _stops(proc: subprocess.Popen, sig: int, pub: zmq.Socket, frames: list[bytes]) -> None:
    pub.send_multipart(frames)  # traffic in flight does not hold the stop up
    started = time.monotonic()
    proc.send_signal(sig)
    assert proc.wait(timeout=10) == 0  # milliseconds when idle
    assert time.monotonic() - started < 10


@SIGNALS
def test_broker_relays_publishers_to_subscribers_on_loopback_and_stops_on_a_signal(sig):
    pool = PortPool()
    xsub, xpub = (f"tcp://127.0.0.1:{pool.take(n)}" for n in ("xsub", "xpub"))
    broker = subprocess.Popen([sys.executable, "-m", "kvalign.live.cluster.broker", "--xsub", xsub, "--xpub", xpub])
    ctx = zmq.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    try:
        pub.connect(xsub)
        sub.connect(xpub)
        sub.setsockopt(zmq.SUBSCRIBE, b"t")
        assert _relayed(pub, sub, [b"t", b"hello"]) == [b"t", b"hello"]
        _stops(broker, sig, pub, [b"t", b"more"])
    finally:
        if broker.poll() is None:
            broker.kill()
        for s in (pub, sub):
            s.close(linger=0)
        ctx.term()


@SIGNALS
def test_forwarder_relays_an_ipc_publisher_to_loopback_and_stops_on_a_signal(tmp_path: Path, sig):
    source, bind = f"ipc://{tmp_path}/pub", f"tcp://127.0.0.1:{PortPool().take('fwd')}"
    ctx = zmq.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    pub.bind(source)
    fwd = subprocess.Popen([sys.executable, "-m", "kvalign.live.wire.kv_forwarder", source, bind])
    try:
        sub.connect(bind)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        assert _relayed(pub, sub, [b"", b"batch"]) == [b"", b"batch"]
        _stops(fwd, sig, pub, [b"", b"more"])
    finally:
        if fwd.poll() is None:
            fwd.kill()
        for s in (pub, sub):
            s.close(linger=0)
        ctx.term()
