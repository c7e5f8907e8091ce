"""Did the engine's own KV events show the pages it reused? Which ones did not, and why.

The router can only credit what the engine publishes. When the engine reuses pages of a prompt
that its own event stream does not hold in the prompt's chain, no router can credit them, and the
fault is SGLang's publisher (or, in a test, a fault injected into it), not the router, its card,
the hop or the prompt. This module replays one worker's stream for one prompt, as Dynamo's relay
and index would (:class:`~kvalign.model.relay.Relay`: pages keyed by their token windows, linked
by the engine's block hashes), and names the first reused page the stream does not explain:

* **never stored**: no ``BlockStored`` in the stream carries that page's token window;
* **stored outside the chain**: a store carries the window, under a parent that is not the page
  the stream stored before it (a wrong parent, or a wrong block hash on the page before: the
  engine's later store names SGLang's true hash, recomputed here from the prompt, as its parent);
* **removed**: the stream stored it in the chain, then removed or cleared it, and the engine still
  reused it;
* **late**: the stream stored it in the chain only after the request was routed (``routed_at``):
  a timing race, told apart from the others by the recorded stream alone.

The first three are :attr:`~kvalign.model.causes.Cause.ENGINE_EVENTS_MISSING`, the last
:attr:`~kvalign.model.causes.Cause.ENGINE_EVENTS_LATE`; each names the pages in question.

The other direction is the engine's state against its stream: the engine reused *fewer* pages than
its stream held in the prompt's chain when the request was routed (capped by SGLang's own match
rule, :func:`~kvalign.model.sglang_keys.matchable_pages`). The engine no longer holds pages its
events still show, so the router over-credits them:

* **never removed**: no removal or clear of the first missing page follows in the stream (kept
  until the engine stored it again, or to the stream's end): the engine freed pages without
  publishing their removal, :attr:`~kvalign.model.causes.Cause.ENGINE_REMOVALS_MISSING`;
* **removed late**: the stream removed it, but only after the request was routed: the engine
  evicted it while the request waited (a timing race),
  :attr:`~kvalign.model.causes.Cause.ENGINE_EVENTS_LATE`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvalign.model.causes import Cause
from kvalign.model.events import EventBatch, Encoding
from kvalign.model.hashing import U64_MASK, block_hashes
from kvalign.model.relay import Relay, RouterCleared, RouterRemoved, RouterStored
from kvalign.model.sglang_keys import engine_block_hashes, matchable_pages
from kvalign.streams.capture import CaptureReader, expand_event


@dataclass(frozen=True)
class EngineReuseFinding:
    """The engine reused pages ``first..last`` of the prompt that its stream did not hold when the
    request was routed; ``kind`` says what the stream shows of page ``first`` instead."""

    cause: Cause
    kind: str  # never_stored | outside_chain | removed | late | never_removed | removed_late
    first: int  # the first prompt page in question (0-based)
    last: int  # the last one (inclusive)
    held: int  # leading pages of the prompt the stream held when the request was routed
    reused: int  # leading pages the engine reused
    detail: str
    seq: int | None = None  # the batch that shows it (the store, the removal, the late store)

    def as_json(self) -> dict[str, object]:
        return {"cause": self.cause.name, "kind": self.kind, "pages": [self.first, self.last], "held": self.held,
                "reused": self.reused, "seq": self.seq, "detail": self.detail}


@dataclass
class _Store:
    """One stored page of the prompt's window, as the stream delivered it."""

    index: int  # the batch's position in the stream
    seq: int | None
    ext: int  # its engine block hash (u64)
    parent: int | None  # the engine hash its event hangs it under (u64; None: a root)
    in_chain: bool


def _signed(h: int | None) -> int | None:
    """SGLang prints block hashes as signed int64; show them that way."""
    return None if h is None else (h - (1 << 64) if h >= 1 << 63 else h)


