"""Real event sources for capture tests: SGLang's ZmqEventPublisher fed by its real radix cache.

Nothing is mocked: batches come from ``SglangRadixCache(...).take_raw_events()`` (SGLang's own
event objects), go through ``EventPublisherFactory.create`` (SGLang's real PUB thread, encoder and
sequence numbers) over loopback TCP, and are recorded by kvalign's real capture loop. A lossy hop
for gap tests is a real ZMQ XSUB/XPUB forwarder that drops chosen sequence numbers, like a
network or HWM loss would.

ZMQ PUB/SUB drops what is published before the subscription lands (slow joiner), so every session
first publishes SGLang's ``AllBlocksCleared`` until the capture has recorded one (bounded), then
the scenario.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import zmq

from kvalign.streams.capture import CaptureWriter
from kvalign.commands.capture import record
from kvalign.oracles.base import OracleUnavailable
from kvalign.oracles.sglang import shutdown_publisher
from kvalign.streams.subscribe import Subscription

TOPIC = "kv-events"

# Byte-exact batch payloads recorded from the real sglang 0.5.19 (positional events) and 0.5.23
# (tagged maps) publishers: P=4, insert tokens 1..10, evict(4), ts=1700000000.0 (shared reference
# sglang-radix-keys.md §5). A 0.5.19 publisher cannot run beside 0.5.23, so its wire form is
# replayed from these recordings.
RECORDED = {
    ("0.5.19", False): "93cb41d954fc400000009391b0416c6c426c6f636b73436c656172656497ab426c6f636b53746f72656492d3cf97adeedb59e05bcf4ebfa8a1f3c34151c098010203040506070804c0a347505593ac426c6f636b52656d6f76656492d3cf97adeedb59e05bcf4ebfa8a1f3c34151a347505500",
    ("0.5.19", True): "93cb41d954fc400000009391b0416c6c426c6f636b73436c656172656497ab426c6f636b53746f72656492d3f721fe42aac11dcbd3c35ad698917936a4c09892010292020392030492040592050692060792070892080904c0a347505593ac426c6f636b52656d6f76656492d3f721fe42aac11dcbd3c35ad698917936a4a347505500",
    ("0.5.23", False): "93cb41d954fc400000009381a474797065b0416c6c426c6f636b73436c656172656487a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392d3cf97adeedb59e05bcf4ebfa8a1f3c34151b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da347505583a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657392d3cf97adeedb59e05bcf4ebfa8a1f3c34151a66d656469756da347505500",
    ("0.5.23", True): "93cb41d954fc400000009381a474797065b0416c6c426c6f636b73436c656172656487a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392d3f721fe42aac11dcbd3c35ad698917936a4b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647398920102920203920304920405920506920607920708920809aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da347505583a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657392d3f721fe42aac11dcbd3c35ad698917936a4a66d656469756da347505500",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sglang_events_module() -> Any:
    """``sglang.srt.disaggregation.kv_events``, or a skip saying why it is missing."""
    from kvalign.oracles.sglang import _modules

    try:
        _modules()
        import sglang.srt.disaggregation.kv_events as kv_events
    except (OracleUnavailable, ImportError) as exc:
        pytest.skip(f"real SGLang KV-event publisher unavailable: {exc}")
    return kv_events


class RealPublisher:
    """SGLang's ZmqEventPublisher bound on 127.0.0.1, publishing real cache events."""

    def __init__(self, topic: str = TOPIC, port: int | None = None):
        self.kv = sglang_events_module()
        self.port = port or free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        config = {"publisher": "zmq", "topic": topic, "endpoint": self.endpoint, "bind": True}
        self.pub = self.kv.EventPublisherFactory.create(json.dumps(config), attn_dp_rank=0)
        self.sent = 0

    def publish(self, events: list[Any]) -> int:
        """Publish one batch; returns its sequence number (SGLang counts from 0)."""
        self.pub.publish(self.kv.KVEventBatch(ts=time.time(), events=list(events)))
        self.sent += 1
        return self.sent - 1

    def warm_up_event(self) -> Any:
        return self.kv.AllBlocksCleared()

    def close(self) -> None:
        shutdown_publisher(self.pub)


class RawPublisher:
    """A plain ZMQ PUB for frames SGLang cannot produce here (0.5.19 recordings, broken payloads)."""

    def __init__(self, topic: str = TOPIC):
        self.topic = topic.encode()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.sent = 0

    def publish_payload(self, payload: bytes) -> int:
        """Send ``[topic, seq, payload]`` with the next sequence number; returns it."""
        self._sock.send_multipart([self.topic, self.sent.to_bytes(8, "big"), payload])
        self.sent += 1
        return self.sent - 1

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


def raw_capture(tmp_path: Any, payloads: list[bytes], *, name: str = "raw.jsonl") -> str:
    """Capture of ``payloads`` sent over real ZMQ (first one repeated until subscribed)."""
    pub = RawPublisher()
    path = os.path.join(str(tmp_path), name)
    session = CaptureSession(pub.endpoint, path)
    try:
        deadline = time.monotonic() + 10
        while session.writer.stats.batches == 0:
            assert time.monotonic() < deadline, "capture never subscribed"
            pub.publish_payload(payloads[0])
            time.sleep(0.05)
        for payload in payloads[1:]:
            pub.publish_payload(payload)
        session.wait_seq(pub.sent - 1)
    finally:
        session.close()
        pub.close()
    return path


