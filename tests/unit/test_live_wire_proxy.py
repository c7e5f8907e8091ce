"""The XSUB -> XPUB proxy of the broker and the KV forwarder: relays, and stops at once on a signal."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import zmq

from kvalign.live.cluster.ports import PortPool


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_forwarder_relays_an_ipc_publisher_to_loopback_and_stops_on_a_signal(tmp_path, sig):
    source, bind = f"ipc://{tmp_path}/pub", f"tcp://127.0.0.1:{PortPool().take('fwd')}"
    ctx = zmq.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    pub.bind(source)
    fwd = subprocess.Popen([sys.executable, "-m", "kvalign.live.wire.kv_forwarder", source, bind])
    try:
        sub.connect(bind)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 200)
        got, deadline = None, time.monotonic() + 20
        while got is None and time.monotonic() < deadline:  # slow joiner: until the subscription is through
            pub.send_multipart([b"", b"batch"])
            try:
                got = sub.recv_multipart()
            except zmq.Again:
                pass
        assert got == [b"", b"batch"]
        pub.send_multipart([b"", b"more"])  # traffic in flight does not hold the stop up
        started = time.monotonic()
        fwd.send_signal(sig)
        assert fwd.wait(timeout=10) == 0
        assert time.monotonic() - started < 10
    finally:
        if fwd.poll() is None:
            fwd.kill()
        for s in (pub, sub):
            s.close(linger=0)
        ctx.term()
