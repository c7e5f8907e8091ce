"""Dynamo's worker relay and the router's prefix index, fused for replaying captures fast.

:class:`kvalign.model.relay.Relay` + :class:`kvalign.model.index.PrefixIndex` are the readable reference (one
object per event, one node object per block, one hasher call per page): about 10^5 blocks/s. A
capture of a busy worker holds millions of blocks, and ``replay``/``diagnose`` should answer in
seconds, so this module applies the *same rules* to capture events directly:

* tokens stay in the capture's u32 byte buffer; each page is one XXH3 call on a slice of it, with
  the seed derived once per event (the relay's per-page hasher call gives identical hashes);
* a radix-tree node is named by the router's own sequence hash of its path (``seq[0] = local[0]``,
  ``seq[i] = xxh3(seq[i-1] || local[i], 1337)``), so the tree needs no child tables: walking a
  prompt is hashing its chain, and storing an event is a bulk dict and set update in C (a 2^-64
  collision is the only way two paths could share a name);
* a worker holds a node while one of its engine hashes maps to it; storing touches only the
  engine-hash map, and the held set is derived when a prompt is matched (reference counts, which
  replace PrefixIndex's linear ``node not in nodes.values()`` scan, are kept only once an engine
  hash is stored again while still mapped);
* relay rules are kept exactly: per-event EAGLE from the payload shape, ``block_size`` mismatch
  and short windows drop the rest of the event, duplicate hashes drop the event, unsalted events
  inherit the parent's namespace, engine hashes are read as u64, orphans (unknown parent) are
  dropped — and, like Dynamo's deserializer, a batch whose token ids do not fit u32 is dropped
  whole.

``replay`` needs only what the index did (the stats and how many blocks each worker holds),
and a million-entry dict costs more than reading the capture, so a *deferred* index
(``deferred=True``, what :func:`kvalign.streams.replay.replay_captures` uses) keeps each worker's events
and settles the same rules for the whole log at once in numpy (:func:`_summarize`): the fate of
an event depends only on whether its parent's engine hash is mapped when it arrives, which is a
question about the pages sharing that hash, so only those are sorted. Hashing the pages and
building the nodes happens the first time a prompt is matched, by applying the log event by
event as above; ``diagnose`` (which observes every event) and ``watch`` apply events as they come.

The unit tests replay real SGLang captures through both implementations and require identical
overlaps and stats, and check both against Dynamo's real ``RadixTree``; the deferred index is
held to the event-by-event one on the same streams.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np
import xxhash

from kvalign.streams.capture import Cleared, CompactEvent, Removed, Stored, u64_list
from kvalign.model.hashing import XXH3_SEED, _window_dtype, salt_seed

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
    """One worker's side of the index.

    A node is held while one of the worker's engine hashes maps to it. Stores only touch
    ``ext2node`` (one bulk update per event); which nodes are held is derived when a prompt is
    matched. Reference counts are kept only after the first engine hash that is stored again
    while still mapped: from then on a removal must know whether another hash still maps to its
    node, and PrefixIndex keeps the worker on the overwritten node (``stale``).
    """

    __slots__ = ("ext2node", "refs", "stale", "namespace", "stats", "_held", "log", "summary")

    def __init__(self, deferred: bool = False) -> None:
        self.ext2node: dict[int, int] = {}
        self.refs: Counter[int] | None = None  # node -> engine hashes mapping to it (exact mode only)
        self.stale: set[int] = set()  # nodes PrefixIndex keeps the worker on after an overwrite
        self.namespace: dict[int, str] = {}  # relay: engine hash -> cache namespace (None omitted)
        self.stats = WorkerStats()
        self._held: set[int] | None = None  # cache of ext2node's values, for matching
        # deferred mode: the events, applied only when a prompt is matched (see ReplayIndex)
        self.log: list[tuple[CompactEvent, bytes | None]] | None = [] if deferred else None
        self.summary: tuple[WorkerStats, int] | None = None  # _summarize(log), until the log grows

    def holds(self, node: int) -> bool:
        if self.refs is not None:
            return node in self.refs or node in self.stale
        if self._held is None:
            self._held = set(self.ext2node.values())
        return node in self._held

    def store(self, ext: list[int], nodes: list[int]) -> None:
        self._held = None
        ext2node = self.ext2node
        if self.refs is None:
            if ext2node.keys().isdisjoint(ext):
                ext2node.update(zip(ext, nodes))  # the common case, all in C
                return
            self.refs = Counter(ext2node.values())  # an engine hash stored again: exact from now on
        for e, child in zip(ext, nodes):
            old = ext2node.get(e)
            if old == child:
                continue
            ext2node[e] = child
            self.refs[child] += 1
            if old is not None and not self._unref(old):
                self.stale.add(old)  # PrefixIndex keeps the worker on the overwritten node

    def remove(self, e: int) -> None:
        node = self.ext2node.pop(e, None)
        if node is not None:
            self._held = None
            if self.refs is not None and not self._unref(node):
                self.stale.discard(node)

    def _unref(self, node: int) -> bool:
        """One engine hash stopped mapping to ``node``; False when none maps to it any more."""
        refs = self.refs
        assert refs is not None
        if refs[node] > 1:
            refs[node] -= 1
            return True
        del refs[node]
        return False

    def clear(self) -> None:
        if self.stale and self.refs is not None:
            self.stale.difference_update(self.refs)
        if self.refs is not None:
            self.refs.clear()
        self.ext2node.clear()
        self.namespace.clear()
        self._held = None


def _raw_tokens(ev: Stored) -> bytes:
    """The event's raw token window as u32 LE; raises BatchRejected where a decoder would fail."""
    raw, bs, nh = ev.t, ev.bs, len(ev.h)
    if (ev.tok is None and bs >= 1 and not nh & 7 and not len(raw) & 3
            and len(raw) // 4 - (1 if ev.pairs and raw else 0) == bs * (nh >> 3)):
        return raw  # the common case, checked in one expression
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
    if len(ev.h) % 8:
        raise BatchRejected("BlockStored.block_hashes is not a whole number of u64 values")
    if len(raw) % 4 or units != ev.bs * (len(ev.h) // 8):
        raise BatchRejected(f"BlockStored carries {units} token units for {len(ev.h) // 8} blocks of size {ev.bs}")
    return raw


def _check_removed(ev: CompactEvent) -> None:
    if type(ev) is Removed and len(ev.h) % 8:
        raise BatchRejected("BlockRemoved.block_hashes is not a whole number of u64 values")
    return None


def _is_bigram(ev: Stored) -> bool:
    return ev.pairs if ev.tok is None else bool(ev.tok) and isinstance(ev.tok[0], list)


class ReplayIndex:
    """Router-side index rebuilt from capture events of one or more workers.

    ``deferred=True`` keeps the events and answers :meth:`stats` and :meth:`blocks` from the
    whole log at once; the first :meth:`overlap` or :meth:`holds` applies the log event by event
    (the time ``replay`` saves, a match pays once). Only for a log that is read to its end: a
    live stream (``watch``) would keep every event.
    """

    def __init__(self, kv_block_size: int, observer: Observer | None = None, *, deferred: bool = False):
        if kv_block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1, got {kv_block_size}")
        if deferred and observer is not None:
            raise ValueError("an observer needs every event applied as it comes (deferred=False)")
        self.kv_block_size = kv_block_size
        self.observer = observer
        self.deferred = deferred
        self._workers: dict[int, _Worker] = {}
        self._seeds: dict[tuple[str | None, str | None], int] = {}

    def _worker(self, worker_id: int) -> _Worker:
        w = self._workers.get(worker_id)
        if w is None:
            w = self._workers[worker_id] = _Worker(self.deferred)
        return w

    def _summary(self, w: _Worker) -> tuple[WorkerStats, int]:
        assert w.log is not None
        if w.summary is None:
            w.summary = _summarize(w.log, self.kv_block_size)
        return w.summary

    def _materialize(self, worker_id: int) -> _Worker:
        """A deferred worker's events applied one by one, as a non-deferred index would have."""
        w = self._worker(worker_id)
        if w.log is not None:
            log, w.log, w.summary = w.log, None, None
            for ev, raw in log:
                self._apply(worker_id, w, ev, raw)
        return w

    def stats(self, worker_id: int) -> WorkerStats:
        w = self._worker(worker_id)
        return self._summary(w)[0] if w.log is not None else w.stats

    def apply_batch(self, worker_id: int, events: Sequence[CompactEvent]) -> None:
        """Apply one batch; raises :class:`BatchRejected` (nothing applied) like Dynamo's decoder."""
        raws = [_raw_tokens(ev) if type(ev) is Stored else _check_removed(ev) for ev in events]
        w = self._worker(worker_id)
        if w.log is not None:
            w.log.extend(zip(events, raws))
            w.summary = None
            return
        for ev, raw in zip(events, raws):
            self._apply(worker_id, w, ev, raw)

    def _apply(self, worker_id: int, w: _Worker, ev: CompactEvent, raw: bytes | None) -> None:
        if raw is not None:
            self._stored(worker_id, w, ev, raw)  # type: ignore[arg-type]
        elif type(ev) is Removed:
            self._removed(w, ev)
        elif type(ev) is Cleared:
            w.stats.clears += 1
            w.clear()

    def _stored(self, worker_id: int, w: _Worker, ev: Stored, raw: bytes) -> None:
        st = w.stats
        ext = u64_list(ev.h)
        n_ev = len(ext)
        st.blocks_stored += n_ev
        parent = ev.p
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
            if n < n_ev:
                ext = ext[:n]
            if ns is not None:
                w.namespace.update(dict.fromkeys(ext, ns))
            elif w.namespace:
                for h in ext:
                    w.namespace.pop(h, None)
            # every page window as one bytes object (one overlapping V-dtype view, see hashing.py),
            # then one XXH3 call per page in C; only the sequence chain is a Python loop
            windows = np.ndarray((n,), _window_dtype(win), raw, 0, (b * 4,)).tolist()
            local = list(map(_xxh3, windows, repeat(seed, n)))
            if not orphan:
                nodes = _chain_fast(parent_node, local)
            if nodes:
                w.store(ext, nodes)
                st.blocks_indexed += n
        if self.observer is not None:
            self.observer(StoredPages(worker_id, ev, ext[:n], local, nodes, parent_node, ns, raw, bigram))

    def _removed(self, w: _Worker, ev: Removed) -> None:
        hashes = u64_list(ev.h)
        w.stats.blocks_removed += len(hashes)
        for e in hashes:
            if w.namespace:
                w.namespace.pop(e, None)
            w.remove(e)

    def overlap(self, local_hashes: Sequence[int]) -> dict[int, int]:
        """Leading blocks of the prompt each worker holds (workers with 0 omitted)."""
        scores: dict[int, int] = {}
        active = [(wid, self._materialize(wid)) for wid in self._workers]
        for depth, node in enumerate(chain_nodes(local_hashes), start=1):
            active = [(wid, w) for wid, w in active if w.holds(node)]
            if not active:
                break
            for wid, _ in active:
                scores[wid] = depth
        return scores

    def holds(self, worker_id: int, node: int) -> bool:
        return self._materialize(worker_id).holds(node)

    def blocks(self, worker_id: int) -> int:
        """How many engine blocks ``worker_id`` currently has indexed."""
        w = self._worker(worker_id)
        return self._summary(w)[1] if w.log is not None else len(w.ext2node)

    def workers(self) -> list[int]:
        return sorted(self._workers)


def _last_before(xs: np.ndarray, times: np.ndarray, qx: np.ndarray, qt: np.ndarray) -> np.ndarray:
    """For entries sorted by (x, time): per query, the position of the last entry with x == qx
    and time < qt, or -1. One composite key (rank of x, time) makes it two ``searchsorted``."""
    if not len(xs) or not len(qx):
        return np.full(len(qx), -1, np.int64)
    rank = np.zeros(len(xs), np.int64)
    np.cumsum(xs[1:] != xs[:-1], out=rank[1:])
    span = int(max(times.max(), qt.max())) + 2
    comp = rank * span + times
    i = np.minimum(np.searchsorted(xs, qx), len(xs) - 1)
    found = xs[i] == qx
    j = np.searchsorted(comp, rank[i] * span + qt - 1, "right") - 1
    return np.where(found & (j >= i), j, -1)


def _time_at(times: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """``times[pos]``, and -1 (before everything) where ``pos`` is -1."""
    if not len(times):
        return np.full(len(pos), -1, np.int64)
    return np.where(pos >= 0, times[np.maximum(pos, 0)], -1)


def _by_x(x: np.ndarray, times: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Entries sorted by (x, time), given entries already in time order: (order, xs, times)."""
    order = np.argsort(x, kind="stable")
    return order, x[order], times[order]


def _candidates(x: np.ndarray, marked: Sequence[np.ndarray]) -> np.ndarray:
    """Positions of the pages that may share their engine hash with another page, a parent or a
    removal: every such page, and a few others (one bucket table in numpy, no sort).

    A page left out holds a hash seen exactly once in the log, so its fate is its event's.
    """
    n = len(x)
    bits = min(max(10, (8 * n).bit_length()), 24)  # ~8 buckets per page, at most 64 MiB of table
    mask = (1 << bits) - 1
    bucket = x.view(np.int64) & mask
    dtype = np.int32 if n < 1 << 31 else np.int64
    table = np.empty(1 << bits, dtype)
    pos = np.arange(n, dtype=dtype)
    table[bucket] = pos  # the last page written into each bucket
    pick = np.zeros(n, bool)
    shared = table[bucket] != pos  # pages whose bucket holds a later page too
    pick[shared] = True
    pick[table[bucket[shared]]] = True  # and those later pages
    for m in marked:  # a bucket's pages are its last page and the pages picked as shared
        mb = m.view(np.int64) & mask
        last = table[mb]
        ok = (last >= 0) & (last < n)
        last = last[ok]
        pick[last[bucket[last] == mb[ok]]] = True  # (unwritten buckets hold garbage)
    return np.flatnonzero(pick)


def _summarize(log: list[tuple[CompactEvent, bytes | None]], b: int) -> tuple[WorkerStats, int]:
    """The relay + index rules applied to a whole event log at once: (stats, blocks held).

    Per event only a few Python operations; per block a few numpy passes. An event's fate
    depends on the index state when it arrived: "is the parent mapped at time t" is "the
    parent's last indexed page before t came after its last removal and the last clear",
    answered by sorting the pages whose hash occurs more than once, or as a parent or removal,
    by (engine hash, time). Which pages are indexed depends in turn on which earlier events were
    orphans, so orphans are settled in one pass in event order.
    """
    st = WorkerStats()
    # the log as columns, with comprehensions (several times cheaper than one loop of appends)
    evs, raws = zip(*log) if log else ((), ())
    kinds = list(map(type, evs))
    ev_t = [t for t, k in enumerate(kinds) if k is Stored]
    stored = [evs[t] for t in ev_t]
    parents = [ev.p for ev in stored]
    par_ev = [i for i, p in enumerate(parents) if p is not None]
    par = [parents[i] for i in par_ev]
    hs = [ev.h for ev in stored]
    rem_t = [t for t, k in enumerate(kinds) if k is Removed]
    rem = [evs[t].h for t in rem_t]
    clears = [t for t, k in enumerate(kinds) if k is Cleared]
    ne_a = np.array(list(map(len, hs)), np.int64) >> 3
    bs_a = np.array([ev.bs for ev in stored], np.int64) == b
    win = np.array([b + 1 if (ev.pairs if ev.tok is None else _is_bigram(ev)) else b for ev in stored], np.int64)
    spare = np.array([len(raws[t]) for t in ev_t], np.int64) // 4 - win  # token units beyond the first window
    fit = np.where(spare >= 0, spare // b + 1, 0)
    ni_a = np.where(bs_a, np.minimum(ne_a, fit), 0)
    n_idx = ni_a.tolist()
    st.clears = len(clears)
    n_s = len(ev_t)
    evt_a = np.array(ev_t, np.int64)
    st.blocks_stored = int(ne_a.sum())
    rx = np.frombuffer(b"".join(rem), "<u8").astype(np.uint64, copy=False)
    rt = np.repeat(np.array(rem_t, np.int64), np.array(list(map(len, rem)), np.int64) >> 3)
    st.blocks_removed = len(rx)
    pq = np.array(par, np.uint64)
    pe = np.array(par_ev, np.int64)
    x = np.frombuffer(b"".join(hs), "<u8").astype(np.uint64, copy=False)
    starts = np.zeros(n_s, np.int64)
    np.cumsum(ne_a[:-1], out=starts[1:])

    # candidate pages, sorted by (engine hash, time)
    ci = _candidates(x, (pq, rx))
    cev = np.searchsorted(starts, ci, "right") - 1  # (events without pages share a start: take the last)
    cpos = ci - starts[cev]
    xc = x[ci]
    order = np.argsort(xc, kind="stable")
    sx = xc[order]
    sev = cev[order]
    spos = cpos[order]
    stime = evt_a[sev]
    dup = np.zeros(n_s, bool)
    same = (sx[1:] == sx[:-1]) & (sev[1:] == sev[:-1])  # a hash repeated inside one event
    dup[sev[1:][same]] = True
    jp = _last_before(sx, stime, pq, evt_a[pe] + 1)  # the parent's last page at or before the event
    own = jp >= 0
    own[own] = sev[jp[own]] == pe[own]
    dup[pe[own]] = True  # the parent is one of the event's own hashes
    lo = np.searchsorted(sx, pq)  # the parent's first page (to walk back past pages not indexed)
    _, rsx, rst = _by_x(rx, rt)
    last_rem = _time_at(rst, _last_before(rsx, rst, pq, evt_a[pe]))  # the parent's last removal before
    clear_a = np.array(clears, np.int64)
    last_clear = _time_at(clear_a, np.searchsorted(clear_a, evt_a[pe]) - 1)

    # orphans, in event order: a page is indexed only if its event was neither dup nor orphan
    orphan = [False] * n_s
    dup_l = dup.tolist()
    jc = np.maximum(jp, 0)
    first = zip(sev[jc].tolist(), spos[jc].tolist(), stime[jc].tolist()) if len(sev) else repeat((0, 0, 0))
    for e, j, j0, tr, tc, (f, fpos, ft) in zip(pe.tolist(), jp.tolist(), lo.tolist(), last_rem.tolist(),
                                              last_clear.tolist(), first):
        if dup_l[e]:
            continue
        while j >= j0 and (dup_l[f] or orphan[f] or fpos >= n_idx[f]):  # rare: that page was not indexed
            j -= 1
            if j >= j0:
                f, fpos, ft = int(sev[j]), int(spos[j]), int(stime[j])
        if j < j0 or ft < tr or ft < tc:
            orphan[e] = True
    orph = np.array(orphan, bool)
    live_ev = ~dup & ~orph
    st.dropped_duplicate_events = int(dup.sum())
    st.dropped_orphans = int(orph.sum())
    st.blocks_indexed = int(ni_a[live_ev].sum())
    st.dropped_block_size = int(ne_a[~dup & ~bs_a].sum())
    st.dropped_short_window = int((ne_a - ni_a)[~dup & bs_a].sum())

    # held now. A candidate hash: its last indexed page came after its last removal and the last
    # clear. Any other indexed page holds a hash seen once: held if it came after the last clear.
    final_clear = clears[-1] if clears else -1
    valid = live_ev[sev] & (spos < ni_a[sev])
    in_cand = np.bincount(sev[valid], minlength=n_s)  # indexed candidate pages per event
    held = int((ni_a - in_cand)[live_ev & (evt_a > final_clear)].sum())
    vp = np.flatnonzero(valid)
    if len(vp):
        vx = sx[vp]
        last = np.ones(len(vp), bool)
        last[:-1] = vx[1:] != vx[:-1]
        lx, lt = vx[last], stime[vp[last]]
        lr_t = _time_at(rst, _last_before(rsx, rst, lx, np.full(len(lx), len(log) + 1, np.int64)))
        held += int(np.count_nonzero((lt > lr_t) & (lt > final_clear)))
    return st, held


def _chain(parent_node: int | None, local_hashes: Sequence[int]) -> list[int]:
    out: list[int] = []
    node = parent_node
    for h in local_hashes:
        node = int(h) if node is None else _xxh3(_pack2(node, int(h)), XXH3_SEED)
        out.append(node)
    return out


def _chain_fast(parent_node: int | None, local: list[int]) -> list[int]:
    """:func:`_chain` for a list of Python ints: the one per-block Python loop of a replay."""
    xxh3, pack2, seed = _xxh3, _pack2, XXH3_SEED
    if parent_node is None:
        out = [local[0]]
        node = local[0]
        rest = local[1:]
    else:
        out, node, rest = [], parent_node, local
    append = out.append
    for h in rest:
        node = xxh3(pack2(node, h), seed)
        append(node)
    return out


def chain_nodes(local_hashes: Sequence[int]) -> list[int]:
    """The index node names along a prompt: the router's sequence hashes of its local hashes."""
    return _chain(None, local_hashes)
