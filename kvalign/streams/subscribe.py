"""A ZMQ SUB on one SGLang KV-event endpoint that can say *why* nothing is arriving.

ZMQ hides connection state: connecting to a dead port, to a live publisher on another topic, or to
a live publisher that simply has no traffic all look like silence. A debugging tool has to tell
them apart, so this subscription watches the socket monitor (did a publisher ever accept us?) and
subscribes to every topic, counting traffic on topics other than the one asked for.

SGLang's PUB binds for wildcard/ipc endpoints (``tcp://*:5557``) and *connects* for a concrete
host unless ``bind`` is set, so the subscriber can do either (``bind=True`` for the latter).
"""

from __future__ import annotations

import time
from collections import Counter

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvalign.errors import UsageError

_SCHEMES = ("tcp://", "ipc://", "inproc://")
_UP = {zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED, zmq.EVENT_HANDSHAKE_SUCCEEDED}


class Subscription:
    """SUB socket + monitor; :meth:`recv` returns frames on the wanted topic only."""

    def __init__(self, endpoint: str, *, topic: str | None = None, bind: bool = False):
        if not endpoint.startswith(_SCHEMES):
            raise UsageError(f"endpoint must look like tcp://HOST:PORT (or ipc://PATH), got {endpoint!r}")
        self.endpoint = endpoint
        self.topic = None if topic is None else topic.encode("utf-8")
        self.other_topics: Counter[bytes] = Counter()
        self.ever_connected = False
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)  # never drop on our side: a capture must see everything
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._monitor = self._sock.get_monitor_socket()
        try:
            if bind:
                self._sock.bind(endpoint)
                self.ever_connected = True  # nothing to wait for: publishers come to us
            else:
                self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise UsageError(f"cannot {'bind' if bind else 'connect to'} {endpoint}: {exc}") from None
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def _drain_monitor(self) -> None:
        while self._monitor.poll(0):
            if recv_monitor_message(self._monitor)["event"] in _UP:
                self.ever_connected = True

    def recv(self, timeout_s: float) -> list[bytes] | None:
        """The next message on the wanted topic, or None after ``timeout_s`` of nothing."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while True:
            left_ms = max(int((deadline - time.monotonic()) * 1000), 0)
            ready = dict(self._poller.poll(left_ms))
            if self._monitor in ready:
                self._drain_monitor()
            if self._sock in ready:
                frames = self._sock.recv_multipart()
                if self.topic is None or (frames and frames[0] == self.topic):
                    return frames
                self.other_topics[frames[0] if frames else b""] += 1
            if time.monotonic() >= deadline:
                return None

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until a publisher accepted the connection (True) or the timeout (False)."""
        deadline = time.monotonic() + timeout_s
        while not self.ever_connected and time.monotonic() < deadline:
            if self._monitor.poll(max(int((deadline - time.monotonic()) * 1000), 1)):
                self._drain_monitor()
        return self.ever_connected

    def silence_reason(self, waited_s: float) -> str:
        """One line saying why no wanted batch arrived in ``waited_s`` seconds."""
        self._drain_monitor()
        if not self.ever_connected:
            return (f"cannot reach {self.endpoint}: no publisher accepted the connection within {waited_s:g}s "
                    "(is the worker running with --kv-events-config, and is this its endpoint?)")
        wanted = "any topic" if self.topic is None else f"topic {self.topic.decode('utf-8', 'replace')!r}"
        if self.other_topics:
            seen = ", ".join(f"{n} on {t.decode('utf-8', 'replace')!r}" for t, n in self.other_topics.most_common(3))
            return f"connected to {self.endpoint} but no batch on {wanted} within {waited_s:g}s (saw {seen}; check --topic)"
        return f"connected to {self.endpoint} but no batch on {wanted} within {waited_s:g}s (is the worker serving requests?)"

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