class _Chain:
    """The prompt's chain in one worker's stream: which engine hash holds prompt page k."""

    def __init__(self, query: Sequence[int], block_size: int) -> None:
        self.query, self.relay = list(query), Relay(block_size)
        self.page: dict[int, int] = {}  # engine hash (u64) -> prompt page it holds in the chain
        self.ext_of: dict[int, int] = {}  # prompt page -> the engine hash the stream stored it under
        self.stores: dict[int, list[_Store]] = {}  # prompt page -> every store of its window
        self.dropped_at: dict[int, int | None] = {}  # prompt page -> the batch that last removed or cleared it

    def held(self) -> int:
        k = 0
        while k in self.ext_of:
            k += 1
        return k

    def apply(self, index: int, batch: EventBatch) -> None:
        for ev in batch.events:
            conv = self.relay.convert(ev)
            if isinstance(conv, RouterStored):
                depth = 0 if conv.parent_hash is None else self.page.get(conv.parent_hash, -2) + 1
                parent = conv.parent_hash
                for ext, local in conv.blocks:
                    in_chain = 0 <= depth < len(self.query) and self.query[depth] == local
                    for k, q in enumerate(self.query):
                        if q == local:
                            self.stores.setdefault(k, []).append(_Store(index, batch.seq, ext, parent, in_chain and k == depth))
                    if in_chain:
                        self.page[ext], self.ext_of[depth] = depth, ext
                        depth += 1
                    else:
                        depth = -1  # the rest of the event hangs outside the prompt's chain
                    parent = ext
            elif isinstance(conv, RouterRemoved):
                for ext in conv.block_hashes:
                    k = self.page.pop(ext, None)
                    if k is not None and self.ext_of.get(k) == ext:
                        del self.ext_of[k]
                        self.dropped_at[k] = batch.seq
            elif isinstance(conv, RouterCleared):
                self.dropped_at.update(dict.fromkeys(self.ext_of, batch.seq))
                self.page.clear()
                self.ext_of.clear()