class LossyForwarder:
    """A real ZMQ XSUB->XPUB hop that drops the batches whose sequence numbers are in ``drop``."""

    def __init__(self, upstream: str, drop: set[int]):
        self.drop = drop
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self._ctx = zmq.Context()
        self._xsub = self._ctx.socket(zmq.XSUB)
        self._xpub = self._ctx.socket(zmq.XPUB)
        for s in (self._xsub, self._xpub):
            s.setsockopt(zmq.LINGER, 0)
        self._xsub.connect(upstream)
        self._xpub.bind(self.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="lossy-forwarder")
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._xsub, zmq.POLLIN)
        poller.register(self._xpub, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                if sock is self._xpub:
                    self._xsub.send_multipart(self._xpub.recv_multipart())  # subscriptions upstream
                else:
                    frames = self._xsub.recv_multipart()
                    if len(frames) == 3 and int.from_bytes(frames[1], "big") in self.drop:
                        continue
                    self._xpub.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._xsub.close(linger=0)
        self._xpub.close(linger=0)
        self._ctx.term()


class CaptureSession:
    """kvalign's capture loop (the one ``kvalign capture`` runs) in a thread, until stopped."""

    def __init__(self, endpoint: str, path: str, topic: str | None = TOPIC):
        self.path = path
        self.subscription = Subscription(endpoint, topic=topic)
        self.writer = CaptureWriter(path, endpoint=endpoint, topic=topic)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvalign-capture")
        self._thread.start()

    def _run(self) -> None:
        try:
            record(self.subscription, self.writer, timeout=30.0, stop=self.stop)
        except BaseException as exc:  # surfaced by close()
            self.error = exc

    def wait_seq(self, seq: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            last = self.writer.stats.seq.last
            if last is not None and last >= seq:
                return
            time.sleep(0.01)
        raise AssertionError(f"capture did not reach seq {seq} within {timeout_s}s (last {self.writer.stats.seq.last})")

    def close(self) -> None:
        self.stop.set()
        self._thread.join(timeout=5)
        self.writer.close()
        self.subscription.close()
        if self.error is not None:
            raise self.error


def warm_up(publisher: RealPublisher, batches_seen: Callable[[], int], timeout_s: float = 10.0) -> None:
    """Publish SGLang's AllBlocksCleared until the subscriber has one (the slow-joiner wait)."""
    deadline = time.monotonic() + timeout_s
    while batches_seen() == 0:
        if time.monotonic() > deadline:
            raise AssertionError(f"no subscription reached the publisher within {timeout_s}s")
        publisher.publish([publisher.warm_up_event()])
        time.sleep(0.05)


class Stream:
    """What a test drives: ``publish(events, drop=False)`` and, afterwards, the capture ``path``."""

    def __init__(self, publisher: RealPublisher, forwarder: LossyForwarder | None, path: str):
        self.publisher, self.forwarder, self.path = publisher, forwarder, path
        self.dropped: set[int] = set()

    def publish(self, events: list[Any], *, drop: bool = False) -> int:
        """Publish one batch of SGLang events (``drop``: lose it on the way); returns its seq."""
        if drop:
            if self.forwarder is None:
                raise ValueError("open the stream with lossy=True to drop batches")
            self.forwarder.drop.add(self.publisher.sent)
            self.dropped.add(self.publisher.sent)
        return self.publisher.publish(events)


@pytest.fixture(scope="module")
def sglang_publisher() -> Iterator[RealPublisher]:
    """One real publisher per test module (each one starts SGLang's publisher thread and sockets)."""
    publisher = RealPublisher()
    yield publisher
    publisher.close()


@contextmanager
def captured(tmp_path: Any, publisher: RealPublisher | None = None, *, name: str = "worker.jsonl",
             lossy: bool = False) -> Iterator[Stream]:
    """A real SGLang publisher (``publisher``, or a fresh one) and a running kvalign capture of it.

    On exit the capture is waited for up to the last batch that was not dropped, then closed, so
    ``stream.path`` is complete when the ``with`` block ends.
    """
    owned = publisher is None
    publisher = publisher or RealPublisher()
    topic = TOPIC
    forwarder = LossyForwarder(publisher.endpoint, set()) if lossy else None
    path = os.path.join(str(tmp_path), name)
    session = CaptureSession(forwarder.endpoint if forwarder else publisher.endpoint, path, topic)
    stream = Stream(publisher, forwarder, path)
    try:
        warm_up(publisher, lambda: session.writer.stats.batches)
        yield stream
        last = publisher.sent - 1
        while last in stream.dropped:
            last -= 1
        session.wait_seq(last)
    finally:
        session.close()
        if forwarder:
            forwarder.close()
        if owned:
            publisher.close()
