"""Live view of a worker's KV-event stream: what the router would index, batch by batch.

``capture`` + ``replay`` answer after the fact; an operator debugging a live deployment wants to
see, as requests arrive, whether blocks land in the router's index at all, whether batches are
being lost (gaps), and whether the engine restarted (sequence reset). The watcher keeps its own
router index (same fused relay+index as replay) and says, per batch, how many blocks the router
could match under the router's EAGLE setting — bigram events against a router with eagle off are
stored but can never be matched, which is the silent cache-blind failure.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvalign.capture import Cleared, Removed, Stored, compact_event, n_blocks
from kvalign.events import EventBatch, EventDecodeError, decode_frames
from kvalign.replay_index import BatchRejected, ReplayIndex
from kvalign.sequence import SequenceTracker

WORKER = 1


@dataclass
class WatchTotals:
    batches: int = 0
    stored: int = 0
    removed: int = 0
    invisible: int = 0  # stored blocks whose framing the router's eagle setting cannot match
    malformed: Counter[str] = field(default_factory=Counter)
    seq: SequenceTracker = field(default_factory=SequenceTracker)


class Watcher:
    """Turns received frames into display lines while maintaining the router's index."""

    def __init__(self, *, block_size: int | None = None, router_eagle: str = "auto"):
        self.block_size = block_size
        self.router_eagle = router_eagle
        self.index: ReplayIndex | None = ReplayIndex(block_size) if block_size else None
        self.totals = WatchTotals()

    def on_frames(self, frames: list[bytes]) -> list[str]:
        """Lines to show for one received ZMQ message."""
        try:
            batch = decode_frames(frames)
        except EventDecodeError as exc:
            seq = int.from_bytes(frames[1], "big", signed=True) if len(frames) == 3 and len(frames[1]) == 8 else None
            return self._sequence(seq) + [self._malformed(seq, str(exc))]
        if batch.seq is not None and batch.seq < 0:
            return []
        return self._sequence(batch.seq) + [self._batch(batch)]

    def _sequence(self, seq: int | None) -> list[str]:
        t = self.totals
        t.batches += 1
        prev = t.seq.last
        kind = t.seq.observe(seq)
        if kind == "gap":
            return [f"seq {seq}: GAP: {seq - prev - 1} batches missing (seq {prev + 1}..{seq - 1}); "
                    "the router never indexed them"]
        if kind == "restart":
            return [f"seq {seq}: RESTART: the publisher's sequence went back from {prev} (a new engine process; "
                    "its cache starts empty)"]
        return []

    def _malformed(self, seq: int | None, reason: str) -> str:
        self.totals.malformed[reason.split(" (")[0].split(": ")[0]] += 1
        return f"seq {seq}: malformed batch skipped (Dynamo drops it too): {reason}"

    def _batch(self, batch: EventBatch) -> str:
        events = [compact_event(e) for e in batch.events]
        stored_events = [e for e in events if type(e) is Stored]
        if self.index is None and stored_events:
            self.block_size = stored_events[0].bs
            self.index = ReplayIndex(self.block_size)
        stored = sum(n_blocks(e) for e in stored_events)
        removed = sum(n_blocks(e) for e in events if type(e) is Removed)
        framed = [(e, e.pairs or bool(e.tok and isinstance(e.tok[0], list))) for e in stored_events if e.h]
        bigram = [b for _, b in framed]
        t = self.totals
        parts = [f"seq {batch.seq}:"]
        if self.index is not None:
            try:
                self.index.apply_batch(WORKER, events)
            except BatchRejected as exc:
                return self._malformed(batch.seq, str(exc))
        t.stored += stored
        t.removed += removed
        cleared = any(type(e) is Cleared for e in events)
        parts.append(f"+{stored} stored -{removed} removed" + (" (all cleared)" if cleared else ""))
        if bigram:
            parts.append("bigram pages" if all(bigram) else "plain pages" if not any(bigram) else "mixed pages")
            if self.router_eagle != "auto":
                want = self.router_eagle == "on"
                blind = sum(n_blocks(e) for e, b in framed if b != want)
                if blind:
                    t.invisible += blind
                    parts.append(f"[router eagle {self.router_eagle}: {blind} blocks can never match]")
        if self.index is not None:
            parts.append(f"| router index: {self.index.blocks(WORKER)} blocks held")
            dropped = self.index.stats(WORKER).dropped_block_size
            if dropped:
                parts.append(f"({dropped} dropped for block size != {self.block_size})")
        return " ".join(parts)

    def summary(self) -> str:
        t, seq = self.totals, self.totals.seq
        held = self.index.blocks(WORKER) if self.index is not None else 0
        span = f"seq {seq.first}..{seq.last}" if seq.first is not None else "no batches"
        line = (f"watch summary: {t.batches} batches ({span}), {len(seq.gaps)} gaps ({seq.missing_batches} batches "
                f"missing), {len(seq.restarts)} restarts, {sum(t.malformed.values())} malformed; blocks: "
                f"{t.stored} stored, {t.removed} removed, {held} held in the router index")
        if t.invisible:
            line += f"; {t.invisible} stored blocks invisible to a router with eagle {self.router_eagle}"
        return line