def explain_engine_reuse(batches: Sequence[EventBatch], tokens: Sequence[int], reused_tokens: int, block_size: int, *,
                         eagle: bool, routed_at: int | None = None, namespace: str | None = None,
                         lora: str | None = None) -> EngineReuseFinding | None:
    """Why the engine reused ``reused_tokens`` of ``tokens`` when its stream (``batches``, one
    worker's, from a point where its cache was empty) held fewer pages of the prompt after the first
    ``routed_at`` batches (default: all); None when the stream holds every page it reused."""
    b = block_size
    query = block_hashes(list(tokens), b, eagle=eagle, lora_name=lora, cache_namespace=namespace) if tokens else []
    reused = min(reused_tokens // b, len(query))
    cut = len(batches) if routed_at is None else max(0, min(routed_at, len(batches)))
    chain = _Chain(query, b)
    held_max = 0
    for j, batch in enumerate(batches[:cut]):
        chain.apply(j, batch)
        held_max = max(held_max, chain.held())
    held = chain.held()
    cap = matchable_pages(len(tokens), b, eagle=eagle)
    if reused < min(held, cap):
        return _shortfall(batches, cut, chain, len(tokens), reused, min(held, cap), b)
    if reused <= held:
        return None
    k = held
    ext_before = chain.ext_of.get(k - 1) if k else None
    pages = f"page {k}" if reused - 1 == k else f"pages {k}..{reused - 1}"
    span = f"tokens [{k * b}, {reused * b})"
    head = (f"the engine reused {reused} leading pages of this {len(tokens)}-token prompt ({reused * b} tokens), but "
            f"its own KV events held {held} when the request was routed: {pages} ({span}) "
            f"{'is' if reused - 1 == k else 'are'} not in the prompt's chain in the engine's stream")

    def finding(cause: Cause, kind: str, why: str, seq: int | None) -> EngineReuseFinding:
        return EngineReuseFinding(cause, kind, k, reused - 1, held, reused, f"{head}; {why}", seq)

    before = [s for s in chain.stores.get(k, []) if s.index < cut]
    if held_max > k:
        removed_at = chain.dropped_at.get(k)
        return finding(Cause.ENGINE_EVENTS_MISSING, "removed",
                       f"the stream stored page {k} in the chain and then removed or cleared it (at seq "
                       f"{removed_at}), yet the engine reused it: a removal SGLang published for a page it kept",
                       removed_at)
    later = _Chain(query, b)
    for j, batch in enumerate(batches):
        later.apply(j, batch)
        if j >= cut and later.held() > k:
            return finding(Cause.ENGINE_EVENTS_LATE, "late",
                           f"the stream stored page {k} in the chain only at seq {batch.seq}, {j - cut + 1} batch(es) "
                           "after the request was routed: the engine published its stores late (a timing race the "
                           "recorded stream shows; replaying the steps live may not reproduce it)", batch.seq)
    if before:
        s = before[0]
        sg = _sglang_hashes(tokens, b, eagle, namespace, k)
        if k == 0:
            why = (f"seq {s.seq} stores it under parent {_signed(s.parent)}, but page 0 has no parent: a wrong parent "
                   "hash in SGLang's BlockStored")
        elif ext_before is not None and s.parent is not None and sg is not None and s.parent == sg[k - 1] != ext_before:
            why = (f"seq {s.seq} stores it under parent {_signed(s.parent)}, which is SGLang's own hash of page {k - 1} "
                   f"(recomputed from the prompt), but the stream published page {k - 1} as {_signed(ext_before)}: "
                   "a wrong block hash in SGLang's BlockStored")
        elif ext_before is not None and sg is not None and ext_before == sg[k - 1]:
            why = (f"seq {s.seq} stores it under parent {_signed(s.parent)}, but page {k - 1} is "
                   f"{_signed(ext_before)} (the stream's and SGLang's own hash, recomputed from the prompt): a wrong "
                   "parent hash in SGLang's BlockStored")
        else:
            why = (f"seq {s.seq} stores it under parent {_signed(s.parent)}, but the stream stored page {k - 1} as "
                   f"{_signed(ext_before)}: the engine's events link it outside the prompt's chain")
        return finding(Cause.ENGINE_EVENTS_MISSING, "outside_chain", why, s.seq)
    return finding(Cause.ENGINE_EVENTS_MISSING, "never_stored",
                   f"no BlockStored in the engine's stream carries page {k}'s token window: SGLang reused pages it "
                   "never published", None)


def _shortfall(batches: Sequence[EventBatch], cut: int, chain: _Chain, n_tokens: int, reused: int, held: int,
               b: int) -> EngineReuseFinding:
    """The engine reused ``reused`` leading pages where its stream held ``held`` matchable ones (more) when the
    request was routed: page ``reused`` was freed, and the rest of the stream says whether its removal was ever
    published (``chain`` is the stream's state at the routing mark; it is played on)."""
    k, ext, last = reused, chain.ext_of[reused], held - 1
    pages = f"page {k}" if last == k else f"pages {k}..{last}"
    head = (f"the engine reused {reused} leading pages of this {n_tokens}-token prompt ({reused * b} tokens), but "
            f"its own KV events still held {held} it could match when the request was routed: {pages} "
            f"(tokens [{k * b}, {(last + 1) * b})) had been freed by the engine")
    for j, batch in enumerate(batches[cut:], start=cut):
        chain.apply(j, batch)
        if chain.ext_of.get(k) != ext:
            if chain.dropped_at.get(k, object()) == batch.seq:
                return EngineReuseFinding(
                    Cause.ENGINE_EVENTS_LATE, "removed_late", k, last, held, reused,
                    f"{head}; the stream removed page {k} only at seq {batch.seq}, {j - cut + 1} batch(es) after the "
                    "request was routed: the engine evicted it while the request waited (a timing race the recorded "
                    "stream shows)", batch.seq)
            break  # stored again under another hash: the removal was never published
    return EngineReuseFinding(
        Cause.ENGINE_REMOVALS_MISSING, "never_removed", k, last, held, reused,
        f"{head}; no BlockRemoved or AllBlocksCleared for page {k} (engine hash {_signed(ext)}) follows in the "
        "engine's stream: SGLang freed pages without publishing their removal, so the router credits pages no worker "
        "holds", None)


def _sglang_hashes(tokens: Sequence[int], b: int, eagle: bool, salt: str | None, k: int) -> list[int] | None:
    """SGLang's own hashes of the prompt's first ``k`` pages (u64), or None when they cannot be computed."""
    try:
        return [h & U64_MASK for h in engine_block_hashes(list(tokens), b, eagle=eagle, cache_salt=salt)[:k]]
    except ValueError:
        return None


def read_capture(path: str) -> list[EventBatch]:
    """A capture file's decodable batches, in order, as :class:`EventBatch` (a position in this list
    is a live capture's mark: undecodable batches are not counted there either)."""
    with CaptureReader(path) as reader:
        encoding: Encoding = "map" if reader.header.encoding == "map" else "positional"
        return list(_batches(reader.batches(), encoding))


def _batches(lines: Iterable, encoding: Encoding) -> Iterable[EventBatch]:
    for line in lines:
        if line.bad is None:
            yield EventBatch(line.ts or line.t, [expand_event(e) for e in line.ev], line.rank, encoding, line.seq)
