"""The storage finding's routing impact, split between its two causes (issue 43).

One candidate (rank 0 of a :class:`~kvalign.oracles.router_pair.RouterPair`) holds a prompt's pages only
in HiCache's storage tier (SGLang's real cache, ``file`` backend: cached, written through, evicted from
device and host); the other holds its first ``k`` pages on device. For every ``k`` the real router routes
the state :data:`~kvalign.oracles.router_pair.ROUTES` times and each engine then serves the prompt
(SGLang's prefetch from storage, then its scheduler's admission: ``cached_tokens``). The same is measured
twice: as SGLang publishes (nothing for a page in storage), and with the missing events restored, rank 0's
own device stores published again with ``medium="DISK"`` (SGLang's ``StorageMedium.DISK``, which Dynamo's
relay files in its disk tier). A wrong choice that restoring the events fixes is owed to the missing events
(``STORAGE_TIER_UNCREDITED``, cache-blind); one that stays is owed to the router's ``disk_cache_hit_weight``
(``DISK_CREDIT_WEIGHTED``: a documented router setting, ``--router-disk-cache-hit-weight``, so a bounded
credit skew). A tie (the router split its picks) is neither.

SGLang prefetches from storage only a stretch of at least ``prefetch_threshold`` tokens (default 256:
``HybridCacheController.parse_storage_backend_extra_config``; ``UnifiedRadixCache.prefetch_from_storage``
declines shorter ones). The check's examples use a one-page threshold, so :func:`assess_storage` measures
at the counterexample's threshold and again at SGLang's default with a 256-token stretch, and says both.

Dynamo's other route to storage credit, ``shared_cache_type="hicache"`` (``--shared-cache-type hicache``),
is not driven: :data:`HICACHE_ROUTE_SKIPPED` says why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvalign.model.causes import Cause
from kvalign.verify.engine.trials import TAIL, Trial, tie_share, trials_said, worst_flip
from kvalign.verify.engine.rows import RowResult

#: SGLang 0.5.23's default ``prefetch_threshold`` (tokens), from its storage extra config's parser.
SGLANG_DEFAULT_PREFETCH_THRESHOLD = 256

#: Why Dynamo 1.6.1's shared-cache route is not driven here (the report and the row say it).
HICACHE_ROUTE_SKIPPED = (
    "Dynamo 1.6.1's shared_cache_type=\"hicache\" route (--shared-cache-type hicache, experimental) is not driven: "
    "the router takes the store's layout from the worker card's engine-specific key sglang_hicache_mooncake, "
    "which dynamo.sglang's register.py publishes only when SGLang's --hicache-storage-backend is \"mooncake\", and "
    "credits a page from the Mooncake object events it reads at that data's kv_events_endpoint "
    "(DYN_MOONCAKE_KV_EVENTS_ENDPOINT), under SGLang's Mooncake keys (the key prefix, the TP/MLA layout); SGLang's "
    "mooncake backend needs the mooncake-transfer-engine wheel (a CUDA/RDMA build, not installed: `import mooncake` "
    "fails here) and a Mooncake master, so no real store can stand behind it on this CPU machine, and a stand-in "
    "master would test kvalign's guess of the event format, not Dynamo's contract")


@dataclass
class StorageImpact:
    """The real router's choices when one candidate holds a prompt's pages only in HiCache's storage tier."""

    page_size: int
    eagle: bool
    storage_pages: int
    shared: bool  # the other candidate refills from the same storage directory (False: its own, empty)
    disk_events: bool  # rank 0's storage pages published to the router as DISK stores (the missing events restored)
    prefetch_threshold: int  # SGLang's, in tokens (a shorter storage hit is not prefetched)
    disk_weight: float  # the router's disk_cache_hit_weight
    trials: list[Trial] = field(default_factory=list)

    @property
    def changes_worker(self) -> bool:
        return any(t.changed for t in self.trials)

    def setup(self) -> str:
        where = ("both candidates on one storage directory (the file backend's shared dir)"
                 if self.shared else "each candidate on its own storage directory (as `e2e fuzz --storage file` runs)")
        events = (f"its storage pages published as DISK events (the router's disk weight {self.disk_weight:g})"
                  if self.disk_events else "no event for its storage pages (as SGLang publishes)")
        return (f"page size {self.page_size}{' (EAGLE)' if self.eagle else ''}, prefetch_threshold "
                f"{self.prefetch_threshold} tokens, one candidate holding {self.storage_pages} page(s) in storage only "
                f"with {events}, {where}")

    def says(self) -> str:
        flips = [t for t in self.trials if t.changed]
        if flips:
            t = worst_flip(flips)  # the largest loss
            picked = "it" if t.chosen == 1 else "the first"
            return (f"changes the worker for {len(flips)} of {len(self.trials)} k ({', '.join(str(f.k) for f in flips)})"
                    f": {self.setup()}; with the other holding {t.k} page(s) on device the router picks {picked} every "
                    f"time, which reuses {t.reused[t.chosen]} tokens where the {'first' if t.chosen == 1 else 'other'} "
                    f"would reuse {t.reused[1 - t.chosen]}; {tie_share(self.trials)}")
        ks = trials_said(self.trials)
        return (f"does not change the worker: {self.setup()}; other candidate holding k pages on device: {ks}; "
                f"{tie_share(self.trials)}")

    def as_dict(self) -> dict[str, Any]:
        return {"page_size": self.page_size, "eagle": self.eagle, "storage_pages": self.storage_pages,
                "shared": self.shared, "disk_events": self.disk_events, "prefetch_threshold": self.prefetch_threshold,
                "disk_weight": self.disk_weight, "trials": [t.as_dict() for t in self.trials]}


