"""A loopback hop between each SGLang KV-event publisher and Dynamo's relay that can lose a batch.

Production event paths lose batches (a slow subscriber past its high-water mark, a restarted
relay, a network blip) and Dynamo does not resync a sequence gap, so a lost ``BlockStored``
batch makes the router blind to pages the engine holds. To hold that against the live router,
the fuzz cluster routes each worker's events through this hop::

    SGLang PUB (bind 127.0.0.1:P) -> hop SUB ... hop PUB (bind 127.0.0.1:H) -> Dynamo's relay SUB

Frames are forwarded byte for byte. :meth:`LossyHop.drop_next_store_batch` arms it to swallow the
next batch (of any worker) that stores blocks — only stores, so the router can miss pages but
never keep pages the engine removed (a lost removal would make every later credit unprovable).
Each dropped batch is recorded (:class:`Dropped`) so the fuzz can name the request it hit.

``strip_salt`` is the tenant negative control: the hop re-encodes every batch whose stored blocks
carry a ``cache_salt`` without it (SGLang's tagged-map encoding, 0.5.21 and later), as a relay
that ignores the salt would, so the router indexes tenants' pages under one shared key space.
Every socket is on 127.0.0.1; the hop runs as a thread of the fuzz driver.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import msgpack
import zmq

from kvalign.events import BlockStored, EventDecodeError, decode_frames
from kvalign.live.cluster.ports import LOOPBACK


@dataclass(frozen=True)
class Dropped:
    """One batch the hop swallowed: which worker, its SGLang sequence number, when."""

    label: str
    seq: int | None
    blocks: int
    at: float


class LossyHop:
    """Forwards ``upstream[label]`` (SGLang PUB endpoints) to PUB sockets bound at ``downstream[label]``."""

    def __init__(self, upstream: Mapping[str, str], downstream: Mapping[str, int], *, strip_salt: bool = False) -> None:
        if set(upstream) != set(downstream):
            raise ValueError(f"hop labels differ: {sorted(upstream)} vs {sorted(downstream)}")
        self._ctx = zmq.Context()
        self._pubs: dict[str, zmq.Socket] = {}
        self._subs: dict[zmq.Socket, str] = {}
        for label, port in downstream.items():
            pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.bind(f"tcp://{LOOPBACK}:{port}")
            self._pubs[label] = pub
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(upstream[label])
            self._subs[sub] = label
        self.downstream = {label: f"tcp://{LOOPBACK}:{port}" for label, port in downstream.items()}
        self.dropped: list[Dropped] = []
        self.forwarded = 0
        self.strip_salt, self.stripped = strip_salt, 0
        self._armed = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvalign-lossy-hop", daemon=True)
        self._thread.start()

    def drop_next_store_batch(self) -> None:
        """Swallow the next batch, from any worker, that carries a ``BlockStored`` event."""
        with self._lock:
            self._armed = True

    def disarm(self) -> bool:
        """Cancel a pending drop; True if one was still pending."""
        with self._lock:
            was, self._armed = self._armed, False
        return was

    def _should_drop(self, label: str, frames: list[bytes]) -> bool:
        with self._lock:
            if not self._armed:
                return False
        try:
            batch = decode_frames(frames)
        except EventDecodeError:
            return False  # undecodable frames pass through: the relay's problem, and a capture finding
        stored = sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockStored))
        if not stored:
            return False
        with self._lock:
            if not self._armed:
                return False
            self._armed = False
            self.dropped.append(Dropped(label, batch.seq, stored, time.monotonic()))
        return True

    def _without_salt(self, frames: list[bytes]) -> list[bytes]:
        """The batch with ``cache_salt`` removed from every stored block (other frames unchanged)."""
        if len(frames) != 3:
            return frames
        try:
            batch = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
        except (ValueError, msgpack.UnpackException):
            return frames
        events = batch[1] if isinstance(batch, list) and len(batch) >= 2 and isinstance(batch[1], list) else []
        salted = [e for e in events if isinstance(e, dict) and e.get("type") == "BlockStored" and e.get("cache_salt")]
        if not salted:
            return frames
        for e in salted:
            del e["cache_salt"]
        self.stripped += len(salted)
        return [frames[0], frames[1], msgpack.packb(batch, use_bin_type=True)]

    def _run(self) -> None:
        poller = zmq.Poller()
        for s in self._subs:
            poller.register(s, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                label = self._subs[sock]
                frames = sock.recv_multipart()
                if self._should_drop(label, frames):
                    continue
                if self.strip_salt:
                    frames = self._without_salt(frames)
                self._pubs[label].send_multipart(frames)
                self.forwarded += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        for s in [*self._pubs.values(), *self._subs]:
            s.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> "LossyHop":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
