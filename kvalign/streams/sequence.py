"""Batch sequence numbers: the only way to see that a KV-event subscriber missed something.

SGLang numbers every published batch from 0 per publisher (``itertools.count``), and ZMQ PUB/SUB
drops silently (slow joiner, high-water mark, reconnects). A jump in the sequence is a batch the
router never indexed; a sequence that goes backwards is a new publisher, i.e. a restarted engine
with a fresh cache. Capture, replay and watch all classify sequence numbers with this one tracker
so they report the same gaps and restarts for the same stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

SeqKind = Literal["first", "next", "gap", "restart", "unnumbered"]


@dataclass
class SequenceTracker:
    """Classifies each batch's sequence number against the previous one."""

    first: int | None = None
    last: int | None = None
    gaps: list[tuple[int, int]] = field(default_factory=list)  # (last seen, next seen)
    restarts: list[tuple[int, int]] = field(default_factory=list)  # (last seen, new first)

    def observe(self, seq: int | None) -> SeqKind:
        """Record ``seq`` and say how it relates to the previous batch."""
        if seq is None:
            return "unnumbered"
        prev, self.last = self.last, seq
        if prev is None:
            self.first = seq
            return "first"
        if seq == prev + 1:
            return "next"
        if seq > prev:
            self.gaps.append((prev, seq))
            return "gap"
        self.restarts.append((prev, seq))
        return "restart"

    @property
    def missing_batches(self) -> int:
        """Batches skipped by all gaps together."""
        return sum(b - a - 1 for a, b in self.gaps)

    def describe_gaps(self, limit: int = 3) -> str:
        """``seq 4..6, seq 9`` style list of the missing sequence numbers."""
        parts = [f"seq {a + 1}" if b - a == 2 else f"seq {a + 1}..{b - 1}" for a, b in self.gaps[:limit]]
        if len(self.gaps) > limit:
            parts.append(f"and {len(self.gaps) - limit} more")
        return ", ".join(parts)
