"""A test control, not part of the stand-in's normal path: faults injected into SGLang's own KV-event
publisher inside a real worker process, as an SGLang regression would look.

kvalign's live fuzz must name the engine's events as the cause when the engine reuses pages its
own stream never stored in the prompt's chain, and must not raise a false alarm when the stream
is only reshaped. To hold that against the real engine, this module wraps
``sglang.srt.disaggregation.kv_events.ZmqEventPublisher.publish`` (0.5.19, 0.5.21, 0.5.23: the
scheduler hands each batch of radix-cache events to it) and, when armed, changes the next batch
before SGLang's publisher thread numbers and sends it:

harmful (the router and kvalign's engine view lose pages the engine holds):

* ``drop_store`` — the batch's ``BlockStored`` events are not published (a store SGLang forgot);
* ``wrong_parent`` — its first ``BlockStored`` hangs under a parent no page has;
* ``wrong_hash`` — its first ``BlockStored`` publishes its last page under a wrong block hash, so
  the next store under that page names a parent the stream never stored;

harmful (the router and kvalign's engine view keep pages the engine freed):

* ``drop_removal`` — the next batch holding a ``BlockRemoved`` goes out without it (an eviction
  SGLang forgot to publish); SGLang publishes evictions in the batch of the stores that caused
  them, so the stores still go out;

benign (the same pages in the same chain, reshaped):

* ``split`` — every stored page goes out as a ``BlockStored`` of its own in a batch of its own;
* ``merge`` — the next ``batches`` batches (default 2) go out as one, or what arrived within
  ``window_s`` (default 5 s) when fewer came.

It is loaded only when the harness sets :data:`FAULTS_ENV` (the fuzz's ``publisher_faults`` option,
which only tests and negative-control scripts set), and then does nothing until armed. The harness
arms it by writing ``{"id": N, "fault": NAME, ...}`` to the file that variable names (atomically, by
rename) and disarms it with ``"fault": null``; the worker applies an armed fault once, to the first
batch it fits, and reports what it did in ``<file>.done`` (``id``, ``fault``, ``batches_in``,
``batches_out``, ``blocks``), so a test can tell a fault that fired from one that never did.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from kvalign.standins.sglang_cpu import PUBLISHER_FAULTS_ENV as FAULTS_ENV

HARMFUL = ("drop_store", "wrong_parent", "wrong_hash", "drop_removal")
BENIGN = ("split", "merge")
FAULTS = HARMFUL + BENIGN
#: XORed into a hash to make a wrong one (never 0: a wrong hash must differ from the true one).
_WRONG = 0x5BD1E9955BD1E995


def _is_store(ev: Any) -> bool:
    return type(ev).__name__ == "BlockStored"


def _is_removal(ev: Any) -> bool:
    return type(ev).__name__ == "BlockRemoved"


def _replace(ev: Any, **changes: Any) -> Any:
    """A copy of one event (SGLang's msgspec structs, or kvalign's model dataclasses in tests)."""
    if isinstance(ev, msgspec.Struct):
        return msgspec.structs.replace(ev, **changes)
    return dataclasses.replace(ev, **changes)


def _wrong(h: int | None) -> int:
    """A signed int64 that is not ``h`` (SGLang's hashes are signed int64)."""
    v = ((h or 0) & (2**64 - 1)) ^ _WRONG
    return v - (1 << 64) if v >= 1 << 63 else v


def _split_store(ev: Any) -> list[Any]:
    """One ``BlockStored`` per page, each under the page before it: the same chain."""
    n = len(ev.block_hashes)
    if n <= 1:
        return [ev]
    per = len(ev.token_ids) // n
    out, parent = [], ev.parent_block_hash
    for i, h in enumerate(ev.block_hashes):
        out.append(_replace(ev, block_hashes=[h], parent_block_hash=parent, token_ids=list(ev.token_ids[i * per:(i + 1) * per])))
        parent = h
    return out


def reshape(fault: str, events: Sequence[Any]) -> list[list[Any]] | None:
    """The batches (event lists) to publish instead of one batch of ``events`` under ``fault``, or
    None when the fault does not fit this batch (it has no store) and it stays armed. ``merge`` is
    not a one-batch fault (see :class:`PublisherFaults`); ``drop_removal`` fits a batch with a removal."""
    if fault == "drop_removal":
        if not any(_is_removal(ev) for ev in events):
            return None
        kept = [ev for ev in events if not _is_removal(ev)]
        return [kept] if kept else []
    first = next((i for i, ev in enumerate(events) if _is_store(ev)), None)
    if first is None:
        return None
    events = list(events)
    if fault == "drop_store":
        kept = [ev for ev in events if not _is_store(ev)]
        return [kept] if kept else []
    if fault == "wrong_parent":
        ev = events[first]
        events[first] = _replace(ev, parent_block_hash=_wrong(ev.parent_block_hash))
        return [events]
    if fault == "wrong_hash":
        ev = events[first]
        events[first] = _replace(ev, block_hashes=[*ev.block_hashes[:-1], _wrong(ev.block_hashes[-1])])
        return [events]
    if fault == "split":
        return [[page] for ev in events for page in (_split_store(ev) if _is_store(ev) else [ev])]
    raise ValueError(f"unknown publisher fault {fault!r} (one of {', '.join(FAULTS)})")


def _blocks(events: Sequence[Any]) -> int:
    return sum(len(ev.block_hashes) for ev in events if _is_store(ev))


class PublisherFaults:
    """The armed fault of one worker, read from its control file; ``publish`` stands where
    SGLang's ``publish`` was called, and ``send(events)`` publishes one batch the original way."""

    def __init__(self, path: str) -> None:
        self.path, self.done = path, f"{path}.done"
        self._stamp: tuple[int, int, int] | None = None
        self._spec: dict[str, Any] | None = None
        self._consumed = 0
        self._lock = threading.RLock()
        self._held: list[list[Any]] = []
        self._held_ts: float | None = None
        self._timer: threading.Timer | None = None

    def armed(self) -> dict[str, Any] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        stamp = (st.st_mtime_ns, st.st_ino, st.st_size)
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                with open(self.path) as f:
                    spec = json.load(f)
            except (OSError, ValueError):
                spec = {}
            ok = isinstance(spec, dict) and spec.get("fault") in FAULTS and int(spec.get("id", 0)) > self._consumed
            self._spec = spec if ok else None
        return self._spec

    def _ack(self, spec: dict[str, Any], batches_in: int, batches_out: int, blocks: int) -> None:
        self._consumed, self._spec = int(spec["id"]), None
        tmp = f"{self.done}.tmp"
        with open(tmp, "w") as f:
            json.dump({"id": spec["id"], "fault": spec["fault"], "batches_in": batches_in, "batches_out": batches_out,
                       "blocks": blocks}, f)
        os.replace(tmp, self.done)

    def publish(self, ts: float, events: list[Any], send: Callable[[float, list[Any]], None]) -> None:
        with self._lock:
            spec = self.armed() if not self._held else self._spec
            if spec is None:
                send(ts, events)
                return
            if spec["fault"] == "merge":
                self._hold(spec, ts, events, send)
                return
            out = reshape(spec["fault"], events)
            if out is None:
                send(ts, events)
                return
            for batch in out:
                send(ts, batch)
            self._ack(spec, 1, len(out), _blocks(events))

    def _hold(self, spec: dict[str, Any], ts: float, events: list[Any], send: Callable[[float, list[Any]], None]) -> None:
        if not self._held:
            self._held_ts = ts
            self._timer = threading.Timer(float(spec.get("window_s", 5.0)), self._flush, (spec, send))
            self._timer.daemon = True
            self._timer.start()
        self._held.append(events)
        if len(self._held) >= int(spec.get("batches", 2)):
            self._timer.cancel()
            self._flush(spec, send)

    def _flush(self, spec: dict[str, Any], send: Callable[[float, list[Any]], None]) -> None:
        with self._lock:
            if not self._held:
                return
            held, self._held = self._held, []
            send(self._held_ts, [ev for batch in held for ev in batch])
            self._ack(spec, len(held), 1, sum(_blocks(b) for b in held))


def install() -> None:
    """Wrap SGLang's ``ZmqEventPublisher.publish`` with the worker's :class:`PublisherFaults`
    (run right after ``sglang.srt.disaggregation.kv_events`` executes; nothing without :data:`FAULTS_ENV`)."""
    import functools
    import inspect

    from sglang.srt.disaggregation import kv_events

    from kvalign.standins.sglang_cpu.patches import _require

    path = os.environ.get(FAULTS_ENV)
    if not path:
        return
    publisher = kv_events.ZmqEventPublisher
    original = publisher.publish
    _require(list(inspect.signature(original).parameters) == ["self", "events"],
             "ZmqEventPublisher.publish(self, events) changed its signature")
    _require(hasattr(kv_events, "KVEventBatch"), "kv_events has no KVEventBatch")
    faults = PublisherFaults(path)

    @functools.wraps(original)
    def publish(self: Any, events: Any) -> None:
        def send(ts: float, evs: list[Any]) -> None:
            if evs:  # SGLang never publishes an empty batch
                original(self, kv_events.KVEventBatch(ts=ts, events=evs, attn_dp_rank=events.attn_dp_rank))

        faults.publish(events.ts, list(events.events), send)

    publisher.publish = publish
