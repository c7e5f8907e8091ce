"""Capture the workers' SGLang KV events live, and rebuild kvalign's own router prediction.

The prediction must come from the *same* events the router indexes, but through kvalign's code
only: this module subscribes to each worker's SGLang ZMQ PUB (beside Dynamo's relay, which is
another subscriber of the same socket), decodes frames with :func:`kvalign.model.events.decode_frames`,
converts them with :class:`kvalign.model.relay.Relay` and applies them to a
:class:`kvalign.model.index.PrefixIndex` keyed by the worker's Dynamo instance id. Malformed frames are
kept as errors (a finding, not a crash).

With ``capture_dir`` each worker's stream is also written as a standard kvalign capture
(:class:`kvalign.streams.capture.CaptureWriter`, ``<label>.capture.jsonl``), so ``kvalign diagnose`` and
``kvalign replay`` can be run on exactly what the live router saw.

ZMQ PUB/SUB drops what is published before a subscription arrives, so a capture must be started
before the first request (the harness starts it before the readiness probe).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import zmq

from kvalign.streams.capture import CaptureWriter
from kvalign.model.events import BlockStored, EventBatch, EventDecodeError, decode_frames
from kvalign.model.index import PrefixIndex
from kvalign.model.relay import Relay


@dataclass(frozen=True)
class Captured:
    """One decoded batch and the worker label it came from."""

    label: str
    batch: EventBatch
    received: float


class EventCapture:
    """Background SUB sockets on several workers' SGLang KV-event endpoints."""

    def __init__(self, endpoints: Mapping[str, str], *, topic: bytes = b"", capture_dir: str | Path | None = None):
        self.endpoints = dict(endpoints)
        self._writers: dict[str, CaptureWriter] = {}
        if capture_dir is not None:
            Path(capture_dir).mkdir(parents=True, exist_ok=True)
            for label, ep in self.endpoints.items():
                self._writers[label] = CaptureWriter(str(Path(capture_dir) / f"{label}.capture.jsonl"),
                                                     endpoint=ep, topic=topic.decode())
        self.topic = topic
        self.batches: list[Captured] = []
        self.errors: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._socks: dict[zmq.Socket, str] = {}
        for label, ep in self.endpoints.items():
            s = self._ctx.socket(zmq.SUB)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SUBSCRIBE, topic)
            s.connect(ep)
            self._socks[s] = label
        self._thread = threading.Thread(target=self._run, name="kvalign-capture", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for s in self._socks:
            poller.register(s, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                label = self._socks[sock]
                frames = sock.recv_multipart()
                writer = self._writers.get(label)
                try:
                    batch = decode_frames(frames)
                except EventDecodeError as exc:
                    with self._lock:
                        self.errors.append((label, str(exc)))
                    if writer is not None:
                        seq = int.from_bytes(frames[1], "big", signed=True) if len(frames) == 3 and len(frames[1]) == 8 else None
                        writer.write_bad(seq, str(exc), frames[-1])
                    continue
                if batch.seq is not None and batch.seq < 0:
                    continue  # SGLang's end-of-stream marker on shutdown
                if writer is not None:
                    writer.write_batch(batch)
                with self._lock:
                    self.batches.append(Captured(label, batch, time.monotonic()))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        for s in self._socks:
            s.close(linger=0)
        self._ctx.term()
        for w in self._writers.values():
            w.discard_if_empty()

    def capture_path(self, label: str) -> str | None:
        """The kvalign capture file of ``label`` (None without ``capture_dir``)."""
        w = self._writers.get(label)
        return None if w is None else w.path

    def __enter__(self) -> "EventCapture":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def snapshot(self) -> list[Captured]:
        with self._lock:
            return list(self.batches)

    def last_received(self) -> float | None:
        """``time.monotonic()`` when the latest batch arrived (None before any)."""
        with self._lock:
            return self.batches[-1].received if self.batches else None

    def count(self, label: str | None = None) -> int:
        with self._lock:
            return sum(1 for c in self.batches if label is None or c.label == label)

    def wait_for(self, predicate: Callable[[list[Captured]], bool], timeout_s: float) -> bool:
        """Poll until ``predicate(snapshot)`` holds; False at the deadline (never raises)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate(self.snapshot()):
                return True
            time.sleep(0.02)
        return predicate(self.snapshot())

    def stored_token_units(self, label: str) -> list[list]:
        """Token units (ints or bigram pairs) of every ``BlockStored``, per event, in order."""
        return [ev.token_ids for c in self.snapshot() if c.label == label
                for ev in c.batch.events if isinstance(ev, BlockStored)]

    def index(self, worker_ids: Mapping[str, int], block_size: int, hasher: Callable[..., list[int]] | None = None) -> PrefixIndex:
        """kvalign's router index rebuilt from everything captured so far."""
        idx = PrefixIndex()
        relays = {label: Relay(block_size, hasher) if hasher else Relay(block_size) for label in worker_ids}
        for c in self.snapshot():
            if c.label not in worker_ids:
                continue
            for ev in c.batch.events:
                out = relays[c.label].convert(ev)
                if out is not None:
                    idx.apply(worker_ids[c.label], out)
        return idx
