"""Replaying captures: rebuild each worker's router index exactly as Dynamo's relay would.

One capture is one worker (one SGLang publisher). Batches are applied in file order through
:class:`kvalign.streams.replay_index.ReplayIndex` (deferred unless an observer watches every event: the
stats come from the whole log at once, the tree is built when a prompt is first matched); a
batch that did not decode when captured, or that the router's decoder would reject, is skipped
whole — which is also what Dynamo does with it — and counted by reason, because a skipped batch
is a hole in the index just like a sequence gap.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvalign.streams.capture import Batch, CaptureError, CaptureReader, Cleared, Header, ReadIssues, capture_block_size
from kvalign.streams.replay_index import BatchRejected, Observer, ReplayIndex, WorkerStats
from kvalign.streams.sequence import SequenceTracker


@dataclass
class WorkerReplay:
    """What replaying one capture did to one worker's index."""

    name: str
    worker_id: int
    path: str
    header: Header
    batches: int = 0
    events: int = 0
    seq: SequenceTracker = field(default_factory=SequenceTracker)
    malformed: Counter[str] = field(default_factory=Counter)
    first_malformed: tuple[int | None, str] | None = None
    malformed_seqs: list[int] = field(default_factory=list)
    cleared_at: list[int | None] = field(default_factory=list)
    issues: ReadIssues = field(default_factory=ReadIssues)
    stats: WorkerStats = field(default_factory=WorkerStats)
    held: int = 0

    def _malformed(self, seq: int | None, reason: str) -> None:
        self.malformed[reason.split(" (")[0].split(": ")[0]] += 1
        if seq is not None:
            self.malformed_seqs.append(seq)
        if self.first_malformed is None:
            self.first_malformed = (seq, reason)


def default_worker_names(paths: Sequence[str], names: Sequence[str] | None) -> list[str]:
    """``--worker`` names in order, else each file's stem (made unique)."""
    names = list(names or [])
    if len(names) > len(paths):
        raise CaptureError(f"{len(names)} --worker names for {len(paths)} captures")
    out = []
    for i, path in enumerate(paths):
        name = names[i] if i < len(names) else os.path.splitext(os.path.basename(path))[0] or f"worker{i + 1}"
        while name in out:
            name += f"#{i + 1}"
        out.append(name)
    return out


def resolve_block_size(paths: Sequence[str], block_size: int | None) -> int:
    """The router's kv_block_size: given, else the first capture's engine block size."""
    if block_size is not None:
        if block_size < 1:
            raise CaptureError(f"block size must be >= 1, got {block_size}")
        return block_size
    for path in paths:
        found = capture_block_size(path)
        if found:
            return found
    raise CaptureError("no BlockStored event in the capture(s) to take a block size from; pass --block-size")


def replay_capture(
    index: ReplayIndex, path: str, name: str, worker_id: int, *, strict: bool = False,
    before_batch: Callable[[Batch], None] | None = None, after_batch: Callable[[Batch, bool], None] | None = None,
) -> WorkerReplay:
    """Apply every batch of one capture to ``index`` as worker ``worker_id``.

    ``before_batch(batch)`` and ``after_batch(batch, applied)`` bracket each batch line (diagnose
    uses them to date stores and removals).
    """
    with CaptureReader(path) as reader:
        rep = WorkerReplay(name, worker_id, path, reader.header, issues=reader.issues)
        apply = index.apply_batch
        for batch in reader.batches():
            rep.batches += 1
            rep.seq.observe(batch.seq)
            if before_batch is not None:
                before_batch(batch)
            if batch.bad is not None:
                reason = batch.bad
            else:
                try:
                    apply(worker_id, batch.ev)
                    rep.events += len(batch.ev)
                    if any(type(ev) is Cleared for ev in batch.ev):
                        rep.cleared_at.append(batch.seq)
                    if after_batch is not None:
                        after_batch(batch, True)
                    continue
                except BatchRejected as exc:
                    reason = str(exc)
            if after_batch is not None:
                after_batch(batch, False)
            if strict:
                raise CaptureError(f"{path}: batch seq {batch.seq} is malformed: {reason}")
            rep._malformed(batch.seq, reason)
    rep.stats = index.stats(worker_id)
    rep.held = index.blocks(worker_id)
    return rep


def replay_captures(
    paths: Sequence[str], names: Sequence[str] | None = None, *, block_size: int | None = None,
    strict: bool = False, observer: Observer | None = None,
) -> tuple[ReplayIndex, list[WorkerReplay]]:
    """Replay several captures (one worker each) into one router index."""
    if not paths:
        raise CaptureError("no capture given")
    names = default_worker_names(paths, names)
    # deferred: stats for the whole log at once; an observer must see every event applied
    index = ReplayIndex(resolve_block_size(paths, block_size), observer, deferred=observer is None)
    reps = [replay_capture(index, path, name, i, strict=strict) for i, (path, name) in enumerate(zip(paths, names), start=1)]
    return index, reps