def as_disk(raw: Sequence[Any]) -> list[Any]:
    """SGLang's device-medium stores of pages, again with ``medium="DISK"``: what a storage tier's events would
    say of the same pages (same block hashes, parents and tokens; SGLang's own ``BlockStored`` type)."""
    import msgspec

    return [msgspec.structs.replace(ev, medium="DISK") for ev in raw
            if type(ev).__name__.startswith("BlockStored") and getattr(ev, "medium", None) in (None, "GPU")]


def measure_storage_routing(page_size: int, eagle: bool, storage_pages: int, *, shared: bool, path: Any,
                            disk_events: bool = False, prefetch_threshold: int | None = None,
                            ks: Sequence[int] | None = None, pair: Any = None,
                            make_engine: Callable[..., Any] | None = None) -> StorageImpact:
    """For each k (default 0 .. storage_pages): the router's choices between an engine holding the prompt's pages
    only in storage (rank 0) and one holding its first k pages on device (rank 1), on a storage directory of its
    own or the same one, and what each then reuses (SGLang's own answer). ``disk_events``: rank 0's storage pages
    are published to the router as DISK stores. ``prefetch_threshold``: SGLang's (None: one page, as the check's
    examples run)."""
    from kvalign.oracles.router_pair import RouterPair
    from kvalign.oracles.storage import StorageEngine

    make = make_engine or StorageEngine
    p, extra = page_size, int(eagle)
    own = pair is None
    pair = pair or RouterPair(path, p, eagle)
    threshold = max(prefetch_threshold or p, p)  # SGLang's cache controller: max(prefetch_threshold, page_size)
    impact = StorageImpact(p, eagle, storage_pages, shared, disk_events, threshold, pair.disk_weight)
    # each measurement (events, sharing) and each trial in its own token range of the long-lived router
    # (a prompt uses 4 token values; k stays below 4096)
    salt = (2 << 20) + (1 << 16) * (2 * int(disk_events) + int(shared))
    try:
        for k in (range(storage_pages + 1) if ks is None else ks):
            base = salt + (k + 1) * 16
            prompt = [base + 1 + (i % 3) for i in range(storage_pages * p + extra)] + [base] * TAIL
            a = make(p, eagle=eagle, prefetch_threshold=threshold)
            try:
                b = make(p, eagle=eagle, prefetch_threshold=threshold, storage_dir=a.storage_dir if shared else None)
                try:
                    impact.trials.append(_trial(k, prompt, a, b, pair, storage_pages, p, extra, disk_events))
                finally:
                    b.close()  # the second engine first: the first's close gives back what was pinned after it
            finally:
                a.close()
    finally:
        if own:
            pair.close()
    return impact


def _trial(k: int, prompt: list[int], a: Any, b: Any, pair: Any, n: int, p: int, extra: int, disk_events: bool) -> Trial:
    a.insert(prompt)
    if not a.pump():
        raise RuntimeError("SGLang's storage writes did not finish")
    a.evict(1 << 16)
    a.evict_host(1 << 16)
    held = a.tiers(prompt)
    if (held.device, held.host, held.storage) != (0, 0, n):
        raise RuntimeError(f"the storage-only state did not build: SGLang holds {held}")
    if k:
        b.insert(prompt[: k * p + extra])
        b.pump()
    raw = a.take_raw_events()
    pair.publish(0, raw + (as_disk(raw) if disk_events else []))
    pair.publish(1, b.take_raw_events())
    pair.settle(prompt, {0: (0, 0, n if disk_events else 0), 1: (k, 0)})
    picks = pair.picks(prompt)
    reused = []
    for engine in (a, b):
        engine.refill(prompt)
        reused.append(engine.serve(prompt).cached_tokens)
    return Trial(k, picks, (reused[0], reused[1]))


