"""Dynamo's worker relay and the router's prefix index, fused for replaying captures fast.

:class:`kvalign.relay.Relay` + :class:`kvalign.index.PrefixIndex` are the readable reference (one
object per event, one node object per block, one hasher call per page): about 10^5 blocks/s. A
capture of a busy worker holds millions of blocks, and ``replay``/``diagnose`` should answer in
seconds, so this module applies the *same rules* to capture events directly:

* tokens stay in the capture's u32 byte buffer; each page is one XXH3 call on a slice of it, with
  the seed derived once per event (the relay's per-page hasher call gives identical hashes);
* a radix-tree node is named by the router's own sequence hash of its path (``seq[0] = local[0]``,
  ``seq[i] = xxh3(seq[i-1] || local[i], 1337)``), so the tree needs no child tables: walking a
  prompt is hashing its chain, and storing an event is a bulk dict and set update in C (a 2^-64
  collision is the only way two paths could share a name);
* a worker holds a node while one of its engine hashes maps to it: a set of held nodes plus a
  count for the rare node several engine hashes map to replace PrefixIndex's
  ``node not in nodes.values()`` scan, which is linear per removal;
* relay rules are kept exactly: per-event EAGLE from the payload shape, ``block_size`` mismatch
  and short windows drop the rest of the event, duplicate hashes drop the event, unsalted events
  inherit the parent's namespace, engine hashes are read as u64, orphans (unknown parent) are
  dropped — and, like Dynamo's deserializer, a batch whose token ids do not fit u32 is dropped
  whole.

The unit tests replay real SGLang captures through both implementations and require identical
overlaps and stats, and check both against Dynamo's real ``RadixTree``.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from kvalign.capture import Cleared, CompactEvent, Removed, Stored
from kvalign.hashing import U64_MASK, XXH3_SEED, salt_seed

_xxh3 = xxhash.xxh3_64_intdigest
_pack2 = struct.Struct("<QQ").pack
_BIG_ENDIAN = sys.byteorder == "big"


class BatchRejected(ValueError):
    """The router's decoder would reject this whole batch (it is skipped, not partly applied)."""


@dataclass
class WorkerStats:
    """Per worker: what was stored, removed, and what the relay/index dropped and why."""

    blocks_stored: int = 0  # blocks in BlockStored events
    blocks_indexed: int = 0  # blocks the relay passed to the index
    blocks_removed: int = 0  # hashes in BlockRemoved events
    clears: int = 0
    dropped_block_size: int = 0
    dropped_short_window: int = 0
    dropped_duplicate_events: int = 0
    dropped_orphans: int = 0  # events whose parent the index does not know


@dataclass(frozen=True)
class StoredPages:
    """What the index did with one ``BlockStored``, for observers (diagnose)."""

    worker: int
    event: Stored
    ext: list[int]  # u64 engine hashes of the indexed pages
    local: list[int]  # router local hashes of those pages
    nodes: list[int] | None  # index nodes (sequence hashes), None when the event was an orphan
    parent_node: int | None  # the node the event hangs under (None = root)
    namespace: str | None
    raw: bytes  # the event's raw token window, u32 LE
    bigram: bool


Observer = Callable[[StoredPages], None]


class _Worker:
    __slots__ = ("ext2node", "held", "multi", "stale", "namespace", "stats")

    def __init__(self) -> None:
        self.ext2node: dict[int, int] = {}
        self.held: set[int] = set()  # nodes at least one of this worker's engine hashes maps to
        self.multi: dict[int, int] = {}  # node -> extra engine hashes mapping to it (rare)
        self.stale: set[int] = set()  # nodes PrefixIndex keeps the worker on after an overwrite
        self.namespace: dict[int, str] = {}  # relay: engine hash -> cache namespace (None omitted)
        self.stats = WorkerStats()

    def holds(self, node: int) -> bool:
        return node in self.held or node in self.stale

    def map(self, e: int, child: int) -> None:
        """Point engine hash ``e`` at ``child`` (the slow path of :meth:`ReplayIndex._link`)."""
        old = self.ext2node.get(e)
        if old == child:
            return
        self.ext2node[e] = child
        if child in self.held:
            self.multi[child] = self.multi.get(child, 0) + 1
        else:
            self.held.add(child)
        if old is not None:  # an engine hash re-used for other content: PrefixIndex keeps the old node
            if not self.unmap(old):
                self.stale.add(old)

    def unmap(self, node: int) -> bool:
        """One engine hash stopped mapping to ``node``; False when none maps to it any more."""
        extra = self.multi.get(node)
        if extra:
            if extra > 1:
                self.multi[node] = extra - 1
            else:
                del self.multi[node]
            return True
        self.held.discard(node)
        return False


