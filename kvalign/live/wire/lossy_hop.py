"""A loopback hop between each SGLang KV-event publisher and Dynamo's relay that can lose a batch.

Production event paths lose batches (a slow subscriber past its high-water mark, a restarted
relay, a network blip) and Dynamo does not resync a sequence gap, so a lost ``BlockStored``
batch makes the router blind to pages the engine holds. To hold that against the live router,
the fuzz cluster routes each worker's events through this hop::

    SGLang PUB (bind 127.0.0.1:P) -> hop SUB ... hop PUB (bind 127.0.0.1:H) -> Dynamo's relay SUB

Frames are forwarded byte for byte. The hop loses exactly the kind of batch it is armed for, and
a batch that mixes kinds always passes (a full pool makes store+remove batches common, and losing
one would lose both facts at once):

* :meth:`LossyHop.drop_next_store_batch`: the next batch (of any worker) whose events are all
  stores — the router misses pages the engine holds (a gap);
* :meth:`LossyHop.drop_next_removal_batch`: the next batch of ``label`` whose events are all
  removals or clears, none a store — the router keeps pages the engine evicted (stale credit).

Each dropped batch is recorded (:class:`Dropped`, with its kind) so the fuzz can name the request
it hit.

``hide_gaps`` is the negative control of gap detection: after a loss the hop renumbers the worker's
later batches to close the gap (as a forwarder that re-stamps sequence numbers would), so no
subscriber can see that anything was lost. :meth:`LossyHop.original_seq` maps a delivered number
back to the engine's, so kvalign's router view still knows which engine batch arrived.

``strip_salt`` is the tenant negative control: the hop re-encodes every batch whose stored blocks
carry a ``cache_salt`` without it (SGLang's tagged-map encoding, 0.5.21 and later), as a relay
that ignores the salt would, so the router indexes tenants' pages under one shared key space.
Every socket is on 127.0.0.1; the hop runs as a thread of the fuzz driver.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgpack
import zmq

from kvalign.model.events import AllBlocksCleared, BlockRemoved, BlockStored, EventDecodeError, decode_frames
from kvalign.live.wire import LOOPBACK


@dataclass(frozen=True)
class Dropped:
    """One batch the hop swallowed: which worker, its SGLang sequence number, when."""

    label: str
    seq: int | None
    blocks: int
    at: float
    kind: str = "store"  # "store" or "removal"
    unpublished: bool = False  # lost to every subscriber, kvalign's engine view included


def batch_kind(events: Sequence[object]) -> str | None:
    """``"store"`` when every event stores blocks, ``"removal"`` when every event removes blocks or
    clears the cache, None for an empty or mixed batch (which the hop never loses)."""
    if events and all(isinstance(e, BlockStored) for e in events):
        return "store"
    if events and all(isinstance(e, (BlockRemoved, AllBlocksCleared)) for e in events):
        return "removal"
    return None


class LossyHop:
    """Forwards ``upstream[label]`` (SGLang PUB endpoints) to PUB sockets bound at ``downstream[label]``."""

    def __init__(self, upstream: Mapping[str, str], downstream: Mapping[str, int], *, strip_salt: bool = False,
                 hide_gaps: bool = False, taps: Mapping[str, int] | None = None) -> None:
        """``taps``: per worker, a port where the hop republishes the engine's stream unaltered — what
        kvalign's engine view subscribes to, so a batch lost *unpublished* is lost to every subscriber."""
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
        self._taps: dict[str, zmq.Socket] = {}
        for label, port in (taps or {}).items():
            tap = self._ctx.socket(zmq.PUB)
            tap.setsockopt(zmq.LINGER, 0)
            tap.bind(f"tcp://{LOOPBACK}:{port}")
            self._taps[label] = tap
        self.taps = {label: f"tcp://{LOOPBACK}:{port}" for label, port in (taps or {}).items()}
        self.dropped: list[Dropped] = []
        self.lost_downstream: dict[str, int] = {}  # per worker, batches the taps saw and the router side never will
        self.forwarded = 0
        self.strip_salt, self.stripped = strip_salt, 0
        self.hide_gaps = hide_gaps
        self._shift: dict[str, int] = {}  # per worker: batches lost so far while hiding gaps
        self._originals: dict[tuple[str, int], int] = {}  # (worker, delivered seq) -> engine seq
        self._armed: tuple[str, str | None, bool] | None = None  # (kind, worker label or None, unpublished)
        #: labels whose every batch the hop swallows for every subscriber, the taps included: a source that
        #: publishes nothing (the fuzz's --only-rank0-publishes control); counted in :attr:`silenced_batches`
        self.silenced: set[str] = set()
        self.silenced_batches: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvalign-lossy-hop", daemon=True)
        self._thread.start()

    def drop_next_store_batch(self, *, unpublished: bool = False) -> None:
        """Swallow the next batch, from any worker, whose events are all ``BlockStored``; with
        ``unpublished`` the taps lose it too (a batch the engine's publisher never sent)."""
        with self._lock:
            self._armed = ("store", None, unpublished)

    def drop_next_removal_batch(self, label: str) -> None:
        """Swallow ``label``'s next batch whose events are all ``BlockRemoved``/``AllBlocksCleared``."""
        with self._lock:
            self._armed = ("removal", label, False)

    def disarm(self) -> bool:
        """Cancel a pending drop; True if one was still pending."""
        with self._lock:
            was, self._armed = self._armed is not None, None
        return was

    def _should_drop(self, label: str, frames: list[bytes]) -> Dropped | None:
        with self._lock:
            armed = self._armed
        if armed is None or armed[1] not in (None, label):
            return None
        try:
            batch = decode_frames(frames)
        except EventDecodeError:
            return None  # undecodable frames pass through: the relay's problem, and a capture finding
        if batch_kind(batch.events) != armed[0]:
            return None
        blocks = sum(len(getattr(e, "block_hashes", ())) for e in batch.events)
        with self._lock:
            if self._armed != armed:
                return None
            self._armed = None
            dropped = Dropped(label, batch.seq, blocks, time.monotonic(), armed[0], armed[2])
            self.dropped.append(dropped)
            if not dropped.unpublished:
                self.lost_downstream[label] = self.lost_downstream.get(label, 0) + 1
        return dropped

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
                if label in self.silenced:
                    self.silenced_batches[label] = self.silenced_batches.get(label, 0) + 1
                    continue
                dropped = self._should_drop(label, frames)
                if label in self._taps and not (dropped and dropped.unpublished):
                    self._taps[label].send_multipart(frames)
                if dropped:
                    if self.hide_gaps:
                        self._shift[label] = self._shift.get(label, 0) + 1
                    continue
                if self._shift.get(label) and len(frames) == 3 and len(frames[1]) == 8:
                    seq = int.from_bytes(frames[1], "big", signed=True)
                    new = seq - self._shift[label]
                    with self._lock:
                        self._originals[(label, new)] = seq
                    frames = [frames[0], new.to_bytes(8, "big", signed=True), frames[2]]
                if self.strip_salt:
                    frames = self._without_salt(frames)
                self._pubs[label].send_multipart(frames)
                self.forwarded += 1

    def original_seq(self, label: str, seq: int | None) -> int | None:
        """The engine's sequence number of a batch delivered as ``seq`` (itself unless renumbered)."""
        if seq is None:
            return None
        with self._lock:
            return self._originals.get((label, seq), seq)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        for s in [*self._pubs.values(), *self._taps.values(), *self._subs]:
            s.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> "LossyHop":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