@dataclass
class Split:
    """Per k, which cause a wrong choice as SGLang publishes is owed to, from the same k with the events restored."""

    without: StorageImpact
    restored: StorageImpact

    def ks(self, which: str) -> list[int]:
        pairs = list(zip(self.without.trials, self.restored.trials, strict=True))
        if which == "events":  # wrong as published, right (not a tie) with the storage pages' events restored
            return [w.k for w, r in pairs if w.changed and not r.changed and not r.tie]
        if which == "weight":  # wrong with the events restored: the disk weight
            return [r.k for _w, r in pairs if r.changed]
        if which == "ties":  # a tie as published (the headline example of issue 43), or with the events restored
            return [w.k for w, r in pairs if w.tie or r.tie]
        raise ValueError(which)

    def says(self) -> str:
        n = len(self.without.trials)
        ev, wt = self.ks("events"), self.ks("weight")
        w = self.restored.disk_weight
        return (f"of {n} k, as SGLang publishes the router {self.without.says()}; with the storage pages published "
                f"as DISK events it {self.restored.says()}; owed to the missing events "
                f"({Cause.STORAGE_TIER_UNCREDITED.name}): {len(ev)} of {n} k ({_ks(ev)}); owed to the router's disk "
                f"weight {w:g} ({Cause.DISK_CREDIT_WEIGHTED.name}, credit-skew: --router-disk-cache-hit-weight): "
                f"{len(wt)} of {n} k ({_ks(wt)})")

    def as_dict(self) -> dict[str, Any]:
        return {"without_events": self.without.as_dict(), "disk_events": self.restored.as_dict(),
                "missing_events_k": self.ks("events"), "disk_weight_k": self.ks("weight"), "tie_k": self.ks("ties")}


def _ks(ks: list[int]) -> str:
    return "k = " + ", ".join(map(str, ks)) if ks else "none"


def measure_split(page_size: int, eagle: bool, storage_pages: int, *, shared: bool, path: Any,
                  prefetch_threshold: int | None = None, ks: Sequence[int] | None = None,
                  make_engine: Callable[..., Any] | None = None) -> Split:
    """The same trials without and with the storage pages' DISK events, on one router pair."""
    from kvalign.oracles.router_pair import RouterPair

    pair = RouterPair(path, page_size, eagle)
    try:
        kw = dict(shared=shared, path=path, prefetch_threshold=prefetch_threshold, ks=ks, pair=pair,
                  make_engine=make_engine)
        return Split(measure_storage_routing(page_size, eagle, storage_pages, disk_events=False, **kw),
                     measure_storage_routing(page_size, eagle, storage_pages, disk_events=True, **kw))
    finally:
        pair.close()


def default_threshold_ks(pages: int, weight: float) -> list[int]:
    """The k measured at SGLang's default threshold (a 256-token stretch is too many pages to route every k):
    none, one page, either side of where the restored disk credit (pages x weight) equals k, all but one, all."""
    edge = int(pages * weight)
    return sorted({0, 1, edge, edge + 1, pages - 1, pages} & set(range(pages + 1)))


def assess_storage(r: RowResult, path: Any) -> None:
    """A STORAGE_TIER_UNCREDITED row: the routing impact at its counterexample (page size, refilled pages, the
    one-page prefetch_threshold the check runs), with storage private to each worker and shared by both, each
    without and with the storage pages' DISK events; then at SGLang's default prefetch_threshold (256 tokens)
    with a stretch that reaches it, private storage. The row's class stays cache-blind (no event says a page is
    in storage: no constant bounds the lost credit); ``changes_worker`` is whether a choice owed to the missing
    events changed the worker; the share owed to the router's disk weight is said beside it."""
    ex = r.counterexample or {}
    missing = [k for k in ("page_size", "uncredited_pages") if ex.get(k) is None]
    if missing:
        raise ValueError(f"{r.prop}/{r.mode}/{r.variant}: the counterexample has no {', '.join(missing)}")
    p, n, eagle = int(ex["page_size"]), int(ex["uncredited_pages"]), r.mode == "eagle"
    private = measure_split(p, eagle, n, shared=False, path=path)
    shared = measure_split(p, eagle, n, shared=True, path=path)
    big = -(-SGLANG_DEFAULT_PREFETCH_THRESHOLD // p)
    default = measure_split(p, eagle, big, shared=False, path=path, prefetch_threshold=SGLANG_DEFAULT_PREFETCH_THRESHOLD,
                            ks=default_threshold_ks(big, private.restored.disk_weight))
    splits = {"private": private, "shared": shared, "default_threshold": default}
    r.changes_worker = any(s.ks("events") for s in splits.values())
    r.routing = {name: s.as_dict() for name, s in splits.items()}
    r.routing["shared_cache_route"] = HICACHE_ROUTE_SKIPPED
    trials = [t for s in splits.values() for m in (s.without, s.restored) for t in m.trials]
    r.impact = (f"no constant bound (the pages SGLang refills and loads back: up to the prompt's pages in storage); "
                f"measured at the counterexample's prefetch_threshold ({private.without.prefetch_threshold} tokens, one "
                f"page: the check's examples) and at SGLang's default ({SGLANG_DEFAULT_PREFETCH_THRESHOLD} tokens); "
                f"each state routed {sum(trials[0].picks)} times, a tie decided {sum(t.tie for t in trials)} of "
                f"{len(trials)} routed states (each named below, never counted as a flip). Private storage: "
                f"{private.says()}. Shared storage: {shared.says()}. At SGLang's default prefetch_threshold, "
                f"{big} page(s) in storage, private storage: {default.says()}. {HICACHE_ROUTE_SKIPPED}")