def _raw_tokens(ev: Stored) -> bytes:
    """The event's raw token window as u32 LE; raises BatchRejected where a decoder would fail."""
    if ev.bs < 1:
        raise BatchRejected(f"BlockStored.block_size must be a positive integer, got {ev.bs}")
    if ev.tok is None:
        raw = ev.t
        units = len(raw) // 4 - (1 if ev.pairs and raw else 0)
    else:
        toks = ev.tok
        units = len(toks)
        if toks and isinstance(toks[0], list):
            if any(not isinstance(p, list) or len(p) != 2 for p in toks):
                raise BatchRejected("token_ids mixes ints and pairs")
            toks = [p[0] for p in toks] + [toks[-1][1]]  # Dynamo's flattening, no chain check
        try:
            arr = array("I", toks)
        except (OverflowError, TypeError):
            raise BatchRejected("token id out of the u32 range (Dynamo's decoder drops the batch)") from None
        if _BIG_ENDIAN:
            arr.byteswap()
        raw = arr.tobytes()
    if len(raw) % 4 or units != ev.bs * len(ev.h):
        raise BatchRejected(f"BlockStored carries {units} token units for {len(ev.h)} blocks of size {ev.bs}")
    return raw


def _is_bigram(ev: Stored) -> bool:
    return ev.pairs if ev.tok is None else bool(ev.tok) and isinstance(ev.tok[0], list)


