"""Live view of a worker's KV-event stream: what the router would index, batch by batch.

``capture`` + ``replay`` answer after the fact; an operator debugging a live deployment wants to
see, as requests arrive, whether blocks land in the router's index at all, whether batches are
being lost (gaps), and whether the engine restarted (sequence reset). The watcher keeps its own
router index (same fused relay+index as replay) and says, per batch, how many blocks the router
could match under the router's EAGLE setting — bigram events against a router with eagle off are
stored but can never be matched, which is the silent cache-blind failure.

Besides eagle framing, three more kinds of stored block are held by the engine yet unmatchable by
the router ("router-blind", counted per reason in :attr:`WatchTotals.blind`): blocks of a block
size other than the router's (the relay drops them), LoRA blocks whose event carries only a
``lora_id`` (SGLang 0.5.19: the router keys them as base-model pages), and salted blocks when the
router hashes queries without ``cache_salt`` (``--router-salt off``: Dynamo before 1.5). The same
counts back ``kvalign watch --metrics-port`` (:mod:`kvalign.streams.watch_metrics`).

With SGLang's host tier (HiCache) on, the same page is stored once per medium (``GPU``, then
``CPU_PINNED`` when it is backed up) and removed per medium, and Dynamo's relay files each in its own
tier. The watcher keeps the engine hashes per tier as the relay maps the medium
(:data:`kvalign.model.relay.RELAY_TIERS`), so an operator sees how much of the router's credit is host
credit, and counts the blocks stored with a medium the relay maps to no tier: Dynamo 1.6.1 indexes
those nowhere and logs nothing (``MEDIUM_NOT_INDEXED``).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from kvalign.streams.capture import Cleared, CompactEvent, Removed, Stored, compact_event, n_blocks, u64_list
from kvalign.model.causes import Cause
from kvalign.model.events import EventBatch, EventDecodeError, decode_frames
from kvalign.model.relay import RELAY_TIERS
from kvalign.streams.replay_index import BatchRejected, ReplayIndex
from kvalign.streams.sequence import SequenceTracker

WORKER = 1

#: Why a stored block can be router-blind: metric label -> the cause it is an instance of.
BLIND_REASONS = {
    "eagle_mismatch": None,  # ROUTER_EAGLE_OFF or ROUTER_EAGLE_ON, by the router's setting
    "block_size": Cause.BLOCK_SIZE,
    "lora_without_name": Cause.LORA_NOT_IN_EVENTS,
    "salt_stripped": Cause.NAMESPACE_DROPPED,
}


@dataclass
class WatchTotals:
    batches: int = 0
    events: int = 0
    stored: int = 0
    removed: int = 0
    #: router-blind stored blocks per reason (keys of :data:`BLIND_REASONS`)
    blind: Counter[str] = field(default_factory=Counter)
    malformed: Counter[str] = field(default_factory=Counter)
    #: stored blocks per ``medium`` string the relay maps to no tier (indexed nowhere)
    unmapped_media: Counter[str] = field(default_factory=Counter)
    seq: SequenceTracker = field(default_factory=SequenceTracker)
    #: the last cause seen, with the sequence number of the batch that showed it
    last_cause: tuple[Cause, int | None] | None = None
    last_batch_unix: float | None = None


class Watcher:
    """Turns received frames into display lines while maintaining the router's index."""

    def __init__(self, *, block_size: int | None = None, router_eagle: str = "auto", router_salt: bool = True):
        self.block_size = block_size
        self.router_eagle = router_eagle
        self.router_salt = router_salt
        self.index: ReplayIndex | None = ReplayIndex(block_size) if block_size else None
        self.totals = WatchTotals()
        #: router tier -> engine block hashes (u64) the relay holds in it for this worker
        self.tiers: dict[str, set[int]] = {tier: set() for tier in dict.fromkeys(RELAY_TIERS.values())}

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
        t.last_batch_unix = time.time()
        prev = t.seq.last
        kind = t.seq.observe(seq)
        if kind == "gap":
            t.last_cause = (Cause.SEQUENCE_GAP, seq)
            return [f"seq {seq}: GAP: {seq - prev - 1} batches missing (seq {prev + 1}..{seq - 1}); "
                    "the router never indexed them"]
        if kind == "restart":
            return [f"seq {seq}: RESTART: the publisher's sequence went back from {prev} (a new engine process; "
                    "its cache starts empty)"]
        return []

    def _malformed(self, seq: int | None, reason: str) -> str:
        self.totals.malformed[reason.split(" (")[0].split(": ")[0]] += 1
        self.totals.last_cause = (Cause.EVENTS_DROPPED, seq)
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
        before = self.index.stats(WORKER) if self.index is not None else None
        dropped_bs, orphans = (before.dropped_block_size, before.dropped_orphans) if before else (0, 0)
        if self.index is not None:
            try:
                self.index.apply_batch(WORKER, events)
            except BatchRejected as exc:
                return self._malformed(batch.seq, str(exc))
        t.events += len(events)
        t.stored += stored
        t.removed += removed
        cleared = any(type(e) is Cleared for e in events)
        unmapped = self._file_by_tier(events)
        if unmapped:
            self.totals.last_cause = (Cause.MEDIUM_NOT_INDEXED, batch.seq)
        parts.append(f"+{stored} stored -{removed} removed" + (" (all cleared)" if cleared else ""))
        if bigram:
            parts.append("bigram pages" if all(bigram) else "plain pages" if not any(bigram) else "mixed pages")
            if self.router_eagle != "auto":
                want = self.router_eagle == "on"
                blind = sum(n_blocks(e) for e, b in framed if b != want)
                if blind:
                    self._blind("eagle_mismatch", blind, batch.seq)
                    parts.append(f"[router eagle {self.router_eagle}: {blind} blocks can never match]")
        nameless = sum(n_blocks(e) for e in stored_events if e.lid is not None and not e.lora)
        if nameless:
            self._blind("lora_without_name", nameless, batch.seq)
            parts.append(f"[{nameless} LoRA blocks without a LoRA name: keyed as base-model blocks]")
        salted = sum(n_blocks(e) for e in stored_events if e.salt) if not self.router_salt else 0
        if salted:
            self._blind("salt_stripped", salted, batch.seq)
            parts.append(f"[router without cache_salt: {salted} salted blocks can never match]")
        for medium, n in unmapped.items():
            parts.append(f"[{n} blocks with medium {medium!r}: the relay maps it to no tier, indexed nowhere]")
        if self.index is not None:
            parts.append(f"| router index: {self.index.blocks(WORKER)} blocks held")
            after = self.index.stats(WORKER)
            if after.dropped_block_size > dropped_bs:
                n = after.dropped_block_size - dropped_bs
                self._blind("block_size", n, batch.seq)
                parts.append(f"({n} dropped for block size != {self.block_size})")
            if after.dropped_orphans > orphans:
                t.last_cause = (Cause.SEQUENCE_GAP, batch.seq)
                parts.append(f"({after.dropped_orphans - orphans} orphan stores dropped: parent never indexed)")
        return " ".join(parts)

    def _file_by_tier(self, events: list[CompactEvent]) -> Counter[str]:
        """Apply ``events`` to the per-tier view as the relay files them; returns this batch's stored
        blocks per unmapped medium. A store of another block size is left out (the relay drops it)."""
        unmapped: Counter[str] = Counter()
        for e in events:
            if type(e) is Cleared:  # AllBlocksCleared empties every tier
                for held in self.tiers.values():
                    held.clear()
                continue
            if type(e) is Stored and self.block_size is not None and e.bs != self.block_size:
                continue
            tier = RELAY_TIERS.get(e.m)
            if tier is None:
                if type(e) is Stored:
                    unmapped[str(e.m)] += n_blocks(e)
                continue
            if type(e) is Stored:
                self.tiers[tier].update(u64_list(e.h))
            else:
                self.tiers[tier].difference_update(u64_list(e.h))
        self.totals.unmapped_media.update(unmapped)
        return unmapped

    def blocks_held_per_tier(self) -> dict[str, int]:
        """Engine blocks the router holds per tier (``device``, ``host_pinned``, ``disk``, ``external``)."""
        return {tier: len(held) for tier, held in self.tiers.items()}

    def _blind(self, reason: str, blocks: int, seq: int | None) -> None:
        self.totals.blind[reason] += blocks
        cause = BLIND_REASONS[reason] or (Cause.ROUTER_EAGLE_OFF if self.router_eagle == "off" else Cause.ROUTER_EAGLE_ON)
        self.totals.last_cause = (cause, seq)

    def orphan_stores(self) -> int:
        """Stored events the router's index drops because their parent block was never indexed."""
        return self.index.stats(WORKER).dropped_orphans if self.index is not None else 0

    def blocks_held(self) -> int:
        """Blocks the router's index holds for this worker now."""
        return self.index.blocks(WORKER) if self.index is not None else 0

    def summary(self) -> str:
        t, seq = self.totals, self.totals.seq
        held = self.blocks_held()
        span = f"seq {seq.first}..{seq.last}" if seq.first is not None else "no batches"
        line = (f"watch summary: {t.batches} batches ({span}), {len(seq.gaps)} gaps ({seq.missing_batches} batches "
                f"missing), {len(seq.restarts)} restarts, {sum(t.malformed.values())} malformed; blocks: "
                f"{t.stored} stored, {t.removed} removed, {held} held in the router index")
        if t.blind["eagle_mismatch"]:
            line += f"; {t.blind['eagle_mismatch']} stored blocks invisible to a router with eagle {self.router_eagle}"
        others = {r: n for r, n in t.blind.items() if n and r != "eagle_mismatch"}
        if others:
            line += "; router-blind blocks: " + ", ".join(f"{n} {r.replace('_', ' ')}" for r, n in others.items())
        tiers = self.blocks_held_per_tier()
        if any(n for tier, n in tiers.items() if tier != "device"):
            line += "; per tier: " + ", ".join(f"{n} {tier}" for tier, n in tiers.items())
        if t.unmapped_media:
            line += "; indexed nowhere (unmapped medium): " + ", ".join(f"{n} {m!r}" for m, n in t.unmapped_media.items())
        return line