class ReplayIndex:
    """Router-side index rebuilt from capture events of one or more workers."""

    def __init__(self, kv_block_size: int, observer: Observer | None = None):
        if kv_block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1, got {kv_block_size}")
        self.kv_block_size = kv_block_size
        self.observer = observer
        self._workers: dict[int, _Worker] = {}
        self._seeds: dict[tuple[str | None, str | None], int] = {}

    def _worker(self, worker_id: int) -> _Worker:
        w = self._workers.get(worker_id)
        if w is None:
            w = self._workers[worker_id] = _Worker()
        return w

    def stats(self, worker_id: int) -> WorkerStats:
        return self._worker(worker_id).stats

    def apply_batch(self, worker_id: int, events: Sequence[CompactEvent]) -> None:
        """Apply one batch; raises :class:`BatchRejected` (nothing applied) like Dynamo's decoder."""
        raws = [_raw_tokens(ev) if type(ev) is Stored else None for ev in events]
        w = self._worker(worker_id)
        for ev, raw in zip(events, raws):
            if raw is not None:
                self._stored(worker_id, w, ev, raw)  # type: ignore[arg-type]
            elif type(ev) is Removed:
                self._removed(w, ev)
            elif type(ev) is Cleared:
                w.stats.clears += 1
                if w.stale:
                    w.stale.difference_update(w.held)
                w.held.clear()
                w.multi.clear()
                w.ext2node.clear()
                w.namespace.clear()

    def _stored(self, worker_id: int, w: _Worker, ev: Stored, raw: bytes) -> None:
        st = w.stats
        n_ev = len(ev.h)
        st.blocks_stored += n_ev
        parent = None if ev.p is None else ev.p & U64_MASK
        ext = [h & U64_MASK for h in ev.h]
        if len(set(ext)) != n_ev or (parent is not None and parent in ext):
            st.dropped_duplicate_events += 1
            return
        ns = ev.salt or (w.namespace.get(parent) if parent is not None else None)
        b = self.kv_block_size
        bigram = _is_bigram(ev)
        if ev.bs != b:
            st.dropped_block_size += n_ev
            n = 0
        else:
            win = (b + 1 if bigram else b) * 4
            fit = (len(raw) - win) // (b * 4) + 1 if len(raw) >= win else 0
            n = min(n_ev, fit)
            st.dropped_short_window += n_ev - n
        parent_node = None if parent is None else w.ext2node.get(parent)
        orphan = parent is not None and parent_node is None
        if orphan:
            st.dropped_orphans += 1
        local: list[int] = []
        nodes: list[int] | None = None if orphan else []
        if n:
            key = (ev.lora, ns)
            seed = self._seeds.get(key)
            if seed is None:
                seed = self._seeds[key] = salt_seed(ev.lora, ns)
            mv = memoryview(raw)
            starts = range(0, n * b * 4, b * 4)
            if n < n_ev:
                ext = ext[:n]
            if ns is not None:
                w.namespace.update(dict.fromkeys(ext, ns))
            elif w.namespace:
                for h in ext:
                    w.namespace.pop(h, None)
            if self.observer is not None or orphan:
                local = [_xxh3(mv[s : s + win], seed) for s in starts]
                if not orphan:
                    nodes = _chain(parent_node, local)
            else:  # the hot path: local hash and sequence chain in one pass
                xxh3, pack2, chain_seed = _xxh3, _pack2, XXH3_SEED
                node = parent_node if parent_node is not None else xxh3(mv[0:win], seed)
                nodes = [] if parent_node is not None else [node]
                append = nodes.append
                for s in starts if parent_node is not None else starts[1:]:
                    node = xxh3(pack2(node, xxh3(mv[s : s + win], seed)), chain_seed)
                    append(node)
            if nodes:
                self._link(w, ext, nodes)
                st.blocks_indexed += n
        if self.observer is not None:
            self.observer(StoredPages(worker_id, ev, ext[:n], local, nodes, parent_node, ns, raw, bigram))

    @staticmethod
    def _link(w: _Worker, ext: list[int], nodes: list[int]) -> None:
        ext2node = w.ext2node
        if ext2node.keys().isdisjoint(ext) and w.held.isdisjoint(nodes):  # the common case, all in C
            ext2node.update(zip(ext, nodes))
            w.held.update(nodes)
        else:
            for e, child in zip(ext, nodes):
                w.map(e, child)

    def _removed(self, w: _Worker, ev: Removed) -> None:
        w.stats.blocks_removed += len(ev.h)
        ext2node = w.ext2node
        for h in ev.h:
            e = h & U64_MASK
            if w.namespace:
                w.namespace.pop(e, None)
            node = ext2node.pop(e, None)
            if node is not None and not w.unmap(node):
                w.stale.discard(node)

    def overlap(self, local_hashes: Sequence[int]) -> dict[int, int]:
        """Leading blocks of the prompt each worker holds (workers with 0 omitted)."""
        scores: dict[int, int] = {}
        active = list(self._workers.items())
        for depth, node in enumerate(chain_nodes(local_hashes), start=1):
            active = [(wid, w) for wid, w in active if w.holds(node)]
            if not active:
                break
            for wid, _ in active:
                scores[wid] = depth
        return scores

    def holds(self, worker_id: int, node: int) -> bool:
        return self._worker(worker_id).holds(node)

    def blocks(self, worker_id: int) -> int:
        """How many engine blocks ``worker_id`` currently has indexed."""
        return len(self._worker(worker_id).ext2node)

    def workers(self) -> list[int]:
        return sorted(self._workers)


def _chain(parent_node: int | None, local_hashes: Sequence[int]) -> list[int]:
    out: list[int] = []
    node = parent_node
    for h in local_hashes:
        node = int(h) if node is None else _xxh3(_pack2(node, int(h)), XXH3_SEED)
        out.append(node)
    return out


def chain_nodes(local_hashes: Sequence[int]) -> list[int]:
    """The index node names along a prompt: the router's sequence hashes of its local hashes."""
    return _chain(None, local_hashes)
